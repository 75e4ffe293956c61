"""Seconds a transformer block's kernels take on a device: matmuls, attention and the memory-bound rest.

A device with a kernel table (`KernelRates`, from microbenchmarks named in hardware.py) is modelled kernel by
kernel. Each matmul is a roofline: the longer of its FLOPs at the device's achievable matmul rate (the best
large GEMM measured, MAMF) and its operands' bytes at the memory bandwidth, so narrow tensor-parallel shards
and small microbatches lose what they lose. Attention runs a fused (flash) kernel at the rate its authors
measured forward and backward (a run on the older Triton kernel: slower by the factor FlashAttention-2's paper
measured), skipping the masked half of a causal sequence; without one (CPU dropout, or a
run that used none) its two products are matmuls and its s × s scores stream through memory. Everything else
(norms, activations, dropout, residual adds, rotary) is memory-bound: a Llama block's ops counted one by one as
eager PyTorch runs them (eager_ops.py); other blocks' as every tensor the block keeps for backward written and
read once forward and read, and its gradient written and read, in backward (activations.py counts them). A
device without a table (a CPU rank, a cluster described by flags) keeps one achievable
fraction of peak for everything (assumptions.ACHIEVABLE_FLOPS_FRACTION).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import assumptions as A
from .activations import Numerics, block_activations
from .eager_ops import counts_op_by_op, eager_llama_bytes
from .hardware import DeviceSpec, Kernels
from .spec import ModelSpec

# The FLOPs a fused attention kernel's backward does, as a multiple of its forward's (it recomputes the scores:
# FlashAttention-2's own accounting, in which its measured rates are stated).
_FLASH_BACKWARD = 2.5
# Passes over the s × s scores per token without a fused kernel: forward writes them, the softmax reads them
# and writes the probabilities; backward reads the probabilities and the incoming gradient and writes one.
_SCORE_PASSES_FORWARD, _SCORE_PASSES_BACKWARD = 3, 3
# Output tile of a large half-precision GEMM (rows, columns), as NVIDIA's GEMM guide takes it for A100.
_TILE = (256, 128)
# Memory-bound passes per byte a block keeps: forward writes it and the next op reads it; backward reads it,
# writes its gradient and reads that gradient again.
_KEPT_PASSES_FORWARD, _KEPT_PASSES_BACKWARD = 2, 3


@dataclass(frozen=True)
class BlockSeconds:
    """One pass of `tokens` through a block (or the head) on one rank, forward and backward, by kernel kind."""

    matmul_forward: float
    attention_forward: float
    memory_forward: float
    matmul_backward: float
    attention_backward: float
    memory_backward: float

    @property
    def forward(self) -> float:
        return self.matmul_forward + self.attention_forward + self.memory_forward

    @property
    def backward(self) -> float:
        return self.matmul_backward + self.attention_backward + self.memory_backward

    @property
    def memory(self) -> float:
        return self.memory_forward + self.memory_backward

    def scaled(self, k: float) -> "BlockSeconds":
        return BlockSeconds(*(k * v for v in (self.matmul_forward, self.attention_forward, self.memory_forward,
                                               self.matmul_backward, self.attention_backward, self.memory_backward)))


def modelled(spec: ModelSpec, device: DeviceSpec) -> bool:
    """Whether the kernel-by-kernel model applies: a device with a kernel table and a transformer of known shapes."""
    return device.rates is not None and spec.traced is None


def _waves(rows: float, cols: float, device: DeviceSpec) -> float:
    """Share of the SMs a product's output tiles keep busy: the last wave of tiles runs partly empty (NVIDIA's
    "Matrix Multiplication Background" guide: wave quantization, with its 256 × 128 tiles)."""
    tiles = math.ceil(rows / _TILE[0]) * math.ceil(cols / _TILE[1])
    sms = device.rates.sms
    return tiles / (math.ceil(tiles / sms) * sms)


def _matmul(m: float, k: float, n: float, dtype_bytes: int, device: DeviceSpec, peak: float) -> float:
    """Roofline of one [m, k] × [k, n] product: compute at the achievable rate in the waves its [m, n] output's
    tiles fill, or its operands at bandwidth."""
    flops = 2 * m * k * n
    moved = dtype_bytes * (m * k + k * n + m * n)
    return max(flops / (device.rates.matmul * _waves(m, n, device) * peak), moved / device.streaming_bandwidth)


def _matmul_backward(m: float, k: float, n: float, dtype_bytes: int, device: DeviceSpec, peak: float) -> float:
    """A product's two gradients: the input's ([m, n] × [n, k]) and the weight's ([k, m] × [m, n])."""
    return (_matmul(m, n, k, dtype_bytes, device, peak) + _matmul(k, m, n, dtype_bytes, device, peak))


def block_matmuls(spec: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """(k, n) of a block's weight products on one tensor-parallel rank: the column-parallel projections split
    their outputs, the row-parallel ones their inputs."""
    d = spec.hidden // spec.heads
    qkv = (spec.heads + 2 * spec.kv_heads) * d
    up = spec.ffn * (2 if spec.gated_mlp else 1)
    return [(spec.hidden, qkv / tp), (spec.heads * d / tp, spec.hidden), (spec.hidden, up / tp),
            (spec.ffn / tp, spec.hidden)]


def _attention(spec: ModelSpec, tokens: float, seq: int, dtype_bytes: int, tp: int, kernels: Kernels,
               device: DeviceSpec, peak: float) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (QKᵀ, softmax, ·V) for `tokens` on one rank."""
    heads = spec.heads / tp
    d = spec.hidden // spec.heads
    flops = 4 * tokens * seq * heads * d                  # both products, every query against every key
    dropout = spec.attention_dropout > 0
    if kernels.flash_attention and (kernels.flash_attention_dropout or not dropout):
        done = flops * (0.5 if spec.causal else 1.0)    # a causal kernel skips the masked blocks
        rate = device.rates.attention * peak
        if kernels.triton_flash_attention:
            rate /= A.TRITON_FLASH_ATTENTION_SLOWDOWN
        return done / rate, _FLASH_BACKWARD * done / rate
    sequences = tokens / seq
    per_head = _matmul(seq, d, seq, dtype_bytes, device, peak) * 2   # scores, then probabilities · V
    products = sequences * heads * per_head
    scores = tokens * seq * heads * dtype_bytes / device.streaming_bandwidth
    return products + _SCORE_PASSES_FORWARD * scores, 2 * products + _SCORE_PASSES_BACKWARD * scores


def block_seconds(spec: ModelSpec, tokens: float, seq: int, numerics: Numerics, tp: int, sequence_parallel: bool,
                  device: DeviceSpec, peak: float) -> BlockSeconds:
    """One transformer block's kernels for `tokens` tokens (a microbatch) on one rank."""
    low = numerics.compute
    shapes = block_matmuls(spec, tp)
    products = sum(_matmul(tokens, k, n, low, device, peak) for k, n in shapes)
    gradients = sum(_matmul_backward(tokens, k, n, low, device, peak) for k, n in shapes)
    attention_fwd, attention_bwd = _attention(spec, tokens, seq, low, tp, device.kernels, device, peak)
    if counts_op_by_op(spec, numerics):
        forward, backward = eager_llama_bytes(spec, numerics, device.kernels, tp, sequence_parallel)
        return BlockSeconds(products, attention_fwd, forward * tokens / device.streaming_bandwidth,
                            gradients, attention_bwd, backward * tokens / device.streaming_bandwidth)
    kept = block_activations(spec, seq, numerics, device.kernels).per_rank(tp, sequence_parallel) * tokens
    if not (device.kernels.flash_attention and (device.kernels.flash_attention_dropout
                                                or spec.attention_dropout == 0)):
        kept -= tokens * seq * spec.heads / tp * low     # the scores' passes are counted with attention
    stream = kept / device.streaming_bandwidth
    return BlockSeconds(products, attention_fwd, _KEPT_PASSES_FORWARD * stream,
                        gradients, attention_bwd, _KEPT_PASSES_BACKWARD * stream)


def head_seconds(spec: ModelSpec, tokens: float, numerics: Numerics, tp: int, device: DeviceSpec,
                 peak: float) -> BlockSeconds:
    """The output head's product (and a ViT's patch projection) for `tokens` on one rank; the loss's logits
    stream through memory once forward and once backward."""
    shapes = []
    if spec.head_outputs:
        shapes.append((spec.hidden, spec.head_outputs / tp))
    if spec.input_elements_per_token:
        shapes.append((spec.input_elements_per_token, spec.hidden))
    products = sum(_matmul(tokens, k, n, numerics.compute, device, peak) for k, n in shapes)
    gradients = sum(_matmul_backward(tokens, k, n, numerics.compute, device, peak) for k, n in shapes)
    logits = 2 * tokens * spec.head_outputs / tp * numerics.logits_bytes / device.streaming_bandwidth
    return BlockSeconds(products, 0.0, logits, gradients, 0.0, logits)
