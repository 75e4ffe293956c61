"""Activation bytes a rank keeps for backward, counted tensor by tensor from what PyTorch saves.

The count follows Korthikanti et al. ("Reducing Activation Recomputation in Large
Transformer Models", 2022) but per saved tensor, so it also holds for fp32, for
HF's Python activations (GELU-tanh saves five ffn-sized tensors), for the
attention kernel in use and for the dtypes the runtime computes in (`Numerics`).
Tensor parallelism (Megatron) shards everything between the column- and
row-parallel linears; norms, their inputs and residual dropout masks stay
replicated unless sequence parallelism shards them over the sequence. The inputs
the column-parallel linears keep for their weight gradients stay whole either
way: torch keeps the input they gathered (Megatron re-gathers it in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ..config.recompute import checkpointing_group_size, split_policy
from .errors import PlanError
from .hardware import Kernels
from .spec import ModelSpec

# ffn-sized tensors an activation function saves besides its output (which the next linear keeps).
_ACTIVATION_SAVES = {"gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "swish": 1, "relu": 0,
                     "gelu_new": 4, "quick_gelu": 2}
_FP32 = 4
# The strategies the search considers, in SMP's names for set_activation_checkpointing (plus "none").
# A region of k blocks keeps L/k inputs and recomputes k blocks at once, least at k* = sqrt(L·input/block);
# a block keeps some 10-40 times its input, so k* stays between 1 and 4 up to some 250 blocks a stage:
# groups of 2 and 4 bracket it, and "contiguous" (k = L) covers shallow stages. "each:matmul" keeps every
# block's matrix products too (op-selective): more memory than "each", no matmul recomputed.
CHECKPOINTING = ("none", "each", "each:matmul", "contiguous", "group_2", "group_4")
# "alternate_matmul" (config/recompute.POLICIES; parallel/recompute/selective.AlternateMatmul) is torchtitan's "op"
# selective checkpointing (torchtitan/parallelisms/parallelize_llama.py, `no_recompute_list` at 1ea476e,
# `_save_list` and `_custom_policy` at 9dec370): it keeps the attention kernel's outputs and, counting a block's
# aten.mm calls in forward order, every other one (the 1st, 3rd, ...: "Saves output of all compute ops, except
# every second mm"), recomputing the rest in backward. The search does not propose it.
_KEEPING_MATMULS = ("matmul", "alternate_matmul")


def region_blocks(strategy: str, stage_layers: int) -> int:
    """Blocks one checkpointed region spans on a stage of `stage_layers` blocks: 0 for "none", 1 for "each",
    the stage's whole run for "contiguous", k (at most the run) for "group_k"."""
    try:
        name = split_policy(strategy)[0]
        if name == "none":
            return 0
        size = checkpointing_group_size(name)
    except ValueError:
        raise PlanError(f"activation checkpointing {strategy!r}: use 'none' or one of SMP's strategies 'each', "
                        "'contiguous', 'group_<k>' (k a positive integer, e.g. 'group_2'), optionally with "
                        "an op-selective policy ('each:matmul', or torchtitan's 'each:alternate_matmul')") from None
    return min(size or stage_layers, stage_layers)


def keeps_matmuls(strategy: str) -> bool:
    """Whether a strategy's regions keep matrix products' outputs (the "matmul" policy: all of them;
    "alternate_matmul": every other one)."""
    return split_policy(strategy)[1] in _KEEPING_MATMULS


def _policy(strategy: str) -> str | None:
    return split_policy(strategy)[1]


def _projections(spec: ModelSpec) -> list[tuple[int, int, bool]]:
    """(input width, output width, row-parallel) of a Llama block's weight products in the order its forward
    issues them: q, k, v, o, then gate, up, down (torchtitan's `w2(silu(w1(x)) * w3(x))`, Hugging Face's
    `down_proj(act(gate_proj(x)) * up_proj(x))`). Bias-free, each is one aten.mm."""
    d = spec.hidden // spec.heads
    h, q, kv = spec.hidden, spec.heads * d, spec.kv_heads * d
    up = [(h, spec.ffn, False)] * (2 if spec.gated_mlp else 1)
    return [(h, q, False), (h, kv, False), (h, kv, False), (q, h, True), *up, (spec.ffn, h, True)]


def _alternate_projections(spec: ModelSpec) -> list[tuple[int, int, bool]]:
    """The products "alternate_matmul" keeps: the 1st, 3rd, ... of `_projections` (q, v, gate, down)."""
    if spec.family != "llama":
        raise PlanError(f"model {spec.name!r}: the 'alternate_matmul' policy (torchtitan's) is modelled for Llama "
                        f"blocks, whose projections are separate bias-free products; not for {spec.family!r}")
    return _projections(spec)[0::2]


def recomputed_matmul_share(spec: ModelSpec, strategy: str) -> float:
    """Share of a block's weight-product FLOPs a checkpointed region computes again in backward: all of them
    without a policy, none under "matmul", the products "alternate_matmul" does not keep (k, o, up: 37 % of
    Llama 3 8B's)."""
    policy = _policy(strategy)
    if policy == "matmul":
        return 0.0
    if policy is None:
        return 1.0
    every = sum(k * n for k, n, _ in _projections(spec))
    return 1 - sum(k * n for k, n, _ in _alternate_projections(spec)) / every


def distinct_strategies(stage_layers: int, groups: bool = True, policies: bool = True) -> list[str]:
    """The strategies of CHECKPOINTING that give different regions on a stage of `stage_layers` blocks (the
    first name of each, so "contiguous" stands for a group as long as the stage); without `groups` (blocks
    the runtime cannot group: a ModuleList, a module-graph cut) only "none" and "each"; without `policies`
    (blocks whose ops the planner does not know: traced, or a module-graph cut's stages) none keeping matmuls."""
    names = [name for name in (CHECKPOINTING if groups else CHECKPOINTING[:3]) if policies or ":" not in name]
    regions = {}
    for name in names:
        regions.setdefault((region_blocks(name, stage_layers), keeps_matmuls(name)), name)
    return list(regions.values())


def _mlp_tensors(spec: ModelSpec) -> int:
    """ffn-sized tensors the MLP keeps: activation's own + its output (+ up and gate·up when gated)."""
    if spec.activation not in _ACTIVATION_SAVES:
        raise PlanError(f"model {spec.name!r}: unknown activation {spec.activation!r}; "
                        f"the planner knows {', '.join(sorted(_ACTIVATION_SAVES))}")
    return _ACTIVATION_SAVES[spec.activation] + (3 if spec.gated_mlp else 1)


@dataclass(frozen=True)
class Numerics:
    """Bytes per element of what a step keeps, by kind (memory.py derives them from the config).

    `compute` is the dtype the blocks run in. Under autocast the residual stream (each
    norm's input) and the embedding stay fp32, and every weight a matmul reads is cast
    and that copy kept for backward (`weight_copies` bytes per parameter). The loss
    reads the logits in `logits` bytes and keeps an fp32 log-softmax.
    """

    compute: int
    residual: int = 0      # 0: same as compute
    logits: int = 0        # 0: same as compute
    weight_copies: int = 0

    @property
    def residual_bytes(self) -> int:
        return self.residual or self.compute

    @property
    def logits_bytes(self) -> int:
        return self.logits or self.compute


def _attention_bytes(spec: ModelSpec, seq: int, dtype_bytes: int, mask_bytes: int, kernels: Kernels) -> float:
    """Per token: Q, K, V, the attention output, and the kernel's own state."""
    head_dim = spec.hidden // spec.heads
    qkv = (spec.heads + 2 * spec.kv_heads) * head_dim
    out = spec.heads * head_dim * dtype_bytes
    dropout = spec.attention_dropout > 0
    if kernels.flash_attention and (kernels.flash_attention_dropout or not dropout):
        return qkv * dtype_bytes + out + spec.heads * _FP32     # + log-sum-exp per head
    # The math path keeps the s × s probabilities; on CPU it computes (and keeps) them, Q, K and V in fp32.
    inner = max(dtype_bytes, kernels.math_attention_bytes)
    mask = max(mask_bytes, kernels.math_attention_bytes)
    probs = spec.heads * seq
    return qkv * inner + out + probs * inner + (probs * (mask + inner) if dropout else 0)


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token one transformer block keeps, split by how tensor parallelism treats them.

    `replicated`: whole on every rank (the norms' outputs, which the column-parallel linears keep; with
    sequence parallelism gathering them again in backward, `regather`, 1/tp of the sequence like the rest);
    `sequence`: whole under plain tensor parallelism, 1/tp of the sequence with sequence parallelism
    (the residual stream as each norm's input, the norms' statistics, residual dropout masks);
    `sharded`: split over heads and MLP units.
    """

    replicated: float
    sequence: float
    sharded: float

    def per_rank(self, tp: int, sequence_parallel: bool = False, regather: bool = False) -> float:
        split = tp if sequence_parallel else 1
        return self.replicated / (split if regather else 1) + self.sequence / split + self.sharded / tp


def block_activations(spec: ModelSpec, seq: int, numerics: Numerics, kernels: Kernels = Kernels()) -> BlockActivations:
    """What one block keeps per token without checkpointing (a traced block: as traced in fp32, scaled to the
    compute dtype; tensor parallelism does not split it)."""
    if spec.traced:
        return BlockActivations(spec.traced.block_saved_bytes * numerics.compute / _FP32, 0.0, 0.0)
    low = numerics.compute
    mask = kernels.dropout_mask_bytes or low
    h = spec.hidden
    # Two norms: input (the residual stream) and output each (RMSNorm in HF also keeps its
    # normalised product, a fused kernel does not), plus their per-token statistics (mean and rstd, or rstd only).
    # An eager RMSNorm (Hugging Face's, torchtitan's "rmsnorm") computes in fp32, keeps its input upcast, and its
    # normalised product cast back to the input's (the residual stream's) dtype.
    eager_rmsnorm = spec.norm == "rmsnorm" and not kernels.fused_rmsnorm
    products, norm_stats = (1 if eager_rmsnorm else 0, 1) if spec.norm == "rmsnorm" else (0, 2)
    norm_input = max(numerics.residual_bytes, _FP32) if eager_rmsnorm else numerics.residual_bytes
    outputs = 2 * h * low
    sequence = 2 * (h * norm_input + products * h * numerics.residual_bytes + norm_stats * _FP32)
    if spec.hidden_dropout > 0:
        sequence += 2 * h * mask                         # after attention and after the MLP
    sharded = _attention_bytes(spec, seq, low, mask, kernels) + _mlp_tensors(spec) * spec.ffn * low
    return BlockActivations(outputs, sequence, sharded)


def matmul_outputs(spec: ModelSpec, seq: int, numerics: Numerics, kernels: Kernels = Kernels(),
                   policy: str = "matmul") -> BlockActivations:
    """What the "matmul" policy keeps of one block per token (selective_checkpointing.MATMUL_OPS): the Q/K/V and
    MLP up (and gate) projections' outputs and the attention kernel's, split over heads and units; the two
    output projections', whole on every rank (partial sums under tensor parallelism). "alternate_matmul" keeps
    the attention kernel's and every other projection's (q, v, gate; down whole). A traced block's ops are
    not known: 0."""
    if spec.traced:
        return BlockActivations(0.0, 0.0, 0.0)
    low = numerics.compute
    head_dim = spec.hidden // spec.heads
    qkv = (spec.heads + 2 * spec.kv_heads) * head_dim
    if kernels.flash_attention and (kernels.flash_attention_dropout or spec.attention_dropout == 0):
        attention = spec.hidden * low + spec.heads * _FP32          # output and log-sum-exp per head
    else:
        inner = max(low, kernels.math_attention_bytes)
        attention = (spec.heads * seq + spec.hidden) * inner        # scores and probabilities · V (two bmm)
    if policy == "alternate_matmul":
        kept = _alternate_projections(spec)
        return BlockActivations(sum(n for _, n, whole in kept if whole) * low, 0.0,
                                sum(n for _, n, whole in kept if not whole) * low + attention)
    sharded = qkv * low + attention + spec.ffn * low * (2 if spec.gated_mlp else 1)
    return BlockActivations(2 * spec.hidden * low, 0.0, sharded)


def kept_matmul_bytes(spec: ModelSpec, seq: int, numerics: Numerics, kernels: Kernels, tp: int,
                      sequence_parallel: bool, policy: str = "matmul") -> float:
    """Per token, what one block checkpointed with a policy keeping matmuls keeps on a rank besides its input:
    its matmul outputs and, under tensor parallelism, the collectives' outputs: each output projection's all-reduce
    (with sequence parallelism its reduce-scatter, 1/tp of it, and the all-gather of each column-parallel linear's
    input, whole); at most what the block keeps uncheckpointed."""
    whole = 2 * spec.hidden * numerics.compute
    collectives = (whole / tp + whole if sequence_parallel else whole) if tp > 1 else 0.0
    block = block_activations(spec, seq, numerics, kernels).per_rank(tp, sequence_parallel)
    return min(block, matmul_outputs(spec, seq, numerics, kernels, policy).per_rank(tp) + collectives)


def recomputed_elementwise_bytes(spec: ModelSpec, seq: int, numerics: Numerics, kernels: Kernels, tp: int,
                                 sequence_parallel: bool, policy: str = "matmul") -> float:
    """Per token, what a block keeping matmuls computes again in backward: the rest of what it keeps."""
    block = block_activations(spec, seq, numerics, kernels).per_rank(tp, sequence_parallel)
    return block - kept_matmul_bytes(spec, seq, numerics, kernels, tp, sequence_parallel, policy)


def edge_activations(spec: ModelSpec, numerics: Numerics, kernels: Kernels = Kernels()) -> tuple[float, float]:
    """(first stage, last stage) bytes per token outside the blocks, before tensor parallelism.

    The head keeps its logits and the fp32 log-softmax the loss computes from them;
    a vocabulary-parallel head shards both, so callers divide the logits part by tp.
    """
    if spec.traced:
        scale = numerics.compute / _FP32
        return spec.traced.first_saved_bytes * scale, spec.traced.last_saved_bytes * scale
    embedding = numerics.residual_bytes
    mask = kernels.dropout_mask_bytes or embedding
    first = spec.embedding_saved_elements * embedding + (spec.hidden * mask if spec.hidden_dropout > 0 else 0)
    last = spec.head_saved_elements * numerics.compute
    return first, last


def logits_bytes(spec: ModelSpec, numerics: Numerics, kernels: Kernels = Kernels()) -> float:
    """Per token: the logits as the loss reads them plus the loss's fp32 log-softmax; a fused cross-entropy keeps
    the head's own logits and one fp32 log-sum-exp."""
    if kernels.fused_cross_entropy and spec.head_outputs:
        return spec.head_outputs * numerics.compute + _FP32
    return spec.head_outputs * (numerics.logits_bytes + _FP32)


def loss_backward_bytes(spec: ModelSpec, numerics: Numerics, kernels: Kernels = Kernels()) -> float:
    """Per token: what the loss's backward adds to the head's tensors (`logits_bytes`). The logits, which nothing
    saves for backward, are gone; beside the saved fp32 log-softmax it makes the negative log-likelihood's gradient
    and the log-softmax's input gradient, both fp32 (MemTracker: GPT-2's and Llama's step peaks there, with two
    fp32 logit-sized temporaries and no gradient yet). A fused cross-entropy writes its gradient as it goes."""
    if kernels.fused_cross_entropy and spec.head_outputs:
        return 0.0
    return spec.head_outputs * (2 * _FP32 - numerics.logits_bytes)


class PipelineRank(NamedTuple):
    """What one pipeline rank holds as the runtime's cut and schedule leave it (memory.py's `pipeline_stages`)."""

    blocks: int
    in_flight: float        # microbatches whose activations it holds at its peak, in whole-rank units
    holds_first: bool       # the embedding's stage
    holds_last: bool        # the head's stage


@dataclass(frozen=True)
class ActivationMemory:
    device: float      # bytes kept on the device at the peak
    host: float = 0.0  # bytes offloaded to host memory
    backward_room: float = 0.0  # of `device`, what is free while the blocks run backward (the head's tensors
                                # beyond a recomputed region): room for a block's transient buffers
    at_loss_backward: Optional[float] = None  # on the device while the loss runs backward (None: not modelled)


def rank_activations(spec: ModelSpec, *, seq: int, micro_batch: int, numerics: Numerics, tp: int, pp: int,
                     in_flight: float, checkpointing: str, offload: bool = False, loading_horizon: int = 4,
                     kernels: Kernels = Kernels(), sequence_parallel: bool = False, regather: bool = False,
                     context_parallel: int = 1, stages: tuple[PipelineRank, ...] = ()) -> ActivationMemory:
    """Peak activation bytes on the busiest pipeline stage.

    Context parallelism of degree `context_parallel` leaves a rank 1/n of each sequence's tokens: everything
    per token divides by n, the attention of each still reaching the whole sequence (`kernels`: what it keeps,
    context.py's `saved_kernels`).

    `stages` gives the pipeline ranks to count (memory.py); without it, the first stage holds ⌈blocks / pp⌉
    blocks and `in_flight` microbatches (1F1B, capped by active_microbatches) and the last one. Checkpointing keeps
    each region's input (with sequence parallelism this rank's slice of it) and recomputes one region of one
    microbatch at a time;
    offload moves the kept inputs to the host except the `loading_horizon` regions prefetched for backward.
    `regather` (sequence_parallel_regather) keeps the gathered inputs of blocks run without checkpointing as sequence
    shards; a checkpointed region, and its recomputation, keeps them as without it.
    The first recompute starts once backward has passed the head, which frees the logits: so the peak is the
    larger of the head's tensors and one region's, not their sum. Autocast's weight copies count once (only
    pipelines overlap microbatches, and they do not autocast), for the blocks only while their region is
    recomputed.
    """
    tokens = micro_batch * seq / context_parallel
    if spec.graph_stages(pp):
        return _graph_stage_activations(spec, tokens, numerics, pp, in_flight, checkpointing)
    layers = spec.stage_layers(pp)
    copied_layers = region_blocks(checkpointing, layers) or layers     # also refuses an unknown strategy
    per_token = block_activations(spec, seq, numerics, kernels)
    block = per_token.per_rank(tp, sequence_parallel) * tokens
    uncheckpointed = per_token.per_rank(tp, sequence_parallel, regather) * tokens
    kept = 0.0  # per block, what a policy keeps besides its region's input (never offloaded)
    if keeps_matmuls(checkpointing):
        kept = kept_matmul_bytes(spec, seq, numerics, kernels, tp, sequence_parallel, _policy(checkpointing)) * tokens
    region_input = spec.hidden * numerics.residual_bytes * tokens / (tp if sequence_parallel else 1)

    def held(layers: int) -> tuple[float, float, float]:
        """(stored on the device, on the host, one region's recompute) for one microbatch of `layers` blocks."""
        group = region_blocks(checkpointing, layers)
        if not group:
            return float(layers * uncheckpointed), 0.0, 0.0
        regions = math.ceil(layers / group)
        stored, host, recompute = regions * region_input, 0.0, group * (block - kept)
        if offload:
            stored, host, recompute = 0.0, stored, recompute + min(regions, loading_horizon) * region_input
        return stored + layers * kept, host, recompute

    edges = spec.stage_parameters(pp) - layers * spec.layer_parameters
    copies = numerics.weight_copies * (edges + copied_layers * spec.layer_parameters) / tp
    first, last = edge_activations(spec, numerics, kernels)
    first, last = first * tokens, (last + logits_bytes(spec, numerics, kernels) / tp) * tokens
    if pp == 1:
        stored, host, recompute = held(layers)
        # the loss's backward: no region recomputed yet, the logits gone, its two gradients alive
        at_loss = stored + first + copies + last + loss_backward_bytes(spec, numerics, kernels) / tp * tokens
        return ActivationMemory(stored + first + max(last, recompute) + copies, host, max(0.0, last - recompute),
                                at_loss_backward=at_loss)
    stages = stages or (PipelineRank(layers, in_flight, True, False), PipelineRank(layers, 1, False, True))
    busiest, hosted = 0.0, 0.0
    for rank in stages:
        stored, host, recompute = held(rank.blocks)
        busiest = max(busiest, rank.in_flight * (stored + (first if rank.holds_first else 0.0))
                      + max(last if rank.holds_last else 0.0, recompute))
        hosted = max(hosted, rank.in_flight * host)
    return ActivationMemory(busiest + copies, hosted)


def _graph_stage_activations(spec: ModelSpec, tokens: int, numerics: Numerics, pp: int, in_flight: int,
                             checkpointing: str) -> ActivationMemory:
    """The busiest stage of a module-graph cut: stage s holds max(1, in_flight - s) microbatches (1F1B) of what
    it keeps; checkpointed, each stage keeps its input and recomputes the rest one microbatch at a time."""
    stages = spec.graph_stages(pp)
    scale = tokens * numerics.compute / _FP32
    received = [0.0] + [s.output_elements * _FP32 for s in stages[:-1]]  # per token, in fp32 like saved_bytes
    checkpointed = region_blocks(checkpointing, 1) > 0   # a stage's graph is one region
    busiest = 0.0
    for index, (stage, kept_input) in enumerate(zip(stages, received)):
        held = max(1, in_flight - index)
        if checkpointed:
            busiest = max(busiest, (held * kept_input + stage.saved_bytes) * scale)
        else:
            busiest = max(busiest, held * stage.saved_bytes * scale)
    return ActivationMemory(busiest)
