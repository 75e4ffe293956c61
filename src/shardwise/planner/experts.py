"""What expert parallelism costs a rank: expert memory, all-to-all bytes, and an assumed router imbalance.

A mixture-of-experts model's `moe_layers` each hold `experts` experts of `expert_tensors` parameters; each
token goes to `top_k` of them. Expert parallelism of degree ep splits every layer's experts over ep ranks
(borrowed from the data-parallel ranks, as the runtime does, parallel/experts/), and ZeRO shards each share
over the ranks left (dp / ep). A rank then holds 1/ep of the experts, sharded again, beside the rest of the model.

Traffic: each MoE layer sends every (token, k) row to its expert's rank and back (dispatch and combine), and
backward does both again in reverse. A rank's all-to-all buffers hold the rows it dispatches (tokens × top_k)
and the rows it receives (R): 2·(tokens·top_k + R)·hidden·bytes per layer and step, plus the per-expert counts
(8 bytes per expert, once per forward). (ep − 1)/ep of the rows cross to other ranks.

`ROUTER_SKEW` is the router imbalance the planner assumes: the busiest rank of an EP group receives that many
times the mean rows (R = skew · tokens · top_k), which sets its traffic and the activations of its experts. A
router trained with a load-balancing loss keeps its busiest expert near Switch Transformer's capacity factor
of 1.25 (its paper's default for training); 1.0 is perfect balance, which a fresh router does not have either.
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from .collectives import GroupShape

ROUTER_SKEW = 1.25
COUNT_BYTES = 8  # one int64 per expert in the counts exchange
# All-to-alls per MoE layer and microbatch: the counts, dispatch and combine forward, dispatch and combine again
# in backward.
EXCHANGES_PER_LAYER = 5


@dataclass(frozen=True)
class ExpertShape:
    """The experts of a model: per MoE layer `experts` experts, each of the parameter tensors in
    `expert_tensors` (element counts), `top_k` of them per token; `hidden` is the width of the rows sent."""

    experts: int
    top_k: int
    moe_layers: int
    hidden: int
    expert_tensors: tuple[int, ...]

    @property
    def per_expert(self) -> int:
        return sum(self.expert_tensors)

    @property
    def parameters(self) -> int:
        """Every expert parameter of the model."""
        return self.per_expert * self.experts * self.moe_layers


def expert_shape(experts: int, top_k: int, moe_layers: int, hidden: int, expert_ffn: int,
                 gated: bool = True) -> ExpertShape:
    """The usual expert, an MLP hidden → expert_ffn → hidden without biases (gate and up fused when `gated`)."""
    up = (2 if gated else 1) * expert_ffn * hidden
    return ExpertShape(experts, top_k, moe_layers, hidden, (up, hidden * expert_ffn))


def expert_parameters_per_rank(shape: ExpertShape, ep: int, shards: int) -> float:
    """Expert parameters one rank holds: 1/ep of the experts, each share sharded over `shards` ranks."""
    return shape.parameters / ep / shards


def all_to_all_bytes(shape: ExpertShape, tokens: int, ep: int, element_bytes: int,
                     skew: float = ROUTER_SKEW) -> float:
    """Bytes of the all-to-all buffers of one rank in one training step (forward and backward, every MoE
    layer), for `tokens` tokens on the rank; the rank receives `skew` times the mean rows. 0 when ep is 1."""
    if ep == 1:
        return 0.0
    rows = tokens * shape.top_k
    per_layer = 2 * (rows + skew * rows) * shape.hidden * element_bytes + shape.experts * COUNT_BYTES
    return per_layer * shape.moe_layers


def crossing_bytes(shape: ExpertShape, tokens: int, ep: int, element_bytes: int,
                   skew: float = ROUTER_SKEW) -> float:
    """Of `all_to_all_bytes`, what leaves the rank: (ep − 1)/ep of the rows (a rank's own experts' stay)."""
    return all_to_all_bytes(shape, tokens, ep, element_bytes, skew) * (ep - 1) / ep


def received_rows(shape: ExpertShape, tokens: int, skew: float = ROUTER_SKEW) -> float:
    """Rows the busiest rank's experts run per MoE layer: what their activations scale with."""
    return skew * tokens * shape.top_k


def ep_degrees(borrowable: int, experts: int) -> list[int]:
    """The expert-parallel degrees possible: divisors of both the ranks EP borrows from (dp_shard × cp) and the
    number of experts."""
    return [d for d in range(1, borrowable + 1) if borrowable % d == 0 and experts % d == 0]


def expert_degrees(shape: ExpertShape | None, zero_stage: int, sharding_group: int) -> list[int]:
    """The EP degrees the planner tries for one sharding choice: 1 for a model without experts or without
    ZeRO-2/3 (EP borrows from the sharding group), else every degree `ep_degrees` allows."""
    if shape is None or zero_stage < 2:
        return [1]
    return ep_degrees(sharding_group, shape.experts)


def gathered_expert_saving(shape: ExpertShape, layers: int, in_flight: int, ep: int, element_bytes: int) -> float:
    """Bytes of gathered expert parameters EP spares a rank: FSDP2 gathers an expert share over its own copies
    only, 1/ep of a layer's experts. `in_flight` of the stage's `layers` are gathered at once (ZeRO-3's two;
    ZeRO-2 keeps all)."""
    per_layer = shape.per_expert * shape.experts * shape.moe_layers / max(layers, 1)
    return element_bytes * min(in_flight, layers) * per_layer * (1 - 1 / ep)


def all_to_all_seconds(shape: ExpertShape, tokens: int, ep: int, element_bytes: int, bandwidth: float,
                       latency: float, skew: float = ROUTER_SKEW) -> float:
    """Seconds one rank's all-to-alls take in a step: the bytes that cross to other ranks at `bandwidth`
    (bytes/s per rank), plus `latency` per exchange (counts, dispatch and combine forward, both again in
    backward, per MoE layer). On the critical path: each layer waits for its tokens."""
    if ep == 1:
        return 0.0
    return (crossing_bytes(shape, tokens, ep, element_bytes, skew) / bandwidth
            + EXCHANGES_PER_LAYER * shape.moe_layers * (ep - 1) * latency)


def stage_expert_parameters(spec, layout) -> float:
    """Expert parameters of the busiest pipeline stage's blocks (0 for a model without experts)."""
    shape = spec.experts
    if shape is None:
        return 0.0
    return shape.parameters * spec.stage_layers(layout.pp) / spec.layers


def rank_parameters(spec, layout) -> float:
    """Parameters of the busiest stage on one rank before ZeRO shards them: tensor parallelism splits all but the
    experts, which each MoE block keeps whole on every tensor-parallel rank (Mixtral's built-in plan,
    parallel/tensor/registry.py; expert parallelism splits them instead)."""
    whole = stage_expert_parameters(spec, layout)
    return (spec.stage_parameters(layout.pp) - whole) / layout.tp + whole


def whole_under_tp(spec, config, layout, element_bytes: int) -> float:
    """Gathered bytes tensor parallelism does not divide, beyond the 1/tp a dense model's accounting gives the
    experts: the gathered blocks' experts (ZeRO-3's two in flight; ZeRO-2 keeps every block) × (1 − 1/tp)."""
    if layout.tp == 1 or spec.experts is None:
        return 0.0
    layers = spec.stage_layers(layout.pp)
    in_flight = min(2, layers) if config.effective_zero_stage == 3 else layers
    return element_bytes * stage_expert_parameters(spec, layout) * in_flight / layers * (1 - 1 / layout.tp)


def dispatch_activations(spec, config, layout, micro_batch: int, seq: int, checkpointing: str, in_flight: int,
                         element_bytes: int) -> float:
    """Bytes the dispatch keeps for backward beyond a dense MLP's activations, on the busiest stage: per MoE layer
    the rows this rank's experts received (`received_rows`, which their first linear keeps) and the rows returned
    to this rank (tokens · top_k, which the router's weights multiply), hidden wide, for each of `in_flight`
    microbatches. 0 without EP, or when the blocks are recomputed in backward."""
    shape, ep = spec.experts, config.expert_parallel_degree
    if shape is None or ep == 1 or checkpointing != "none":
        return 0.0
    tokens = micro_batch * seq / layout.cp
    layers = shape.moe_layers * spec.stage_layers(layout.pp) / spec.layers
    rows = received_rows(shape, tokens) + tokens * shape.top_k
    return rows * shape.hidden * element_bytes * layers * in_flight


def expert_shard_shape(layout, devices_per_node: int, ep: int):
    """The `GroupShape` of the ranks ZeRO shards one expert share over (`expert_shard`): every ep-th rank of the
    sharding group (dp_shard × cp, cp fastest), since ep takes its neighbouring ranks (parallel/mesh.py)."""
    strides = layout.strides()
    group = [i * strides["dp_shard"] + j * strides["cp"] for i, j in product(range(layout.dp_shard), range(layout.cp))]
    members = group[::ep]
    nodes = len({rank // devices_per_node for rank in members})
    return GroupShape(len(members), len(members) // nodes, nodes)


def gathered_saving(spec, config, layout, element_bytes: int) -> float:
    """`gathered_expert_saving` for a `ModelSpec` under a config and layout (0 without experts or EP), gathered
    parameters of `element_bytes` each."""
    shape, ep = spec.experts, config.expert_parallel_degree
    if shape is None or ep == 1:
        return 0.0
    layers = spec.stage_layers(layout.pp)
    in_flight = 2 if config.effective_zero_stage == 3 else layers
    per_stage = ExpertShape(shape.experts, shape.top_k, layers * shape.moe_layers // spec.layers, shape.hidden,
                            shape.expert_tensors)
    return gathered_expert_saving(per_stage, layers, in_flight, ep, element_bytes)


def step_seconds(spec, config, layout, cluster, micro_batch: int, seq: int, element_bytes: int) -> float:
    """`all_to_all_seconds` of one step on the busiest stage, microbatch by microbatch (activations of
    `element_bytes` per element), over the links the EP group spans (neighbouring ranks of the sharding group:
    inside a node when ep × tp fits one)."""
    shape, ep = spec.experts, config.expert_parallel_degree
    if shape is None or ep == 1:
        return 0.0
    layers = spec.stage_layers(layout.pp)
    stage = ExpertShape(shape.experts, shape.top_k, layers * shape.moe_layers // spec.layers, shape.hidden,
                        shape.expert_tensors)
    if ep * layout.tp <= cluster.devices_per_node:
        bandwidth, latency = cluster.intra_node_bandwidth, cluster.intra_node_latency
    else:
        bandwidth, latency = cluster.inter_node_bandwidth / cluster.devices_per_node, cluster.inter_node_latency
    tokens = micro_batch * seq / layout.cp  # a rank's cp share of each sequence of a microbatch
    each = all_to_all_seconds(stage, tokens, ep, element_bytes, bandwidth * cluster.link_efficiency, latency)
    # every microbatch exchanges its own tokens and counts, paying each exchange's latency and host time
    return config.microbatches * (each + EXCHANGES_PER_LAYER * stage.moe_layers * cluster.critical_op_seconds)
