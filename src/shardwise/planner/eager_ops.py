"""Bytes the memory-bound ops of an eager Llama block move, op by op, per token on one rank.

Eager PyTorch runs every aten op as its own kernel, which reads its inputs and writes its output, the
intermediates nobody keeps included. Counted here from what Hugging Face's `LlamaDecoderLayer` dispatches, and
torchtitan's Llama block where it differs (`Kernels.complex_rotary`, `Kernels.repeated_kv_copies`; its RMSNorm,
MLP and residual adds are the same ops):

- an eager RMSNorm upcasts its input to fp32, squares it, takes the mean, scales by its rsqrt, casts back and
  multiplies by the weight (a fused kernel, `Kernels.fused_rmsnorm`, reads the input and writes the output);
  its backward runs the autograd of each of those ops;
- rotary embedding, on q and k: x·cos + rotate_half(x)·sin (a negation, a concatenation, two products, a sum),
  in backward their gradients, the slices' zero-filled gradients, and a copy of each gradient into the
  projections' layout; torchtitan's upcasts to fp32, multiplies by the complex frequencies and casts back, and
  its backward does the same to the gradient;
- torchtitan's key/value heads, copied out once per query head of their group, and in backward the copies'
  gradients summed back;
- the gated MLP's silu and product, and their gradients;
- the two residual adds, and in backward the sums of the gradients reaching each residual stream and each
  projection input (q, k and v; gate and up).

`tests/test_planner_eager_ops.py` counts the bytes of every aten op of a Hugging Face Llama block in fp32 and
bf16 that is neither a matmul, the attention kernel nor a view, forward and backward, against this count.
"""

from __future__ import annotations

from .activations import Numerics
from .hardware import Kernels
from .spec import ModelSpec

_FP32 = 4


def _rmsnorm_bytes(width: float, low: int, fused: bool) -> tuple[float, float]:
    """(forward, backward) bytes of one RMSNorm over `width` elements in dtype `low`, with its per-token
    statistics."""
    if fused:   # one kernel each way: input to output, and input, output gradient and rstd to input gradient
        return 2 * low * width + _FP32, 3 * low * width + _FP32
    casts = 0 if low == _FP32 else 2 * (low + _FP32)   # .float() and back, no-ops in fp32
    # forward: the upcast, pow, mean (reads), the product with rsqrt, the cast back, the weight's product
    forward = (casts + 2 * _FP32 + _FP32 + 2 * _FP32 + 2 * low) * width + 6 * _FP32
    # backward: the weight's two products and its sum, then in fp32 the product, rsqrt's, the mean's (sum, and a
    # division reading the per-token statistic), pow's (pow, product), the product with x, the two paths' sum; the
    # casts at both ends
    backward = (casts + 6 * low + 17 * _FP32) * width + 10 * _FP32
    return forward, backward


def eager_llama_bytes(spec: ModelSpec, numerics: Numerics, kernels: Kernels, tp: int,
                      sequence_parallel: bool) -> tuple[float, float]:
    """(forward, backward) bytes per token one Llama block's memory-bound ops move on a rank of `tp`: heads and
    MLP units split over the ranks, norms and residual adds over the sequence with sequence parallelism, the
    projections' gathered inputs whole (their gradients are summed before the group reduces them)."""
    c = numerics.compute
    d = spec.hidden // spec.heads
    h, whole = spec.hidden / (tp if sequence_parallel else 1), spec.hidden
    qk = (spec.heads + spec.kv_heads) * d / tp
    f = spec.ffn / tp
    norm_forward, norm_backward = _rmsnorm_bytes(h, c, kernels.fused_rmsnorm)
    if kernels.complex_rotary:   # the upcast, the complex product (fp32 pairs, complex64 frequencies), the cast back
        casts = 0 if c == _FP32 else 2 * (c + _FP32)
        rotary = (casts + 2 * _FP32) * qk + 2 * _FP32 * d
        rotary_forward = rotary_backward = rotary
    else:                        # cos and sin, each read once for q and once for k; backward copies the gradients
        tables = 2 * 2 * c * d
        rotary_forward, rotary_backward = 10 * c * qk + tables, (14 + 2) * c * qk + tables
    copies = 0.0
    if kernels.repeated_kv_copies and spec.kv_heads < spec.heads:   # k and v: read a group's head, write its copies
        copies = 2 * c * (spec.heads + spec.kv_heads) * d / tp
    forward = 2 * norm_forward + rotary_forward + copies + 2 * 3 * c * h + 5 * c * f
    backward = 2 * norm_backward + rotary_backward + copies + 9 * c * f + 2 * 3 * c * h + 3 * 3 * c * whole
    return forward, backward


def counts_op_by_op(spec: ModelSpec, numerics: Numerics) -> bool:
    """Whether the block's memory-bound ops are counted op by op: a dense Llama block computing in its stored
    dtype (under autocast the residual stream and the norms run in fp32 around low-precision matmuls, which this
    count does not follow)."""
    return (spec.family == "llama" and spec.gated_mlp and spec.norm == "rmsnorm" and spec.traced is None
            and numerics.residual_bytes == numerics.compute)
