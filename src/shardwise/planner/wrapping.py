"""What shardwise's data-parallel wrapping keeps on a rank, so predictions follow the runtime.

Measured with MemTracker on the runtime itself (tests/test_planner_measured.py):

Which wrapping and which precision mode a config gets on a layout is the runtime's
own decision, read from `config/decisions.py`:

- ZeRO-0, and ZeRO-1 in fp32, run under torch DDP. Mixed precision is autocast
  there: parameters, gradients and DDP's gradient buckets stay fp32, the residual
  stream too, and autocast keeps a low-precision copy of every weight a matmul reads
  for backward. With tensor or pipeline parallelism and several replicas FSDP2's
  `replicate` replaces DDP and casts by its policy; a lone replica is not wrapped
  and autocasts.
- ZeRO-1 (parallel/zero1/optimizer_state.py) deals whole tensors, largest first, to the
  least-loaded rank, so the busiest rank holds more than 1/n of the optimizer
  state, and broadcasts each updated tensor from its owner after the step.
- ZeRO-1 in bf16/fp16 (parallel/zero1/master_weights.py) keeps parameters and gradients
  in the compute dtype on every replica and fp32 masters of the rank's share beside
  the optimizer's moments; it computes as FSDP2 does (fp32 outputs). During every
  backward pass (under a pipeline, the last microbatch's) gradients travel to their
  owners in fp32 buckets of one owner each (parallel/zero1/gradient_buckets.py, whose
  rules `shares.py` gives): a bucket's half-precision gradients are freed when it
  is sent, so only those waiting for their bucket are alive at once, and beside
  the owner's fp32 master gradients at most two buckets are in flight.
  With `accumulate_gradients_locally` each microbatch's gradients but the last
  add up in fp32 buffers of the whole stage on every rank instead (freed as they
  are added), and the buffers travel once, with the last microbatch's backward.
- ZeRO-2/3 and MiCS run FSDP2 (`fully_shard` per block, then the root). Parameters
  are stored sharded in fp32 (they are the master copy) and gathered in the compute
  dtype: ZeRO-2 keeps every block gathered from its forward to its backward, ZeRO-3
  only the root (embedding, head) and the current and prefetched block; under ZeRO++
  hpZ (`zero_hpz_partition_size` n) every block keeps 1/n of its parameters in the
  compute dtype from its forward to its backward: when forward ends, with the root still
  gathered for the loss, all of them (bench/sharding.py: +6,318,080 bytes at the peak of
  GPT-2 4×256 over ZeRO-3, exactly 4 blocks' halves in fp32). (An untied
  embedding or head of half a block or more is a unit of its own and is freed too:
  this counts it gathered, an overestimate of at most those two.) Gradients
  are reduce-scattered and kept in fp32, and the root returns fp32 outputs. The
  root reduces its own gradients only when backward ends, so a tied embedding's,
  computed at the head, stays unsharded through the whole backward beside each
  block's (measured RSS, bench/memory_overhead.py: 0.1-0.4 GiB on GPT-2).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ..config.schema import ShardwiseConfig
from ..parallel.zero1.shares import BUCKET_BYTES, IN_FLIGHT, assign_owners, consecutive_buckets, fill_buckets
from ..topology import Layout
from ..config.decisions import Decisions, PrecisionMode, Wrapping
from . import assumptions as A
from .activations import Numerics
from .spec import ModelSpec

FP32_BYTES = 4
_LOW_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def compute_bytes(config: ShardwiseConfig) -> int:
    """Bytes per element of activations and gathered parameters."""
    return _LOW_BYTES[config.dtype_name]


def master_bytes(config: ShardwiseConfig) -> int:
    """Bytes per element of what the optimizer steps (parameters, or ZeRO-1's masters) and of its states' dtype:
    fp32, except under pure bf16, which keeps no fp32 copy."""
    return compute_bytes(config) if config.pure_bf16 else FP32_BYTES


def reduce_bytes(config: ShardwiseConfig, layout: Layout) -> int:
    """Bytes per element of a gradient reduction over the data-parallel ranks: fp32, bf16 under pure bf16."""
    return _LOW_BYTES[Decisions(config, layout).reduce_dtype]


def cross_group_bytes(config: ShardwiseConfig, layout: Layout) -> int:
    """Bytes per element of MiCS's gradient all-reduce across partition groups: `cross_group_reduce_dtype`'s
    where shardwise runs it (parallel/sharding/mics.py), fp32 under a pipeline, where FSDP2's hybrid sharding does."""
    cross_group = Decisions(config, layout).cross_group
    return _LOW_BYTES[cross_group.dtype] if cross_group is not None else reduce_bytes(config, layout)


def stored_bytes(config: ShardwiseConfig) -> int:
    """Bytes per stored parameter and per gradient: the compute dtype on ZeRO-1's half-precision replicas and
    under pure bf16, else fp32 (DDP's gradients of fp32 parameters, FSDP2's reduced in fp32)."""
    return compute_bytes(config) if config.sharded_master_weights or config.pure_bf16 else FP32_BYTES


def optimizer_bytes(config: ShardwiseConfig) -> int:
    """Bytes per parameter the optimizer keeps: Adam's moments (in bf16 under pure bf16, as torch keeps them in
    the parameters' dtype), plus ZeRO-1's fp32 master in mixed bf16/fp16."""
    return moment_bytes(config) + (FP32_BYTES if config.sharded_master_weights else 0)


def moment_bytes(config: ShardwiseConfig) -> int:
    """Bytes per parameter of Adam's moments, in the dtype of what the optimizer steps."""
    return A.OPTIMIZER_STATE_BYTES * master_bytes(config) // FP32_BYTES


def fully_sharded(config: ShardwiseConfig) -> bool:
    return config.effective_zero_stage >= 2


def accumulates_whole_gradients(config: ShardwiseConfig, layout: Layout) -> bool:
    """Whether each rank holds its stage's gradients whole through a round: torch's PipelineStage runs an FSDP2
    stage's backward without gradient sync and without resharding, so FSDP2 accumulates every microbatch's
    gradients unsharded (in the reduction's dtype) and keeps the parameters gathered until the round's
    reduce-scatter."""
    return fully_sharded(config) and Decisions(config, layout).pipelining


def accumulates_locally(config: ShardwiseConfig) -> bool:
    """ZeRO-1's master weights with accumulate_gradients_locally over several microbatches: each rank adds them up
    in fp32 buffers of its whole stage, which travel once, with the last microbatch's backward."""
    return config.sharded_master_weights and config.accumulate_gradients_locally and config.microbatches > 1


def master_gradient_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> float:
    """ZeRO-1's fp32 master gradients of the busiest rank's share, kept from backward to the step."""
    rank_params = spec.stage_parameters(layout.pp) / layout.tp
    return reduce_bytes(config, layout) * rank_params * optimizer_share(spec, config, layout)


def replicated_by_fsdp(config: ShardwiseConfig, layout: Layout) -> bool:
    """FSDP2's `replicate` (ZeRO-0 and fp32 ZeRO-1 with tensor or pipeline parallelism and several replicas)."""
    return Decisions(config, layout).wrapping() is Wrapping.REPLICATE


def autocast(config: ShardwiseConfig, layout: Layout) -> bool:
    """Mixed precision by autocast (DDP, one replica); FSDP2 and ZeRO-1's half-precision replicas cast."""
    return Decisions(config, layout).precision_mode() is PrecisionMode.AUTOCAST


def numerics(config: ShardwiseConfig, layout: Layout) -> Numerics:
    low = compute_bytes(config)
    if low == FP32_BYTES:
        return Numerics(low)
    if autocast(config, layout):
        return Numerics(low, residual=FP32_BYTES, weight_copies=low)
    return Numerics(low, logits=FP32_BYTES)


def gradient_ranks(layout: Layout) -> int:
    """Ranks a gradient is reduced over (and ZeRO-1 deals its optimizer states over): the data-parallel ranks, each
    with its context-parallel ranks, which hold parts of the same rows (parallel/mesh.py's `rdp`)."""
    return layout.dp * layout.cp


def sharding_ranks(layout: Layout) -> int:
    """Ranks ZeRO-2/3 shards each unit over: the sharding group, with the context-parallel ranks inside it
    (`dp_shard × cp`, torchtitan's dp_shard_cp)."""
    return layout.dp_shard * layout.cp


def shard_degrees(config: ShardwiseConfig, layout: Layout) -> tuple[int, int, int]:
    """How many ways (parameters, gradients, optimizer states) are split across data-parallel ranks."""
    if fully_sharded(config):
        return (sharding_ranks(layout),) * 3
    return 1, 1, gradient_ranks(layout) if config.effective_zero_stage == 1 else 1


@lru_cache(maxsize=1024)
def _busiest_share(sizes: tuple[float, ...], ranks: int) -> float:
    """Share of the total the busiest rank gets when ZeRO-1 deals the tensors."""
    loads = [0.0] * ranks
    for size, owner in zip(sizes, assign_owners(list(sizes), ranks)):
        loads[owner] += size
    return max(loads) / sum(sizes)


class Buckets(NamedTuple):
    """ZeRO-1's gradient buckets in bf16/fp16, in elements."""

    count: int
    largest: float
    waiting: float  # most gradient elements alive at once, waiting for their bucket to be sent


@lru_cache(maxsize=1024)
def _buckets(sizes: tuple[float, ...], ranks: int) -> Buckets:
    """The buckets gradient_buckets.py makes of these tensors, with gradients arriving in reverse order."""
    order = list(sizes[::-1])
    filled = fill_buckets(order, assign_owners(list(sizes), ranks)[::-1], BUCKET_BYTES)
    sent_at = {indices[-1]: sum(order[i] for i in indices) for _, indices in filled}
    alive = waiting = 0.0
    for index, size in enumerate(order):
        alive += size
        waiting = max(waiting, alive)
        alive -= sent_at.get(index, 0.0)
    return Buckets(len(filled), max(sent_at.values()), waiting)


def reduce_buckets(spec: ModelSpec, layout: Layout) -> Buckets:
    """ZeRO-1's buckets on the busiest stage, tensors divided by `tp`, owners among the `gradient_ranks`."""
    return _buckets(tuple(t / layout.tp for t in spec.stage_tensors(layout.pp)), gradient_ranks(layout))


def in_flight_bucket_bytes(spec: ModelSpec, layout: Layout) -> float:
    """ZeRO-1's fp32 gradient buckets in flight at once during backward (bf16/fp16, or offloaded masters)."""
    return FP32_BYTES * IN_FLIGHT * reduce_buckets(spec, layout).largest


def first_broadcast_bucket(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> tuple[float, int]:
    """Bytes and tensors of ZeRO-1's first parameter broadcast bucket on the busiest stage: what the next
    forward waits for before its first module runs."""
    nbytes = [t / layout.tp * stored_bytes(config) for t in spec.stage_tensors(layout.pp)]
    first = consecutive_buckets(nbytes, BUCKET_BYTES)[0]
    return sum(nbytes[i] for i in first), len(first)


def gradient_fraction(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> float:
    """Share of the rank's gradients alive at their peak: all of them, except under ZeRO-1 in bf16/fp16 without
    a pipeline, which sends and frees them bucket by bucket in every backward pass (a pipeline schedule
    accumulates its microbatches in them first, unless they add up in fp32 buffers: `accumulates_locally`)."""
    pipelined = Decisions(config, layout).pipelining and not accumulates_locally(config)
    if not config.sharded_master_weights or pipelined:
        return 1.0
    return reduce_buckets(spec, layout).waiting * layout.tp / spec.stage_parameters(layout.pp)


def optimizer_share(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> float:
    """Fraction of the rank's optimizer state the busiest data-parallel rank holds."""
    shards = shard_degrees(config, layout)[2]
    if config.effective_zero_stage != 1 or shards == 1:
        return 1 / shards
    return _busiest_share(spec.stage_tensors(layout.pp), shards)


def optimizer_step_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, host: bool) -> float:
    """Temporaries of the busiest rank's Adam step (assumptions.py), in the dtype it steps (fp32; bf16 under pure
    bf16): stepping tensor by tensor, on a CPU (`host`) or with the optimizer block's `foreach: false`, two copies
    of the largest tensor it steps (FSDP2 steps shards of it, ZeRO-1 and DDP whole tensors), else one of all."""
    if host or (config.optimizer is not None and config.optimizer.params.get("foreach") is False):
        largest = max(spec.stage_tensors(layout.pp)) / layout.tp
        if fully_sharded(config):
            largest /= sharding_ranks(layout)
        return A.STEP_COPIES_PER_TENSOR * master_bytes(config) * largest
    stepped = spec.stage_parameters(layout.pp) / layout.tp * optimizer_share(spec, config, layout)
    return A.STEP_COPIES_FOREACH * master_bytes(config) * stepped


def gathered_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> float:
    """Unsharded compute copies of parameters FSDP2 holds at the peak (0 under DDP and ZeRO-1 in bf16/fp16), and
    under ZeRO++ hpZ the blocks' secondary shards, kept between forward and backward."""
    if not (fully_sharded(config) or replicated_by_fsdp(config, layout)):
        return 0.0
    low = compute_bytes(config)
    rank_params = spec.stage_parameters(layout.pp) / layout.tp
    if config.effective_zero_stage != 3 or accumulates_whole_gradients(config, layout):
        return low * rank_params
    blocks = spec.stage_layers(layout.pp) * spec.layer_parameters / layout.tp
    in_flight = min(2, spec.stage_layers(layout.pp)) * spec.layer_parameters / layout.tp
    # ZeRO++ hpZ: every block keeps its secondary shard from its forward to its backward; when forward ends, the
    # root (still gathered for the loss) sees them all (measured: bench/sharding.py, docs/sharding.md)
    secondary = Decisions(config, layout).secondary_partition
    kept = blocks / secondary if secondary else 0.0
    return low * (rank_params - blocks + in_flight + kept)


def blocks_gathered_in_backward(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> int:
    """Of the blocks ZeRO-3 holds gathered (`gathered_bytes`'s in-flight ones), how many are gathered only while a
    block runs backward, which the room the head's freed tensors leave can take (memory.py): the running one. The
    one prefetched besides it is gathered while the head runs backward, except with one shard rank, where FSDP2
    skips the all-gather and copies a unit's parameters only when it runs."""
    if config.effective_zero_stage != 3 or accumulates_whole_gradients(config, layout):
        return 0
    return 1 if shard_degrees(config, layout)[0] > 1 else min(2, spec.stage_layers(layout.pp))


def in_backward_reduce_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> float:
    """Of `comm_buffer_bytes`, FSDP2's reduce buffers alive only in a block's backward (its unsharded gradients and
    their reduce-scatter input) or when backward ends (the root's reduce-scatter input): never beside the head's
    tensors, so the room those leave can take them (memory.py)."""
    if not fully_sharded(config) or accumulates_whole_gradients(config, layout):
        return 0.0
    block, root = spec.layer_parameters / layout.tp, root_unit_parameters(spec, layout) / layout.tp
    return max(block * (compute_bytes(config) + reduce_bytes(config, layout)), root * reduce_bytes(config, layout))


def root_unit_parameters(spec: ModelSpec, layout: Layout) -> float:
    """Parameters of the busiest stage that FSDP2's root unit holds: those in no block and in no unit of their own
    (parallel/sharding/units.py: an embedding or head tensor of half a block or more, unless tied). The root reduces its
    gradients when backward ends, so a tied head's gradient, computed first, is alive through the whole backward.
    A module-graph cut's units are not modelled (0)."""
    if spec.graph_stages(layout.pp):
        return 0.0
    outside = spec.stage_parameters(layout.pp) - spec.stage_layers(layout.pp) * spec.layer_parameters
    tied = (spec.vocab * spec.hidden,) if spec.tied_head else ()
    embedding = tuple(t for t in spec.embedding_tensors if t not in tied)
    if layout.pp == 1:
        candidates = embedding + spec.head_tensors
    else:
        first = sum(spec.embedding_tensors) >= sum(spec.head_tensors + tied)
        candidates = embedding if first else spec.head_tensors
    own_units = sum(t for t in candidates if t >= spec.layer_parameters / 2)
    return max(outside - own_units, 0)


def comm_buffer_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int) -> float:
    """DDP's bucket copy of every gradient; FSDP2's unsharded block gradients and their reduce-scatter input
    beside the root unit's unsharded gradients (then their reduce-scatter input), reduced in fp32 (bf16 under pure
    bf16) — under a pipeline, whose stage accumulates its gradients whole (counted as gradients), one unit's
    reduce-scatter input at the round's end; ZeRO-1's fp32 master gradients and buckets in flight in bf16/fp16
    (accumulating locally: the fp32 sums of the whole stage, in which the buckets travel and the owner's master
    gradients stay); pipeline send/receive buffers."""
    low, reduced = compute_bytes(config), reduce_bytes(config, layout)
    rank_params = spec.stage_parameters(layout.pp) / layout.tp
    if fully_sharded(config):
        block, root = spec.layer_parameters / layout.tp, root_unit_parameters(spec, layout) / layout.tp
        if accumulates_whole_gradients(config, layout):
            buffers = max(block, root) * reduced
        else:
            buffers = root * low + max(block * (low + reduced), root * reduced)
    elif accumulates_locally(config):
        buffers = reduced * rank_params
    elif config.sharded_master_weights:
        buffers = master_gradient_bytes(spec, config, layout) + in_flight_bucket_bytes(spec, layout)
    else:
        buffers = reduced * rank_params if gradient_ranks(layout) > 1 else 0.0
    if Decisions(config, layout).pipelining:
        buffers += 2 * micro_batch * seq / layout.cp * spec.boundary_elements(layout.pp) * low  # a cp share
    return buffers
