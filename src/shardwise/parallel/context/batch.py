"""A model's call under context parallelism: its whole rows split over the cp ranks, its loss over the sequence.

The training loop keeps calling `model(input_ids=..., labels=...)` with whole rows. Before the model runs, each
rank keeps its load-balanced share of `input_ids`, `position_ids` (whole-row positions, restarting per packed
document) and the document ids attention keeps apart (`shard_batch`); `labels` never reach the model, whose own
loss would shift them inside a shard. After it, the output's `loss` is `sequence_loss` over the cp group, on next-
token labels shifted on the whole row. `logits` stay this rank's share, in its order.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from shardwise.parallel.context.loss import sequence_loss
from shardwise.parallel.context.sharding import shard_batch

_SPLIT = ("input_ids", "position_ids", "cu_seqlens")


class SequenceSplit:
    """Forward hooks on a model's root that split its rows and compute its loss (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.labels = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
        if kwargs.get("input_ids") is None:
            raise ValueError("context parallelism splits `input_ids` (batch, sequence): call the model with them")
        if kwargs.get("attention_mask") is not None:
            raise ValueError("context parallelism takes no attention_mask: pad on the right with labels -100, and "
                             "pack documents with position_ids restarting at each (or cu_seqlens)")
        whole = {key: kwargs.pop(key, None) for key in _SPLIT}
        labels = kwargs.pop("labels", None)
        kwargs.setdefault("use_cache", False)  # a cache would keep this rank's keys only, and nothing reads it
        inputs, self.labels = shard_batch(whole["input_ids"], dist.get_rank(self.group), dist.get_world_size(self.group),
                                          labels=labels, position_ids=whole["position_ids"],
                                          cu_seqlens=whole["cu_seqlens"])
        return (), {**kwargs, **inputs}

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if self.labels is not None:
            output["loss"] = sequence_loss(output["logits"], self.labels, self.group)
            self.labels = None
        return output


def split_sequences(model: nn.Module, group: dist.ProcessGroup) -> SequenceSplit:
    """Make `model`'s calls take whole rows and return the sequence loss over `group` (its cp ranks)."""
    split = SequenceSplit(group)
    model.register_forward_pre_hook(split.before, with_kwargs=True)
    model.register_forward_hook(split.after, with_kwargs=True)
    return split
