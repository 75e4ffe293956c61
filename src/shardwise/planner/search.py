"""Enumerate configurations for a model on a cluster, predict each, keep the fitting ones ranked.

A *layout considered* is one choice of degrees (tp, pp, MiCS group; where sequences are long the
context-parallel degree and mode too: context.LONG_SEQUENCE), ZeRO stage (ZeRO-3 across nodes also with ZeRO++
hpZ inside each node) and checkpointing strategy (SMP's names: activations.CHECKPOINTING). For each, the
microbatch count, activation and optimizer-state offload and sequence parallelism are chosen here: the fastest variant that fits, else
the one needing the least memory (whose overflow `--explain` reports). Offloading is
slower, so it is proposed only where it makes a layout fit, and never on a device
whose memory is the host's. Every candidate is
a plain dict of config keys checked by `validate`, the validation `shardwise run`
applies, so a plan is a config `run` accepts as is: a variant needing a feature this
release lacks is never proposed, and is again once a release builds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product
from typing import Iterator, Mapping, NamedTuple, Optional, Union

from ..config import ConfigError, Problem, ShardwiseConfig
from ..topology import Layout
from ..config.decisions import splits_evenly
from ..config.layout import validate
from .activations import distinct_strategies
from .errors import PlanError
from .hardware import GiB, ClusterSpec
from .memory import MemoryBreakdown, predict_memory
from .offload import moves_to_host
from .experts import expert_degrees
from . import context
from .spec import ModelSpec
from .timing import StepTime, predict_step_time


@dataclass(frozen=True)
class Evaluation:
    """One configuration and its prediction. `batch_size` is sequences per data-parallel replica
    per step (what `data_loader` gets with prescaled_batch); `micro_batch` = batch_size / microbatches."""

    config: dict
    layout: Layout
    zero_stage: int
    checkpointing: str
    batch_size: int
    micro_batch: int = 0
    memory: Optional[MemoryBreakdown] = None
    time: Optional[StepTime] = None
    reason: Optional[str] = None

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def step_time(self) -> float:
        return self.time.total if self.time else float("inf")


@dataclass(frozen=True)
class Plan:
    spec: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    seq: int
    precision: str
    considered: list[Evaluation] = field(default_factory=list)

    @property
    def fitting(self) -> list[Evaluation]:
        return [e for e in self.considered if e.fits]

    @property
    def best(self) -> Optional[Evaluation]:
        return next(iter(self.fitting), None)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def config_dict(precision: str, *, tp: int = 1, pp: int = 1, stage: int = 0, group: int = 1,
                microbatches: int = 1, offload: bool = False, sequence_parallel: bool = False,
                regather: bool = False, hpz: int = 0, cp: int = 1, cp_mode: str = "ring",
                local_accumulation: bool = False) -> dict:
    """The config keys for one candidate, leaving defaults out so the plan reads like a hand-written config.

    No `active_microbatches`: under the default 1f1b a round of pp or more changes nothing (pp stay in
    flight), and a round below pp saves no more memory than smaller microbatches, which lose less to the
    bubble, until a microbatch is one sequence (docs/planner.md, limits)."""
    d: dict = {}
    if tp > 1:
        d.update(tensor_parallel_degree=tp, prescaled_batch=True)
    if sequence_parallel:
        d["sequence_parallel"] = True
    if regather:
        d["sequence_parallel_regather"] = True
    if cp > 1:
        d["context_parallel_degree"] = cp
        if cp_mode != "ring":
            d["context_parallel_mode"] = cp_mode
    if pp > 1:
        d["pipeline_parallel_degree"] = pp
    if microbatches > 1:
        d["microbatches"] = microbatches
    if stage == 1:
        d["shard_optimizer_state"] = True
        if local_accumulation:
            d["accumulate_gradients_locally"] = True
    elif stage >= 2:
        d["zero_stage"] = stage
        if group > 1:
            d["sharded_data_parallel_degree"] = group
    if hpz:
        d["zero_hpz_partition_size"] = hpz
    if precision != "fp32":
        d[precision] = True
    if offload:
        d["offload_activations"] = True
    return d


def _model_problems(spec: ModelSpec, layout: Layout, global_batch: int, seq: int,
                    sequence_parallel: bool = False, cp_mode: str = "ring") -> list[Problem]:
    """Rules that need the model, the batch or the sequence, beyond what config validation knows."""
    problems = []
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    if spec.traced and tp > 1:
        problems.append(Problem("tensor_parallel_degree", tp, f"splits layers by a built-in plan, which the traced "
                                f"model {spec.name} has not (gpt2, llama, bert and vit have)", "use 1"))
    elif spec.heads % tp or spec.kv_heads % tp:
        problems.append(Problem("tensor_parallel_degree", tp, f"must divide the model's {spec.heads} attention "
                                f"heads ({spec.kv_heads} key/value heads)", "use a smaller power of two"))
    if pp > spec.max_stages:
        what = "layers" if spec.max_stages == spec.layers else "pipeline stages its module graph can be cut into"
        problems.append(Problem("pipeline_parallel_degree", pp, f"exceeds the model's {spec.max_stages} {what}",
                                f"use at most {spec.max_stages} stages"))
    if global_batch % dp:
        problems.append(Problem("global batch", global_batch, f"is not divisible by the data-parallel degree {dp}",
                                "choose a global batch that is a multiple of it"))
    if sequence_parallel and not splits_evenly(seq, tp):  # the runtime's rule, checked at the first block
        problems.append(Problem("sequence_parallel", True, f"the sequence length {seq} does not divide by "
                                f"tensor_parallel_degree {tp}", f"pad or cut the inputs to a multiple of {tp} "
                                "positions, or set sequence_parallel to false"))
    # context parallelism: the runtime's rules, checked when it wraps the model and at every batch
    split = context.model_problem(spec.family, spec.traced is not None, spec.attention_dropout, cp_mode, layout.cp,
                                  spec.heads, tp, seq)
    return problems + ([split] if split else [])


class _Choice(NamedTuple):
    """The part of a configuration the search enumerates; microbatching is chosen per choice."""

    tp: int
    pp: int
    stage: int
    group: int           # ZeRO-2/3 partition-group size (MiCS when below the data-parallel degree)
    checkpointing: str
    sequence: tuple[bool, ...] = (False,)   # sequence_parallel settings to try
    hpz: int = 0         # ZeRO++ hpZ's secondary group (0: off)
    cp: int = 1          # context_parallel_degree
    cp_mode: str = "ring"

    def requested_layout(self, world: int) -> Layout:
        dp = world // (self.tp * self.pp * self.cp)
        shard = self.group if self.stage >= 2 else 1
        return Layout(pp=self.pp, dp_replicate=dp // shard, dp_shard=shard, tp=self.tp, cp=self.cp)


def _rejected(d: dict, layout: Layout, stage: int, problems: list[Problem], checkpointing: str,
              batch: int) -> Evaluation:
    return Evaluation(d, layout, stage, checkpointing, batch, reason="; ".join(map(str, problems)))


def _overflow(memory: MemoryBreakdown, cluster: ClusterSpec) -> Optional[str]:
    """Why `memory` does not fit one device, naming the largest category; None when it fits."""
    capacity = cluster.device.memory_bytes
    if memory.total <= capacity:
        return None
    name, largest = max(((k, v) for k, v in memory.summary().items() if k != "total"), key=lambda kv: kv[1])
    return (f"needs {memory.total / GiB:.1f} GiB per rank, {(memory.total - capacity) / GiB:.1f} GiB more than "
            f"the {capacity / GiB:.0f} GiB of one {cluster.device.name} (largest: {name} {largest / GiB:.1f} GiB)")


def _predict(spec: ModelSpec, cluster: ClusterSpec, config: ShardwiseConfig, d: dict, layout: Layout,
             checkpointing: str, batch: int, seq: int) -> Evaluation:
    micro = batch // config.microbatches
    memory = predict_memory(spec, config, layout, micro, seq, checkpointing, cluster.device)
    time = predict_step_time(spec, config, layout, cluster, micro, seq, checkpointing)
    return Evaluation(d, layout, config.effective_zero_stage, checkpointing, batch, micro, memory, time,
                      _overflow(memory, cluster))


def evaluate(spec: ModelSpec, cluster: ClusterSpec, config: Union[Mapping, ShardwiseConfig], *,
             global_batch: int, seq: Optional[int] = None, checkpointing: str = "none") -> Evaluation:
    """Predict one given config (a dict of config keys or a ShardwiseConfig) on `cluster`; a ConfigError
    when `shardwise run` would refuse it there."""
    given = config.model_dump(exclude_defaults=True) if isinstance(config, ShardwiseConfig) else config
    config, layout = validate(given, cluster.topology)
    d = config.model_dump(exclude_defaults=True)
    seq = seq or spec.seq_len
    problems = _model_problems(spec, layout, global_batch, seq, config.sequence_parallel,
                               config.context_parallel_mode)
    batch = global_batch // layout.dp
    if not problems and batch % config.microbatches:
        problems.append(Problem("microbatches", config.microbatches,
                                f"must divide the batch of {batch} per replica", "use a divisor of it"))
    if problems:
        return _rejected(d, layout, config.effective_zero_stage, problems, checkpointing, batch)
    return _predict(spec, cluster, config, d, layout, checkpointing, batch, seq)


def _variants(choice: _Choice, precision: str, batch: int, host: bool, ep_degrees: list[int]) -> Iterator[dict]:
    """Microbatching, activation offload and sequence parallelism for one choice: microbatch counts dividing
    the replica's batch, activation offload with checkpointing, pipelining and m > 1 where the device has
    memory apart from the `host`'s, sequence parallelism where `_considered` found it allowed (without
    checkpointing also gathering its inputs again in backward, sequence_parallel_regather); ZeRO-1's fp32
    masters over several microbatches also adding them up on each rank (accumulate_gradients_locally); for a
    model with experts each expert-parallel degree in `ep_degrees` (planner/experts.py)."""
    tp, pp, stage, group, checkpointing, sequence, hpz, cp, cp_mode = choice
    modes = [(sp, regather) for sp in sequence for regather in (False, True)
             if not regather or (sp and checkpointing == "none")]
    for m in (m for m in _powers_of_two(batch) if batch % m == 0):
        offloads = [False, True] if host and pp > 1 and checkpointing != "none" and m > 1 else [False]
        accumulations = [False, True] if stage == 1 and precision != "fp32" and m > 1 else [False]
        for offload, (sp, regather), ep, local in product(offloads, modes, ep_degrees, accumulations):
            d = config_dict(precision, tp=tp, pp=pp, stage=stage, group=group, microbatches=m, offload=offload,
                            sequence_parallel=sp, regather=regather, hpz=hpz, cp=cp, cp_mode=cp_mode,
                            local_accumulation=local)
            yield {**d, "expert_parallel_degree": ep} if ep > 1 else d


def _best_variant(spec: ModelSpec, cluster: ClusterSpec, choice: _Choice, batch: int, seq: int,
                  precision: str) -> Evaluation:
    """The fastest fitting variant of `choice` that `shardwise run` accepts, else the one needing the least
    memory; when run refuses every variant, why it refuses the first. A sharded variant that does not fit
    is tried again with its optimizer's states offloaded, where the device has memory apart from the host's."""
    results, refused = [], []
    host = moves_to_host(cluster.device)
    # experts borrow from the sharding group, its cp ranks included
    ep_degrees = expert_degrees(spec.experts, choice.stage, choice.group * choice.cp)
    for d in _variants(choice, precision, batch, host, ep_degrees):
        for candidate in (d, {**d, "offload_optimizer_state": True}):
            try:
                config, layout = validate(candidate, cluster.topology)
            except ConfigError as err:
                refused.append(_rejected(candidate, choice.requested_layout(cluster.world_size), choice.stage,
                                         err.problems, choice.checkpointing, batch))
                break
            results.append(_predict(spec, cluster, config, candidate, layout, choice.checkpointing, batch, seq))
            if results[-1].fits or not (host and choice.stage):
                break
    if not results:
        return refused[0]
    fitting = [e for e in results if e.fits]
    if fitting:
        return min(fitting, key=lambda e: (e.step_time, e.memory.total))
    return min(results, key=lambda e: e.memory.total)


def _sharding_choices(dp: int, per_node: int, plain: bool, cp: int = 1,
                      pipelined: bool = False) -> list[tuple[int, int, int]]:
    """(ZeRO stage, partition group, hpZ group): DDP; with dp > 1 also ZeRO-1, and ZeRO-2/3 in every group size;
    ZeRO-3 over a group that spans nodes also with ZeRO++ hpZ over each node's share of it, where the layout
    allows it (`plain`: no tensor or pipeline parallelism). Under context parallelism of degree `cp` the cp ranks
    reduce and shard with the replicas (a sharding group of `group × cp` ranks), so one replica has something to
    shard too; under a pipeline only over the whole data-parallel group (MiCS groups there do not run with CP:
    config/context.py).

    ZeRO-1 of one replica shards nothing: in fp32 it is DDP, and in bf16/fp16 its half-precision
    parameters (2a) come with fp32 masters and master gradients of the whole model: 18a with Adam's
    moments, where DDP keeps 16a."""
    if dp * cp == 1:
        return [(0, 1, 0)]
    groups = [dp] if cp > 1 and pipelined else _divisors(dp)[1:] or [1]  # group 1: one replica's cp ranks
    sharded = [(stage, group, 0) for group in groups for stage in (2, 3)]
    hpz = [(3, group, math.gcd(group * cp, per_node)) for group in groups
           if plain and 1 < math.gcd(group * cp, per_node) < group * cp]
    return [(0, 1, 0), (1, 1, 0)] + sharded + hpz


def _degree_problems(spec: ModelSpec, cluster: ClusterSpec, d: dict, layout: Layout, global_batch: int,
                     seq: int) -> list[Problem]:
    """Why config `d` cannot run with its degrees: the validation `shardwise run` applies, then the model's rules."""
    problems = _model_problems(spec, layout, global_batch, seq, d.get("sequence_parallel", False),
                               d.get("context_parallel_mode", "ring"))
    try:
        validate(d, cluster.topology)
    except ConfigError as err:
        problems = err.problems + problems
    return problems


def _considered(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, seq: int, precision: str, cp: int = 1,
                cp_mode: str = "ring", skip: frozenset = frozenset()) -> Iterator[Evaluation]:
    """One evaluation per (tp, pp) the rules reject, else per sharding and checkpointing choice. With tp > 1
    every choice also tries sequence parallelism, unless the rules reject it: then one evaluation says why.
    With context parallelism of degree `cp` in `cp_mode`, the (tp, pp) that leave ranks it divides, and one
    rejection only where CP itself is what the rules reject (the search without CP says the rest); none for the
    (tp, pp) in `skip`."""
    world = cluster.world_size
    for tp in _powers_of_two(min(world, 2 * cluster.devices_per_node)):
        for pp in (pp for pp in _divisors(world // tp) if world // (tp * pp) % cp == 0 and (tp, pp) not in skip):
            dp = world // (tp * pp * cp)
            layout = Layout(pp=pp, dp_replicate=dp, tp=tp, cp=cp)
            base = config_dict(precision, tp=tp, pp=pp, cp=cp, cp_mode=cp_mode)
            problems = _degree_problems(spec, cluster, base, layout, global_batch, seq)
            if problems:
                if cp == 1 or not _degree_problems(spec, cluster, config_dict(precision, tp=tp, pp=pp),
                                                   Layout(pp=pp, dp_replicate=dp * cp, tp=tp), global_batch, seq):
                    yield _rejected(base, layout, 0, problems, "none", global_batch // dp)
                continue
            sequence = (False,)
            if tp > 1:
                with_sp = {**base, "sequence_parallel": True}
                problems = _degree_problems(spec, cluster, with_sp, layout, global_batch, seq)
                if problems:
                    if cp == 1:
                        yield _rejected(with_sp, layout, 0, problems, "none", global_batch // dp)
                else:
                    sequence = (False, True)
            for stage, group, hpz in _sharding_choices(dp, cluster.devices_per_node, tp == pp == 1, cp, pp > 1):
                groups = spec.sequential_blocks and not spec.graph_stages(pp)
                policies = not (spec.traced or spec.graph_stages(pp))
                for checkpointing in distinct_strategies(spec.stage_layers(pp), groups, policies):
                    choice = _Choice(tp, pp, stage, group, checkpointing, sequence, hpz, cp, cp_mode)
                    yield _best_variant(spec, cluster, choice, global_batch // dp, seq, precision)


def _context_considered(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, seq: int,
                        precision: str) -> Iterator[Evaluation]:
    """`_considered` for the context-parallel degrees dividing the world, in each mode, from the lowest; for each
    (tp, pp) only up to the first degree at which a layout fits without recomputation or offload: a higher one
    keeps the same work per rank and adds traffic. For a model whose attention the runtime cannot split
    (context.py) one evaluation says why; none for a traced one (whose attention the planner cannot see)."""
    degrees = _divisors(cluster.world_size)[1:]
    if spec.traced or not degrees:
        return
    lowest, dp = degrees[0], cluster.world_size // degrees[0]
    problem = context.model_problem(spec.family, False, spec.attention_dropout, "ring", lowest, spec.heads, 1,
                                    2 * lowest)
    if problem:  # the model, not a degree: one evaluation says why no degree is tried
        yield _rejected(config_dict(precision, cp=lowest), Layout(dp_replicate=dp, cp=lowest), 0, [problem], "none",
                        global_batch // dp)
        return
    for mode in context.MODES:
        done: set[tuple[int, int]] = set()
        for cp in degrees:
            fitting = set()
            for e in _considered(spec, cluster, global_batch, seq, precision, cp, mode, frozenset(done)):
                if e.fits and e.checkpointing == "none" and not any(k.startswith("offload") for k in e.config):
                    fitting.add((e.layout.tp, e.layout.pp))
                yield e
            done |= fitting


def _rank_key(e: Evaluation) -> tuple:
    if e.fits:
        return (0, e.step_time, e.memory.total)
    if e.memory is not None:
        return (1, e.memory.total, 0.0)
    return (2, 0.0, 0.0)


def plan(spec: ModelSpec, cluster: ClusterSpec, *, global_batch: Optional[int] = None, seq: Optional[int] = None,
         precision: Optional[str] = None) -> Plan:
    """Every layout considered for `spec` on `cluster`, fitting ones first, fastest first.

    Defaults: the model's sequence length, one sequence per device, and the device's
    fastest precision (bf16 on A100/H100, fp16 on T4, fp32 on CPUs). Precision is an input, not searched:
    it changes the numerics, which a plan must not do behind the user's back.
    """
    global_batch = global_batch or cluster.world_size
    seq = seq or spec.seq_len
    precision = precision or cluster.default_precision()
    if global_batch < 1 or seq < 1:
        raise PlanError(f"global batch ({global_batch}) and sequence length ({seq}) must be 1 or more")
    if not cluster.device.supports(precision):
        raise PlanError(f"precision {precision!r} is not supported by {cluster.device.name}; use one of "
                        + ", ".join(sorted(cluster.device.peak_flops)))
    considered = list(_considered(spec, cluster, global_batch, seq, precision))
    if seq >= context.LONG_SEQUENCE or not any(e.fits for e in considered):
        considered += _context_considered(spec, cluster, global_batch, seq, precision)
    return Plan(spec, cluster, global_batch, seq, precision, sorted(considered, key=_rank_key))
