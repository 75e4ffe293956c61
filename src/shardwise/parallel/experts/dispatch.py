"""Token dispatch and combine: each token's top-k rows go to the ranks holding their experts and come back.

Experts are split over the `ep` group in contiguous blocks (rank r holds experts
r·E/ep … (r+1)·E/ep − 1). A call:

1. orders this rank's (token, k) assignments by expert, then k, then token
   (the order Hugging Face's experts loop adds them in), and counts them per expert;
2. exchanges the counts, then the rows, by all-to-all with uneven splits;
3. runs the local experts on the rows it received, one expert per row (k = 1, weight 1);
4. sends the outputs back by the reverse all-to-all, weights them by the router
   here (so the router's gradient stays on its own rank) and adds them per token.

No row is dropped: every model shardwise knows routes without capacity limits, so
the result is the one-process layer's, in any EP degree. Both all-to-alls are
autograd functions whose backward is the reverse exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ...torch_internals import all_to_all_autograd

# compute(rows, local_expert_of_row) -> each row through its local expert
LocalCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Traffic:
    """Rows one rank sent to each rank of its EP group in one dispatch (the combine sends them back)."""

    sent: tuple[int, ...]
    received: tuple[int, ...]

    rank: int

    def rows_out(self) -> int:
        """Rows that leave this rank, dispatch and combine together (those for itself never cross a link)."""
        return sum(self.sent) - self.sent[self.rank] + sum(self.received) - self.received[self.rank]


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     num_experts: int, group: dist.ProcessGroup, compute: LocalCompute,
                     record: Callable[[Traffic], None] | None = None) -> torch.Tensor:
    """The experts' output for `hidden` (tokens × hidden), each token's top-k experts weighted by the router,
    with the experts spread over `group`; `record` is given the rows exchanged, when set."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local = num_experts // size
    tokens, k = top_k_index.shape
    # position p = k·tokens + t: a stable sort by expert keeps (k, t) order within an expert
    experts = top_k_index.t().reshape(-1)
    order = torch.sort(experts, stable=True).indices
    token_of_row = order % tokens
    per_expert = torch.bincount(experts, minlength=num_experts)
    # received_per_expert[s, j]: rows source s sends to local expert j
    received_per_expert = _exchange_counts(per_expert.view(size, local), group)
    sent = per_expert.view(size, local).sum(1).tolist()
    received = received_per_expert.sum(1).tolist()
    if record is not None:
        record(Traffic(tuple(sent), tuple(received), rank))

    rows = all_to_all_autograd(hidden[token_of_row], received, sent, group)
    local_expert = torch.arange(local, device=hidden.device).repeat(size).repeat_interleave(
        received_per_expert.reshape(-1))
    outputs = compute(rows, local_expert)
    returned = all_to_all_autograd(outputs, sent, received, group)

    weights = top_k_weights.t().reshape(-1)[order]
    weighted = (returned * weights.unsqueeze(-1)).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, token_of_row, weighted)


def _exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row s of `counts` goes to rank s; row s of the result came from rank s."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received
