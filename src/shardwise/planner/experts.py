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

ROUTER_SKEW = 1.25
COUNT_BYTES = 8  # one int64 per expert in the counts exchange


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
