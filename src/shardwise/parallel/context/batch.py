"""A model's call under context parallelism: its whole rows split over the cp ranks, its loss over the sequence.

The training loop keeps calling `model(input_ids=..., labels=...)` with whole rows. Before the model runs, each
rank keeps its load-balanced share of `input_ids`, `position_ids` (whole-row positions, restarting per packed
document) and the document ids attention keeps apart (`shard_batch`); `labels` never reach the model, whose own
loss would shift them inside a shard. After it, the output's `loss` is `sequence_loss` over the cp group, on next-
token labels shifted on the whole row (plus a mixture-of-experts model's weighted load-balancing loss, as its own
loss from labels adds it), and `logits` stay this rank's share. Called without `labels` (a loop whose
own loss function reads the logits), the model returns the whole sequence's logits, gathered from the cp ranks:
every cp rank then computes the same loss, whose gradient reaches each rank's share from all of them (the gather's
backward sums it), so the gradients averaged over the cp ranks are one process's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.parallel.context.loss import sequence_loss
from shardwise.parallel.context.sharding import shard_batch, unshard
from shardwise.torch_internals import all_to_all_autograd

_SPLIT = ("input_ids", "position_ids", "cu_seqlens")


class SequenceSplit:
    """Forward hooks on a model's root, or a pipeline stage's view of it, that split its rows and (where its outputs
    are the model's) compute its loss (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ends_model: bool = True):
        self.group, self.ends_model = group, ends_model
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
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        inputs, self.labels = shard_batch(whole["input_ids"], rank, size,
                                          labels=labels, position_ids=whole["position_ids"],
                                          cu_seqlens=whole["cu_seqlens"])
        return (), {**kwargs, **inputs}

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if not self.ends_model:  # a pipeline stage before the last: what it sends on is its last block's output
            return output
        if self.labels is not None:
            output["loss"] = sequence_loss(output["logits"], self.labels, self.group) + router_loss(module, output)
            self.labels = None
        else:
            output["logits"] = gather_sequence(output["logits"], self.group)
        return output


def router_loss(model: nn.Module, output: Any) -> torch.Tensor | float:
    """What a mixture-of-experts model adds to its loss from labels, which it never sees here: its router's
    load-balancing loss (`aux_loss`, present when it outputs router logits) weighted by `router_aux_loss_coef`."""
    aux, weight = output.get("aux_loss"), getattr(model, "router_aux_loss_coef", None)
    return weight * aux if isinstance(aux, torch.Tensor) and weight is not None else 0.0


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence (dim 1) in order from every rank's load-balanced share; gradients flow back summed.
    Logits sharded over the vocabulary by tensor parallelism stay so: each vocabulary shard is gathered alone."""
    if isinstance(local, DTensor):
        whole = gather_sequence(local.to_local(), group)
        return DTensor.from_local(whole, local.device_mesh, local.placements, run_check=False)
    size, rows = dist.get_world_size(group), local.shape[0]
    # An all-to-all of `size` copies is an all-gather whose backward (the reverse all-to-all, the copies' gradients
    # summed) runs on every backend, gloo included
    copies = local.unsqueeze(0).expand(size, *local.shape).reshape(size * rows, *local.shape[1:])
    gathered = all_to_all_autograd(copies, [rows] * size, [rows] * size, group).view(size, *local.shape)
    return unshard(gathered.transpose(0, 1).flatten(1, 2), 1, size)


def split_sequences(model: nn.Module, group: dist.ProcessGroup, ends_model: bool = True) -> SequenceSplit:
    """Make `model`'s calls take whole rows and return the sequence loss over `group` (its cp ranks); a pipeline
    stage whose outputs are not the model's (`ends_model` false) only splits the rows."""
    split = SequenceSplit(group, ends_model)
    # Inside tensor parallelism's batch hooks (compose installs them first): rows are gathered over tp before the
    # sequences are split, and the loss is taken before tp hands each rank its rows back
    model.register_forward_pre_hook(split.before, with_kwargs=True)
    model.register_forward_hook(split.after, with_kwargs=True, prepend=True)
    return split
