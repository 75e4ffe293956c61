"""Per-rank memory by category for one configuration: what must fit in device memory.

Model states follow the ZeRO paper's accounting for what shardwise runs
(`wrapping.py`): with a = parameters on the rank and n = the sharding degree,
fp32 parameters 4a, gradients 4a and Adam moments 8a, DDP's gradient buckets 4a
more (fp32 DDP = 20a, seed 003); ZeRO-1 shards the moments (8a/n on average,
more on the busiest rank), and in bf16/fp16 keeps SMP's layout: parameters 2a and
gradients at most 2a on every replica (buckets carry them off during backward),
fp32 masters and moments 12a/n; ZeRO-2/3 shard all
three (16a/n), except that a pipeline stage accumulates its gradients whole through a round
(4a in fp32 reduction) and keeps its parameters gathered. With MiCS, n is the partition-group
size; ZeRO-1 shards over every data-parallel rank. `offload_optimizer_state` keeps ZeRO-1's masters and moments, and
all three of ZeRO-2/3's, in host memory (offload.py).

A device with a runtime reserve cannot give it to tensors: a GPU's CUDA context and library
workspaces, a CPU rank's process itself (Python, torch, the process group). A CPU rank's
allocator also keeps memory the step freed (`retention`), which no tensor accounting sees; far less
when its ranks run with a fixed mmap threshold (`DeviceSpec.fixed_mmap_threshold`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

from ..config.decisions import Decisions
from ..config.schema import ShardwiseConfig
from ..parallel.stage_split import stage_ranks
from ..topology import Layout
from . import assumptions as A
from . import context, experts
from .activations import ActivationMemory, PipelineRank, rank_activations, region_blocks
from .bubbles import rank_blocks
from .hardware import DeviceSpec, Kernels
from .offload import host_states, moves_to_host
from .spec import ModelSpec, RankCut
from .wrapping import (accumulates_locally, accumulates_whole_gradients, blocks_gathered_in_backward,
                       comm_buffer_bytes, compute_bytes, fully_sharded, gathered_bytes, gradient_fraction,
                       in_backward_reduce_bytes, in_flight_bucket_bytes, master_gradient_bytes, numerics,
                       optimizer_bytes, optimizer_share, optimizer_step_bytes, reduce_bytes, shard_degrees,
                       stored_bytes)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank. `offloaded` lives in host memory and is not part of `total`."""

    parameters: float       # as stored (sharded by ZeRO-2/3): fp32, the master copy, except ZeRO-1's half replicas
    gradients: float
    optimizer: float
    gathered_params: float  # FSDP2's unsharded compute copies at the peak
    activations: float
    comm_buffers: float
    runtime: float
    fragmentation: float
    offloaded: float = 0.0
    retention: float = 0.0  # freed memory a host allocator keeps (CPU ranks)
    step_temporaries: float = 0.0  # what the optimizer step allocates beyond the activations and buffers it outlives
    overlap: float = 0.0  # the step's peak moment against the sum of the categories' maxima (`_rank_memory`)

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "offloaded")

    @property
    def tensors(self) -> float:
        """The total without the runtime reserve and the allocator's retention: what a tensor tracker sees."""
        return self.total - self.runtime - self.retention

    def summary(self) -> dict[str, float]:
        """The categories reports use: parameters include the gathered copies; other is buffers,
        runtime reserve, the fragmentation margin, the allocator's retention, the step's temporaries and the
        overlap (the peak's moment against the categories' sum, mostly negative)."""
        return {"parameters": self.parameters + self.gathered_params, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "other": self.comm_buffers + self.runtime + self.fragmentation + self.retention + self.step_temporaries
                + self.overlap,
                "total": self.total}

    def detail(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def model_state_bytes(parameters: float, config: ShardwiseConfig, layout: Layout,
                      optimizer_fraction: Optional[float] = None, gradient_fraction: float = 1.0) -> dict[str, float]:
    """Parameters, gradients and optimizer states for `parameters` on one rank; the busiest
    rank's `optimizer_fraction` of the moments (and masters; default: an even split), and the
    `gradient_fraction` of the gradients alive at once."""
    params_n, grads_n, optim_n = shard_degrees(config, layout)
    share = 1 / optim_n if optimizer_fraction is None else optimizer_fraction
    stored = stored_bytes(config)
    gradients = (reduce_bytes(config, layout) * parameters if accumulates_whole_gradients(config, layout)
                 else stored * parameters / grads_n * gradient_fraction)
    return {"parameters": stored * parameters / params_n, "gradients": gradients,
            "optimizer": optimizer_bytes(config) * parameters * share}


def host_retention(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, device: Optional[DeviceSpec]) -> float:
    """Freed bytes glibc malloc keeps in a CPU rank (assumptions.py): a share common to every layout, and under
    FSDP2 a multiple of each gathered block's full size while blocks stay under malloc's mmap ceiling. With a
    fixed mmap threshold every large block goes back to the system on free: only the pages training adds outside
    malloc stay."""
    if device is None or not device.memory_is_host:
        return 0.0
    if device.fixed_mmap_threshold:
        return A.HOST_RETAINED_BYTES_FIXED_THRESHOLD
    block = spec.layer_parameters / layout.tp * compute_bytes(config)
    gathered = fully_sharded(config) and block < A.MALLOC_MMAP_CEILING
    per_block = A.HOST_RETAINED_PER_GATHERED_BLOCK * block if gathered else 0.0
    return A.HOST_RETAINED_BYTES + per_block * spec.stage_layers(layout.pp)


def in_flight_microbatches(config: ShardwiseConfig, layout: Layout, rank: int = 0) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at its peak, in whole-rank units (a microbatch
    through one of an interleaved rank's v chunks counts 1/v), as the runtime's rounds of `pipeline_round` run
    torch's schedules (torch.distributed.pipelining.schedules):

    - GPipe keeps the whole round, and so does a round below pp (it runs as GPipe);
    - 1F1B: rank r keeps pp − r;
    - interleaved 1F1B: its warm-up forwards and the first steady one, (v − 1)·m + 2·(pp − 1 − r) + 1
      chunk-microbatches with m microbatches a torch round (pp, or the round when shorter; `_get_warmup_ops`), at
      most the round's;
    - the zero-bubble schedules (interleaved and ZBV) defer each weight-gradient step, and a microbatch's
      activations stay until it runs: counted as the whole round, a bound (measured on 4 ranks: 66–83 % of it,
      tests/test_pipeline_held_activations.py).
    """
    if not Decisions(config, layout).pipelining:
        return 1
    pp, whole, v = layout.pp, config.pipeline_round, config.stages_per_rank
    schedule = config.pipeline_schedule
    if schedule in ("gpipe", "interleaved_zero_bubble", "zbv_zero_bubble") or schedule == "1f1b" and whole < pp:
        return whole
    if schedule == "1f1b":
        return pp - rank
    per_torch_round = whole // max(1, whole // pp)
    warmup = (v - 1) * per_torch_round + 2 * (pp - 1 - rank)
    return min(warmup + 1, whole * v) / v


def pipeline_stages(spec: ModelSpec, config: ShardwiseConfig, layout: Layout) -> tuple[PipelineRank, ...]:
    """Every pipeline rank as the runtime's cut and schedule leave it; () without a pipeline of blocks
    (rank_activations then counts the first stage)."""
    if not Decisions(config, layout).pipelining or spec.graph_stages(layout.pp):
        return ()
    pp = layout.pp
    places = stage_ranks(config.pipeline_schedule, pp, pp * config.stages_per_rank)
    return tuple(PipelineRank(blocks, in_flight_microbatches(config, layout, rank), rank == places[0],
                              rank == places[-1])
                 for rank, blocks in enumerate(rank_blocks(spec, config, pp)))


def _telling_ranks(stages: tuple[PipelineRank, ...]) -> list[PipelineRank]:
    """The ranks one of which peaks: those holding the embedding or the head, and of the others those no other
    matches in both blocks and microbatches in flight (a rank matched in both holds no more of anything)."""
    ends = [r for r in stages if r.holds_first or r.holds_last]
    middle = {r for r in stages if not (r.holds_first or r.holds_last)}
    front = [r for r in middle if not any(o != r and o.blocks >= r.blocks and o.in_flight >= r.in_flight
                                          for o in middle)]
    return ends + sorted(front)


def predict_memory(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int,
                   checkpointing: str = "none", device: Optional[DeviceSpec] = None) -> MemoryBreakdown:
    """Peak bytes per rank by category, for the busiest pipeline rank: each rank that can peak counted with its own
    blocks, embedding or head and microbatches in flight (`pipeline_stages`), the largest total kept."""
    stages = pipeline_stages(spec, config, layout)
    if not stages:
        return _rank_memory(spec, config, layout, micro_batch, seq, checkpointing, device, None)
    return max((_rank_memory(replace(spec, rank_cut=RankCut(rank.blocks, rank.holds_first, rank.holds_last)),
                             config, layout, micro_batch, seq, checkpointing, device, rank)
                for rank in _telling_ranks(stages)), key=lambda breakdown: breakdown.total)


def _rank_memory(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int,
                 checkpointing: str, device: Optional[DeviceSpec], rank: Optional[PipelineRank]) -> MemoryBreakdown:
    """Peak bytes by category on one rank: `spec`'s stage (its `rank_cut`) holding what pipeline `rank` holds (None:
    no pipeline of blocks).

    `micro_batch` is sequences per microbatch on one rank (tensor-parallel ranks share them).
    `device` supplies kernel facts and the runtime reserve (and on a CPU the allocator's retention); without
    it, GPU kernels and no reserve.
    Offloaded activations and model states (offload.py) are `offloaded`, except on a device whose
    memory is the host's, where the runtime keeps them where they are.
    """
    kernels = device.kernels if device else Kernels()
    decisions = Decisions(config, layout)
    cp, mode = decisions.context_parallel_degree, decisions.context_parallel_mode
    states = model_state_bytes(experts.rank_parameters(spec, layout), config, layout,
                               optimizer_share(spec, config, layout), gradient_fraction(spec, config, layout))
    on_host = host_states(config, device)
    host_bytes = sum(states[k] for k in on_host)
    states = {k: 0.0 if k in on_host else v for k, v in states.items()}
    saving = experts.gathered_saving(spec, config, layout, compute_bytes(config))
    gathered = gathered_bytes(spec, config, layout)
    if gathered:  # the experts tensor parallelism leaves whole
        gathered += experts.whole_under_tp(spec, config, layout, compute_bytes(config))
    gathered -= saving
    acts = rank_activations(spec, seq=seq, micro_batch=micro_batch, numerics=numerics(config, layout),
                            tp=layout.tp, pp=layout.pp, in_flight=in_flight_microbatches(config, layout),
                            checkpointing=checkpointing, offload=config.offload_activations and moves_to_host(device),
                            loading_horizon=config.activation_loading_horizon,
                            kernels=context.saved_kernels(mode, kernels) if decisions.context_parallel else kernels,
                            sequence_parallel=config.sequence_parallel,
                            regather=decisions.sequence_parallel_regather, context_parallel=cp,
                            stages=(rank,) if rank else ())
    routed = experts.dispatch_activations(spec, config, layout, micro_batch, seq, checkpointing,
                                          rank.in_flight if rank else in_flight_microbatches(config, layout),
                                          compute_bytes(config))
    freed = acts.device + routed
    exchange = context_buffer_bytes(spec, config, layout, micro_batch, seq, device)
    in_backward_reduce = in_backward_reduce_bytes(spec, config, layout)
    regathered = regathered_bytes(spec, config, layout, micro_batch, seq, checkpointing)
    room = _backward_room(spec, config, layout, acts.backward_room, exchange, in_backward_reduce, regathered)
    gathered -= room.blocks
    comm = comm_buffer_bytes(spec, config, layout, micro_batch, seq)
    buffers = comm + exchange - room.exchange - room.reduce
    beyond_room = regathered - room.regathered
    accounted = sum(states.values()) + gathered + acts.device + routed + beyond_room + buffers
    # The categories are each one's most; the step peaks at one of two moments, not at their sum (pipelines, whose
    # microbatches overlap, keep the sum): the loss's backward, or later in backward, every gradient there and the
    # head's tensors freed (what the room did not take).
    at_loss = _at_loss_backward(states, config, gathered, acts, routed, comm - in_backward_reduce)
    overlap = 0.0 if at_loss is None else max(at_loss, accounted - room.unused) - accounted
    return MemoryBreakdown(**states, gathered_params=gathered, activations=acts.device + routed + beyond_room,
                           comm_buffers=buffers,
                           runtime=device.runtime_reserve_bytes if device else 0.0, overlap=overlap,
                           fragmentation=A.FRAGMENTATION_MARGIN * (accounted + overlap), offloaded=acts.host + host_bytes,
                           retention=host_retention(spec, config, layout, device),
                           step_temporaries=step_temporaries(spec, config, layout, device,
                                                             freed + _freed_by_backward(spec, config, layout,
                                                                                        buffers, states)))


@dataclass(frozen=True)
class _BackwardRoom:
    """How the room the head's freed tensors leave (`ActivationMemory.backward_room`) is taken by what lives only
    while a block runs backward, which never meets those tensors: context parallelism's exchange, FSDP2's reduce
    buffers, ZeRO-3's gathered blocks, the inputs sequence parallelism gathers again. Only what exceeds the room
    adds to the peak."""

    exchange: float
    reduce: float
    blocks: float
    regathered: float
    unused: float


def _backward_room(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, backward_room: float, exchange: float,
                   in_backward_reduce: float, regathered: float) -> _BackwardRoom:
    exchange_part = min(backward_room, exchange)
    # FSDP2's part, measured: ZeRO-3 on one H200 rank held only the root's copy beyond DDP at its peak; a Mixtral
    # block's backward leaves no room (its ZeRO-3 peak on CPU ranks was above the prediction with it)
    room = 0.0 if spec.experts else backward_room - exchange_part
    reduce = min(room, in_backward_reduce)
    blocks = blocks_gathered_in_backward(spec, config, layout)
    block_part = min(room - reduce, blocks * compute_bytes(config) * spec.layer_parameters / layout.tp) if blocks else 0.0
    regathered_part = min(room - reduce - block_part, regathered)
    return _BackwardRoom(exchange_part, reduce, block_part, regathered_part, room - reduce - block_part - regathered_part)


def regathered_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int,
                     checkpointing: str) -> float:
    """What `sequence_parallel_regather` holds gathered while a block runs backward: two whole inputs, the one its
    projections use and the next one arriving (parallel/tensor/regather.py); 0 where every block is checkpointed
    (the hook stands aside there) or without it."""
    decisions = Decisions(config, layout)
    if not decisions.sequence_parallel_regather or region_blocks(checkpointing, 1):
        return 0.0
    tokens = micro_batch * seq / decisions.context_parallel_degree
    return 2 * tokens * spec.hidden * compute_bytes(config)


def _at_loss_backward(states: dict[str, float], config: ShardwiseConfig, gathered: float, acts: ActivationMemory,
                      routed: float, replica_buffers: float) -> Optional[float]:
    """Bytes at the loss's backward: no gradient yet (but earlier microbatches'), the head's tensors and the loss's
    own, no FSDP2 reduce buffer (`replica_buffers`: the rest of a replicated layout's buffers); None where the
    activations do not tell that moment apart (pipelines)."""
    if acts.at_loss_backward is None:
        return None
    return (states["parameters"] + states["optimizer"] + (states["gradients"] if config.microbatches > 1 else 0)
            + gathered + acts.at_loss_backward + routed + (0.0 if fully_sharded(config) else replica_buffers))


def context_buffer_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int,
                         device: Optional[DeviceSpec] = None) -> float:
    """What context parallelism's exchange holds at once beyond the activations, in one layer's backward
    (context.py's `held_bytes`); 0 without it. Only what exceeds the room the head's freed tensors leave adds to
    the peak (`predict_memory`)."""
    decisions = Decisions(config, layout)
    if not decisions.context_parallel:
        return 0.0
    shape = context.layer_shape(spec.heads, spec.kv_heads, spec.hidden // spec.heads, layout.tp, micro_batch, seq,
                                compute_bytes(config))
    fused = context.fused_ring_blocks(device.memory_is_host) if device else False
    return context.held_bytes(decisions.context_parallel_mode, decisions.context_parallel_degree, shape, fused)


def _freed_by_backward(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, buffers: float,
                       states: dict[str, float]) -> float:
    """Besides the activations, what is gone by the optimizer step: FSDP2's reduce buffers (DDP's buckets stay);
    under ZeRO-1's master weights the buckets in flight and the replicas' gradients, freed as their buckets
    left (the owner's fp32 master gradients stay for the step; accumulating locally, the other owners' sums)."""
    if fully_sharded(config):
        return buffers
    if accumulates_locally(config):
        return states["gradients"] + buffers - master_gradient_bytes(spec, config, layout)
    if config.sharded_master_weights:
        return states["gradients"] + in_flight_bucket_bytes(spec, layout)
    return 0.0


def step_temporaries(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, device: Optional[DeviceSpec],
                     freed: float) -> float:
    """What the optimizer step's temporaries add to the peak: only what exceeds the bytes backward `freed`
    before the step (activations, and `_freed_by_backward`'s) counts. None on the device when the optimizer
    steps in host memory."""
    if "optimizer" in host_states(config, device):
        return 0.0
    host = device is not None and device.memory_is_host
    return max(0.0, optimizer_step_bytes(spec, config, layout, host) - freed)
