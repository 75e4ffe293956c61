"""The language-model loss over a sequence split across ranks, as one process computes it over the whole.

A causal LM predicts token t+1 at position t, so labels are shifted on the whole sequence before it is split
(`shift_labels`): the pair straddling two ranks' chunks would be lost otherwise. The mean is over the tokens of
the whole group: each rank sums its own, and the count of tokens that are not -100 is summed over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE = -100


def shift_labels(labels: torch.Tensor, pad_token_id: int | None = None) -> torch.Tensor:
    """Next-token labels (batch, seq) for whole rows: label t is token t+1; the last position and padding
    (`pad_token_id`, if given) get -100."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    if pad_token_id is not None:
        shifted = shifted.masked_fill(shifted == pad_token_id, IGNORE)
    return shifted


def sequence_loss(logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Mean cross entropy over every labelled token (not -100) that `group`'s ranks hold, given this rank's logits
    (batch, local seq, vocab) and shifted labels (batch, local seq).

    Logits sharded over the vocabulary (tensor parallelism's, under `loss_parallel`) give the same sum. The value
    is the whole group's mean on every rank; its gradient, averaged over the group as data parallelism
    averages gradients, is the gradient of that mean."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    if isinstance(total, DTensor):  # logits sharded over the vocabulary (tensor parallelism's loss_parallel)
        total = total.full_tensor()
    sums = torch.stack([total.detach(), (labels != IGNORE).sum().to(total.dtype)])
    dist.all_reduce(sums, group=group)
    # A group with no labelled token at all has loss 0, as one process's 0/0 would not be.
    count = sums[1].clamp(min=1)
    share = total * dist.get_world_size(group) / count
    return share + (sums[0] / count - share).detach()
