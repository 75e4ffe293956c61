"""Step time of one configuration: compute, recompute, exposed communication, bubble, optimizer.

The busiest pipeline stage sets the pace. Per microbatch it runs forward (F) and
backward (2F, plus F again for recomputed blocks) at the achievable FLOP/s. ZeRO
gathers and gradient reduction run per block while compute proceeds, so each
phase lasts max(compute, comm) plus the share overlap cannot hide plus one
block's worth that cannot overlap at all (the first gather, the last reduce).
ZeRO-1's gradient reduces to the owners in bf16/fp16 overlap every backward (under
a pipeline the last one), as DDP's all-reduce overlaps the last, and its parameter
broadcasts after the step overlap the next forward, all but the first bucket (not
where FSDP2's `replicate` copies every parameter before forward). Tensor-parallel
collectives sit on the critical path; so do pipeline fill/drain sends and the update
itself, which runs on the host, slower, when optimizer states are offloaded (their
copies between host and device: offload.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..config.schema import SPLIT_BACKWARD_SCHEDULES, ShardwiseConfig
from ..topology import Layout
from ..config.decisions import Decisions
from ..config.recompute import split_policy
from ..parallel.stage_split import stage_ranks
from . import assumptions as A
from . import context, efficiency, experts
from .activations import keeps_matmuls, recomputed_elementwise_bytes, recomputed_matmul_share, region_blocks
from .bubbles import bubble_share, busiest_rank
from .collectives import GroupShape, LinkTime, collective_time, group_shape, p2p_time
from .efficiency import BlockSeconds, block_seconds, head_seconds
from .experts import expert_shard_shape
from .hardware import ClusterSpec, DeviceSpec
from .offload import activation_transfers, host_states, state_transfers
from .spec import ModelSpec
from .wrapping import (accumulates_locally, compute_bytes, cross_group_bytes, first_broadcast_bucket, fully_sharded,
                       master_bytes, moment_bytes, numerics, optimizer_share, reduce_buckets, reduce_bytes,
                       replicated_by_fsdp, sharding_ranks, stored_bytes)

_DP_AXES = ("dp_replicate", "dp_shard")
_WHEN = {"forward": "overlaps forward", "backward": "overlaps backward", "sync": "overlaps last backward",
         "next_forward": "overlaps next forward", "after_step": "after the optimizer step",
         "whole_step": "overlaps backward, step and next forward", "critical": "critical path",
         "tensor_backward": "overlaps backward's compute"}


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: per-rank buffer volume and link time summed over the step."""

    name: str
    axis: str
    bytes_per_step: float
    link: str
    seconds: float


@dataclass(frozen=True)
class StepTime:
    compute: float
    recompute: float
    tensor_parallel: float
    context_parallel: float   # exposed part of the ring's hops, or the all-to-alls around attention
    data_parallel: float      # exposed part of gradient sync and ZeRO gathers, and experts' all-to-alls
    pipeline_bubble: float
    pipeline_p2p: float
    optimizer: float
    offload: float            # exposed part of transfers to host memory and back (activations, optimizer states)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    collectives: tuple[Collective, ...] = ()

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)[:_PARTS]}


_PARTS = [f.name for f in fields(StepTime)].index("tokens_per_s")  # the fields that add up to the step


def _phase(window: float, comm: LinkTime, units: int, head: float | None = None,
           beside: LinkTime = LinkTime()) -> float:
    """Duration of a compute phase of `window` seconds that overlaps `comm`, issued in `units` pieces, the first
    (or last) of which nothing hides: `head` seconds when known, else a `units`-th of the traffic.

    `beside`: the link time of the critical-path collectives the phase also waits on (tensor parallelism's), not
    counted in `window`. While one link level carries them, `comm` keeps streaming on the other: NVLink's
    tensor-parallel collectives leave the network to the data-parallel traffic, and the reverse."""
    c = comm.busiest
    if c == 0:
        return window
    reach = max(window, comm.intra - beside.inter, comm.inter - beside.intra)
    return reach + (1 - A.OVERLAP_EFFICIENCY) * min(window, c) + (c / units if head is None else head)


class _Traffic:
    """Collects a step's collectives by when they run: per microbatch (forward, backward; tensor_backward, the
    tensor-parallel group's gathers backward's compute hides), once with the last backward (sync), once during the
    next step's first forward (next_forward, whose first bucket, `first_bucket` seconds, waits exposed), after the
    optimizer step, or on the critical path."""

    def __init__(self, cluster: ClusterSpec, layout: Layout, microbatches: int, blocks: int):
        self.cluster, self.layout, self.microbatches, self.blocks = cluster, layout, microbatches, blocks
        self.forward = self.backward = self.sync = self.next_forward = self.after_step = self.whole_step = LinkTime()
        self.tensor_backward = LinkTime()
        self.first_bucket = 0.0
        self.records: list[Collective] = []

    def data_parallel_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """A data-parallel group (replicas, sharding group) with its context-parallel ranks, which hold parts of
        the same rows: gradients are reduced, and ZeRO shards, over them too (parallel/mesh.py's rdp and
        dp_shard_cp)."""
        return axes + ("cp",) if "dp_shard" in axes and self.layout.cp > 1 else axes

    def time(self, kind: str, nbytes: float, axes: tuple[str, ...], calls: int, within: int = 0,
             shape: GroupShape | None = None) -> LinkTime:
        axes = self.data_parallel_axes(axes)
        shape = shape or group_shape(self.layout, self.cluster.devices_per_node, axes, within)
        return collective_time(kind, nbytes, shape, self.cluster, calls)

    def add(self, when: str, kind: str, nbytes: float, axes: tuple[str, ...], label: str, calls: int = 0,
            within: int = 0, experts: int = 0) -> LinkTime:
        """Add `nbytes` of `kind` on the groups along `axes` (with `within`, on ZeRO++ hpZ's secondary groups of
        that many ranks inside them; with `experts`, on the ranks holding the same expert share of the sharding
        group `axes` make, for that EP degree), in `calls` collectives (default: per block when sharded per block,
        else per DDP-sized bucket)."""
        calls = calls or (self.blocks if axes == ("dp_shard",) else -(-int(nbytes) // A.BUCKET_BYTES))
        shape = expert_shard_shape(self.layout, self.cluster.devices_per_node, experts) if experts else None
        t = self.time(kind, nbytes, axes, calls, within, shape)
        axes = self.data_parallel_axes(axes)
        if t.serial == 0:
            return t
        if when != "critical":
            setattr(self, when, getattr(self, when) + t)
        count = self.microbatches if when in ("forward", "backward", "critical", "tensor_backward") else 1
        axis = "hpz" if within else "expert_shard" if experts else "×".join(a for a in axes
                                                                             if getattr(self.layout, a) > 1)
        self.records.append(Collective(f"{label} {kind.replace('_', '-')} ({_WHEN[when]})", axis,
                                       nbytes * count, t.link, t.serial * count))
        return t


def _data_parallel_traffic(traffic: _Traffic, config: ShardwiseConfig, layout: Layout, spec: ModelSpec) -> None:
    """Which collectives each ZeRO stage issues, on which group, and when (seed 000's MiCS included).

    As `wrapping.py` describes the runtime: DDP all-reduces fp32 gradients (fp32 ZeRO-1 too);
    ZeRO-1 in bf16/fp16 reduces them in fp32 to their owners instead, bucket by bucket during
    every microbatch's backward (the last one's under a pipeline schedule or accumulating locally); ZeRO-1 then broadcasts
    the parameters each rank updated, one tensor at a time, in their stored dtype, during the next
    forward — each module waits for the bucket holding its parameters, so the first bucket is
    exposed — except under FSDP2's `replicate`, which copies them all before forward. FSDP2 gathers
    the compute copies every forward (ZeRO-3 again in backward, under ZeRO++ hpZ inside the secondary
    group only) and reduce-scatters fp32 gradients.
    """
    stage = config.effective_zero_stage
    rank_params = experts.rank_parameters(spec, layout)
    grads = reduce_bytes(config, layout) * rank_params
    if stage <= 1:
        if config.sharded_master_weights:
            once = Decisions(config, layout).pipelining or accumulates_locally(config)
            when = "sync" if once else "backward"
            traffic.add(when, "reduce", grads, _DP_AXES, "gradient", reduce_buckets(spec, layout).count)
        else:
            traffic.add("sync", "all_reduce", grads, _DP_AXES, "gradient")
        if stage == 1:
            _parameter_broadcasts(traffic, config, layout, spec, rank_params)
        return
    # expert parallelism: each expert share is a unit of its own, gathered and reduced over its copies only
    ep = config.expert_parallel_degree
    shares = experts.stage_expert_parameters(spec, layout) if ep > 1 else 0.0
    sharding = _pipelined_sharding_traffic if Decisions(config, layout).pipelining else _sharding_traffic
    rest = rank_params - shares
    sharding(traffic, config, layout, stage, compute_bytes(config) * rest, reduce_bytes(config, layout) * rest)
    if shares:
        sharding(traffic, config, layout, stage, compute_bytes(config) * shares / ep,
                 reduce_bytes(config, layout) * shares / ep, experts=ep)
    # MiCS's cross-group all-reduce: one per unit (the blocks, then the root), overlapping the last backward, or
    # (cross_group_overlap: forward, parallel/sharding/mics.py) also the optimizer step and the next forward
    shards = rank_params / sharding_ranks(layout) * cross_group_bytes(config, layout)
    cross_group = Decisions(config, layout).cross_group
    when = "whole_step" if cross_group is not None and cross_group.deferred else "sync"
    traffic.add(when, "all_reduce", shards, ("dp_replicate",), "gradient shard", spec.stage_layers(layout.pp) + 1)


def _sharding_traffic(traffic: _Traffic, config: ShardwiseConfig, layout: Layout, stage: int, gathered: float,
                      grads: float, experts: int = 0) -> None:
    """FSDP2 without a pipeline: gathers every forward (ZeRO-3 again in backward, under ZeRO++ hpZ inside the
    secondary group), a reduce-scatter every backward; with `experts`, the expert shares of that EP degree."""
    what = "expert " if experts else ""
    traffic.add("forward", "all_gather", gathered, ("dp_shard",), f"{what}parameter", experts=experts)
    if stage == 3:  # under ZeRO++ hpZ from the secondary shards forward left, inside the secondary group
        traffic.add("backward", "all_gather", gathered, ("dp_shard",), f"{what}parameter",
                    within=Decisions(config, layout).secondary_partition, experts=experts)
    traffic.add("backward", "reduce_scatter", grads, ("dp_shard",), f"{what}gradient", experts=experts)


def _pipelined_sharding_traffic(traffic: _Traffic, config: ShardwiseConfig, layout: Layout, stage: int,
                                gathered: float, grads: float, experts: int = 0) -> None:
    """FSDP2 under a pipeline: each stage is one FSDP2 unit, which torch's PipelineStage runs without gradient
    sync, keeps gathered after backward and reduce-scatters once per round (its perform_reduce_grad). So a round
    gathers once where forward keeps the gathered parameters (ZeRO-2, and ZeRO-3 under a schedule that splits
    backward), else for every warm-up forward (at most pp before the first backward) and once more for the first
    backward; it reduce-scatters once, with the last backward (tests/test_planner_pipelined_sharding.py counts
    them). With `experts`, the expert shares of that EP degree."""
    what = "expert " if experts else ""
    m = config.microbatches
    forward_gathers, backward_gathers = _pipelined_gathers(config, layout)
    traffic.add("forward", "all_gather", gathered * forward_gathers / m, ("dp_shard",), f"{what}parameter", 1,
                experts=experts)
    if backward_gathers:
        traffic.add("backward", "all_gather", gathered / m, ("dp_shard",), f"{what}parameter", 1, experts=experts)
    traffic.add("sync", "reduce_scatter", grads, ("dp_shard",), f"{what}gradient", 1, experts=experts)


def _pipelined_gathers(config: ShardwiseConfig, layout: Layout) -> tuple[int, int]:
    """All-gathers of a pipeline stage's parameters per step, (forward, backward): one where forward keeps them
    gathered, else one per warm-up forward (at most pp) and one for the first backward."""
    split_backward = config.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
    if Decisions(config, layout).reshard_after_forward(split_backward) is False:
        return 1, 0
    return min(config.pipeline_round, layout.pp), 1


def _gradient_copy_seconds(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec) -> float:
    """The data-parallel wrapping's copies on the compute stream per step. FSDP2's (torch's _fsdp_collectives):
    every all-gather's output copied out into the parameters (read and written in the compute dtype); every
    reduce-scatter's input copied in from the unsharded gradients, upcast to the reduction's dtype; under a
    pipeline, each microbatch's gradients added into the unsharded accumulators (both read, the sum written) and
    the accumulators copied in once. ZeRO-1's master weights (gradient_buckets.py): each gradient copied into its
    fp32 bucket when it travels, or accumulating locally added into the fp32 sums every microbatch. Memory-bound,
    at the streaming bandwidth; the collectives themselves wait for them, so nothing hides them."""
    low, reduced, m = compute_bytes(config), reduce_bytes(config, layout), config.microbatches
    pipelining = Decisions(config, layout).pipelining
    if accumulates_locally(config):
        moved = m * (low + 2 * reduced)
    elif config.sharded_master_weights:
        moved = (1 if pipelining else m) * (low + reduced)
    elif not fully_sharded(config):
        return 0.0
    elif pipelining:
        moved = 2 * low * sum(_pipelined_gathers(config, layout)) + m * (low + 2 * reduced) + 2 * reduced
    else:
        gathers = 2 if config.effective_zero_stage == 3 else 1
        moved = m * (2 * low * gathers + low + reduced)
    return moved * experts.rank_parameters(spec, layout) / cluster.device.streaming_bandwidth


def _parameter_broadcasts(traffic: _Traffic, config: ShardwiseConfig, layout: Layout, spec: ModelSpec,
                          rank_params: float) -> None:
    """ZeRO-1's broadcasts of the updated parameters: overlapping the next forward, which waits for the first
    bucket (parallel/zero1/parameter_broadcasts.py); exposed where FSDP2's `replicate` copies them all first."""
    nbytes, tensors = stored_bytes(config) * rank_params, len(spec.stage_tensors(layout.pp))
    if replicated_by_fsdp(config, layout):
        traffic.add("after_step", "broadcast", nbytes, _DP_AXES, "parameter", tensors)
        return
    traffic.add("next_forward", "broadcast", nbytes, _DP_AXES, "parameter", tensors)
    first_bytes, first_tensors = first_broadcast_bucket(spec, config, layout)
    traffic.first_bucket = traffic.time("broadcast", first_bytes, _DP_AXES, first_tensors).serial


@dataclass(frozen=True)
class _CriticalPath:
    """Tensor parallelism's collectives per microbatch: the seconds they add, with their host time, and the link
    time of those in the forward and in the backward phase (a recomputed forward's are backward's)."""

    seconds: float = 0.0
    forward: LinkTime = LinkTime()
    backward: LinkTime = LinkTime()


def _tensor_parallel_traffic(traffic: _Traffic, spec: ModelSpec, config: ShardwiseConfig, layers: int,
                             activation: float, recompute: bool, backward: float) -> _CriticalPath:
    """Seconds per microbatch the tensor-parallel collectives add, each with its host time (critical_op_seconds),
    and their link time by phase.

    Megatron: per block two all-reduces of the activations forward and two backward (two more on
    recompute), on the critical path. Sequence parallelism (parallel/tensor/sequence.py) splits each into a
    reduce-scatter and an all-gather of the same volume, all-gathers the blocks' output in forward and their
    input's gradient in backward (where the sequence shards begin and end, outside the recomputed blocks),
    and sums each norm weight's gradient over the group in backward. With sequence_parallel_regather
    each block not recomputed gathers its two column-parallel inputs again in backward, each started when
    backward first needs the one after it (parallel/tensor/regather.py): those overlap the blocks'
    `backward` compute, the first exposed (`_phase`).
    """
    if traffic.layout.tp == 1:
        return _CriticalPath()
    calls, op = layers * (4 + (2 if recompute else 0)), traffic.cluster.critical_op_seconds
    forward_calls = 2 * layers
    if not config.sequence_parallel:
        reduced = traffic.add("critical", "all_reduce", calls * activation, ("tp",), "activation", calls)
        forward = traffic.time("all_reduce", forward_calls * activation, ("tp",), forward_calls)
        return _CriticalPath(reduced.serial + calls * op, forward, reduced - forward)
    gathers, norms = calls + 2, layers * spec.block_norm_tensors
    scattered = traffic.add("critical", "reduce_scatter", calls * activation, ("tp",), "activation", calls)
    gathered = traffic.add("critical", "all_gather", gathers * activation, ("tp",), "activation", gathers)
    summed = traffic.add("critical", "all_reduce", norms * spec.hidden * compute_bytes(config), ("tp",),
                         "norm gradient", norms)
    both = scattered + gathered + summed
    exposed = both.serial + (calls + gathers + norms) * op
    forward = (traffic.time("reduce_scatter", forward_calls * activation, ("tp",), forward_calls)
               + traffic.time("all_gather", (forward_calls + 1) * activation, ("tp",), forward_calls + 1))
    if Decisions(config, traffic.layout).sequence_parallel_regather and not recompute:
        regathers = 2 * layers
        again = traffic.add("tensor_backward", "all_gather", regathers * activation, ("tp",), "activation gathered "
                            "again", regathers)
        exposed += _phase(backward, again, regathers) - backward + regathers * op
    return _CriticalPath(exposed, forward, both - forward)


def _pipeline_p2p(traffic: _Traffic, cluster: ClusterSpec, config: ShardwiseConfig, activation: float) -> float:
    """Exposed pipeline sends: on every round's fill and drain, pp·v - 1 hops between chunks forward and back wait
    for the link; and every send and receive of the busiest rank costs its host time (critical_op_seconds)."""
    layout, virtual = traffic.layout, config.stages_per_rank
    if layout.pp == 1:
        return 0.0
    crosses = group_shape(layout, cluster.devices_per_node, ("pp",)).crosses_nodes
    send = p2p_time(activation, crosses, cluster)
    m = traffic.microbatches
    traffic.records.append(Collective("activation send/recv (fill and drain exposed)", "pp",
                                      2 * m * virtual * activation, send.link, 2 * m * virtual * send.serial))
    ops = m * _p2p_ops_per_microbatch(config.pipeline_schedule, layout.pp, virtual)
    return 2 * (layout.pp * virtual - 1) * pipeline_rounds(config) * send.serial + ops * cluster.critical_op_seconds


def _p2p_ops_per_microbatch(schedule: str, pp: int, virtual: int) -> int:
    """Sends and receives of the busiest rank per microbatch: each of its stages receives its input and sends the
    input's gradient back, sends its output and receives that output's gradient, where the neighbouring stage runs
    on another rank."""
    ranks = stage_ranks(schedule, pp, pp * virtual)
    ops = [0] * pp
    for s in range(1, len(ranks)):
        if ranks[s] != ranks[s - 1]:
            ops[ranks[s]] += 2
            ops[ranks[s - 1]] += 2
    return max(ops)


def _optimizer_seconds(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec,
                       rank_params: float) -> float:
    """Adam's update is memory-bound: read and write moments and the parameter (or master), read the gradient, all
    fp32 (bf16 under pure bf16); the busiest rank's share of them, in host memory when the states are offloaded."""
    updated, stepped = rank_params * optimizer_share(spec, config, layout), master_bytes(config)
    touched = updated * (2 * (moment_bytes(config) + stepped) + stepped)
    on_host = host_states(config, cluster.device)
    return touched / (A.HOST_OPTIMIZER_BANDWIDTH if on_host else cluster.device.memory_bandwidth)


def _offload_seconds(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec,
                     micro_batch: int, seq: int, checkpointing: str, compute: float) -> float:
    """Exposed part of the copies to host memory and back (offload.py): kept block inputs and FSDP2's shards
    move block by block while compute runs; ZeRO-1's masters cross around the step, where nothing hides them."""
    bandwidth = cluster.device.host_bandwidth
    activations = activation_transfers(spec, config, layout, micro_batch, seq, checkpointing, cluster.device)
    states = state_transfers(spec, config, layout, cluster.device).total / bandwidth
    overlapped = activations.total / bandwidth + (states if fully_sharded(config) else 0.0)
    exposed = _phase(compute, LinkTime(intra=overlapped), spec.stage_layers(layout.pp)) - compute
    return exposed + (0.0 if fully_sharded(config) else states)


def pipeline_rounds(config: ShardwiseConfig) -> int:
    """Passes of the pipeline schedule per step, each filling and draining the stages: the runtime runs the
    microbatches in rounds of `pipeline_round`."""
    return config.microbatches // config.pipeline_round


def pipeline_slots(config: ShardwiseConfig, layout: Layout) -> int:
    """Microbatch slots the busiest stage spends per step: every round fills and drains pp stages."""
    if not Decisions(config, layout).pipelining:
        return config.microbatches
    return pipeline_rounds(config) * (config.pipeline_round + layout.pp - 1)


def _recompute_seconds(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec, micro_batch: int,
                       seq: int, checkpointing: str, blocks: BlockSeconds) -> float:
    """A checkpointed stage recomputes its blocks' forward; one keeping its matmuls only their elementwise ops,
    memory-bound: each tensor they keep written and its input read once, at the device's memory bandwidth;
    one keeping every other matmul ("alternate_matmul") also the products it did not keep."""
    if not region_blocks(checkpointing, spec.stage_layers(layout.pp)):
        return 0.0
    if not keeps_matmuls(checkpointing):
        return blocks.forward
    policy = split_policy(checkpointing)[1]
    per_token = recomputed_elementwise_bytes(spec, seq, numerics(config, layout), cluster.device.kernels, layout.tp,
                                             config.sequence_parallel, policy)
    return (2 * per_token * micro_batch * seq / layout.cp * busiest_rank(spec, config, layout.pp).blocks
            / cluster.device.streaming_bandwidth + recomputed_matmul_share(spec, checkpointing) * blocks.matmul_forward)


def _stage_seconds(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec,
                   micro_batch: int, seq: int) -> tuple[BlockSeconds, BlockSeconds]:
    """(the busiest rank's blocks, the rest of its work: head, patch projection) for one microbatch: kernel by
    kernel where the device has a kernel table (efficiency.py), else its FLOPs at one share of peak. Under context
    parallelism a rank runs 1/cp of the tokens, each query still against the whole sequence's keys."""
    tokens, tp, device = micro_batch * seq / layout.cp, layout.tp, _attention_device(config, layout, cluster)
    peak = device.sustained_flops(config.dtype_name)
    if efficiency.modelled(spec, device) and not spec.graph_stages(layout.pp):
        rank = busiest_rank(spec, config, layout.pp)
        kinds = numerics(config, layout)
        blocks = block_seconds(spec, tokens, seq, kinds, tp, config.sequence_parallel, device, peak)
        head = head_seconds(spec, tokens, kinds, tp, device, peak) if rank.holds_head else BlockSeconds(*[0.0] * 6)
        return blocks.scaled(rank.blocks), head
    rate = peak * A.ACHIEVABLE_FLOPS_FRACTION
    in_blocks, outside = spec.stage_flops_per_token(seq, layout.pp)
    blocks_fwd, edge_fwd = tokens * in_blocks / tp / rate, tokens * outside / tp / rate
    return BlockSeconds(blocks_fwd, 0.0, 0.0, 2 * blocks_fwd, 0.0, 0.0), BlockSeconds(edge_fwd, 0.0, 0.0,
                                                                                     2 * edge_fwd, 0.0, 0.0)


def _attention_device(config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec) -> DeviceSpec:
    """The device as its attention runs under the layout: ring blocks without a fused kernel compute their scores
    as plain products (context.py)."""
    decisions, device = Decisions(config, layout), cluster.device
    if not decisions.context_parallel:
        return device
    fused = context.fused_ring_blocks(device.memory_is_host)
    return replace(device, kernels=context.compute_kernels(decisions.context_parallel_mode, device.kernels, fused))


def _attention_seconds(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec,
                       blocks: BlockSeconds, layers: int, micro_batch: int, seq: int) -> float:
    """One block's attention forward and backward on one rank for a microbatch: the kernel model's where the device
    has one, else its FLOPs (both products, causal half skipped, backward twice forward) at one share of peak."""
    if blocks.attention_forward + blocks.attention_backward:
        return (blocks.attention_forward + blocks.attention_backward) / layers
    tokens = micro_batch * seq / layout.cp
    flops = 3 * 4 * tokens * seq * spec.hidden / layout.tp * (0.5 if spec.causal else 1.0)
    return flops / (cluster.device.sustained_flops(config.dtype_name) * A.ACHIEVABLE_FLOPS_FRACTION)


def _context_parallel_seconds(traffic: _Traffic, spec: ModelSpec, config: ShardwiseConfig, layout: Layout,
                              cluster: ClusterSpec, micro_batch: int, seq: int, layers: int, blocks: BlockSeconds,
                              recomputed: bool) -> float:
    """Seconds per microbatch context parallelism's exchanges add to the critical path (context.py): of the ring's
    hops, what outlasts the attention of the block before each; the all-to-alls whole (attention waits for them).
    Blocks recomputed in full exchange their forward again; each hop or exchange pays the link's latency and its
    host time (critical_op_seconds)."""
    decisions = Decisions(config, layout)
    if not decisions.context_parallel or spec.graph_stages(layout.pp):
        return 0.0
    n, mode = decisions.context_parallel_degree, decisions.context_parallel_mode
    shape = context.layer_shape(spec.heads, spec.kv_heads, spec.hidden // spec.heads, layout.tp, micro_batch, seq,
                                compute_bytes(config))
    sent = context.wire_bytes(mode, n, shape)
    group = group_shape(layout, cluster.devices_per_node, ("cp",))
    if group.crosses_nodes:  # every rank of a node shares its links out
        link, latency = "inter", cluster.inter_node_latency
        bandwidth = cluster.inter_node_bandwidth * cluster.link_efficiency / cluster.devices_per_node
    else:
        link, latency = "intra", cluster.intra_node_latency
        bandwidth = cluster.intra_node_bandwidth * cluster.link_efficiency
    attention = _attention_seconds(spec, config, layout, cluster, blocks, layers, micro_batch, seq)
    exposed = context.exposed_seconds(mode, n, shape, bandwidth, attention)
    # the ring's 3n - 2 hops (n - 1 forward, 2n - 1 backward); all-to-all: q, k, v and out each way (4 forward),
    # n - 1 steps each
    ops, forward_ops = (3 * n - 2, n - 1) if mode == "ring" else (8, 4)
    steps = ops if mode == "ring" else ops * (n - 1)
    forward_steps = forward_ops if mode == "ring" else forward_ops * (n - 1)
    per_layer = exposed + steps * latency + ops * cluster.critical_op_seconds
    if recomputed:
        forward_share = sent["forward"] / (sent["forward"] + sent["backward"])
        per_layer += forward_share * exposed + forward_steps * latency + forward_ops * cluster.critical_op_seconds
    volume = (sent["forward"] * (2 if recomputed else 1) + sent["backward"]) * layers
    traffic.records.append(Collective(f"{mode.replace('_', '-')} attention exchange (exposed: beyond attention)"
                                      if mode == "ring" else "all-to-all attention exchange (critical path)", "cp",
                                      volume * traffic.microbatches, link,
                                      per_layer * layers * traffic.microbatches))
    return per_layer * layers


def _pipeline_bubble(config: ShardwiseConfig, layout: Layout, t_mb: float, work: float, forward: float,
                     weight_grad: float) -> float:
    """Idle time of the busiest rank per step: every round's fill and drain as its schedule leaves them
    (bubbles.py), one microbatch's `t_mb` seconds split into F, B and W in the shares of its `work`."""
    if not Decisions(config, layout).pipelining or work == 0:
        return 0.0
    f, w = t_mb * forward / work, t_mb * weight_grad / work
    per_round = bubble_share(config.pipeline_schedule, layout.pp, config.stages_per_rank, f, t_mb - f - w, w)
    gpipe_rounds = pipeline_slots(config, layout) - config.microbatches - pipeline_rounds(config) * (layout.pp - 1)
    return pipeline_rounds(config) * per_round + gpipe_rounds * t_mb


def predict_step_time(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, cluster: ClusterSpec,
                      micro_batch: int, seq: int, checkpointing: str = "none") -> StepTime:
    """Seconds per optimizer step on the busiest stage, with tokens/s and MFU for the whole cluster."""
    m, pp, tp = config.microbatches, layout.pp, layout.tp
    peak = cluster.device.peak_flops[config.dtype_name]
    layers = busiest_rank(spec, config, pp).blocks if not spec.graph_stages(pp) else spec.stage_layers(pp)
    blocks, edge = _stage_seconds(spec, config, layout, cluster, micro_batch, seq)
    forward, backward = blocks.forward + edge.forward, blocks.backward + edge.backward
    recompute = _recompute_seconds(spec, config, layout, cluster, micro_batch, seq, checkpointing, blocks)
    activation = micro_batch * seq / layout.cp * spec.boundary_elements(pp) * compute_bytes(config)
    sent = activation / tp if config.sequence_parallel else activation   # stages hand each other sequence shards
    traffic = _Traffic(cluster, layout, m, layers)
    tp = _tensor_parallel_traffic(traffic, spec, config, layers, activation, recompute > 0, blocks.backward)
    cp_time = _context_parallel_seconds(traffic, spec, config, layout, cluster, micro_batch, seq, layers, blocks,
                                        recompute > 0 and not keeps_matmuls(checkpointing))
    _data_parallel_traffic(traffic, config, layout, spec)

    critical = tp.seconds + cp_time
    busy = forward + backward + recompute + critical
    fwd_phase = _phase(forward, traffic.forward, layers, beside=tp.forward)
    bwd_phase = _phase(backward + recompute, traffic.backward, layers, beside=tp.backward)
    t_mb = fwd_phase + bwd_phase + critical
    t_last = fwd_phase + _phase(backward + recompute, traffic.backward + traffic.sync, layers,
                                beside=tp.backward) + critical
    # ZeRO-1's broadcasts stretch the first forward (nothing else overlaps it then: ZeRO-1 gathers nothing)
    t_first = _phase(forward, traffic.next_forward, layers, traffic.first_bucket, beside=tp.forward) - forward
    weight_grad = (blocks.matmul_backward + edge.matmul_backward) / 2
    time = StepTime(compute=(forward + backward) * m, recompute=recompute * m, tensor_parallel=tp.seconds * m,
                    context_parallel=cp_time * m,
                    data_parallel=m * (t_mb - busy) + (t_last - t_mb) + t_first + traffic.after_step.serial
                    + experts.step_seconds(spec, config, layout, cluster, micro_batch, seq, compute_bytes(config))
                    + _gradient_copy_seconds(spec, config, layout, cluster),
                    pipeline_bubble=_pipeline_bubble(config, layout, t_mb, busy, forward + recompute, weight_grad),
                    pipeline_p2p=_pipeline_p2p(traffic, cluster, config, sent),
                    optimizer=_optimizer_seconds(spec, config, layout, cluster,
                                                 experts.rank_parameters(spec, layout)),
                    offload=_offload_seconds(spec, config, layout, cluster, micro_batch, seq, checkpointing,
                                             m * busy))
    # All-reduces that outlive backward overlap everything else the step does; one unit's is exposed.
    whole = time.total
    time = replace(time, data_parallel=time.data_parallel + _phase(whole, traffic.whole_step, layers + 1) - whole)
    tokens_per_s = micro_batch * m * layout.dp * seq / time.total
    mfu = tokens_per_s * spec.flops_per_token(seq) / (cluster.world_size * peak)
    return StepTime(**time.parts(), tokens_per_s=tokens_per_s, mfu=mfu, collectives=tuple(traffic.records))
