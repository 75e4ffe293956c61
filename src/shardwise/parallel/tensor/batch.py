"""Which rows a tensor-parallel group computes, per SMP's `prescaled_batch`.

prescaled_batch off (SMP's default): each rank of a TP group loads its own b rows
(the data loader shards over dp × tp ranks). The group runs one model on one
batch, so `gather` all-gathers the inputs along dim 0 inside the group (tp·b
rows, in TP-rank order) and `split` gives each rank back the output rows of its
own inputs. The split's backward all-gathers the output gradients, so every TP
rank backpropagates the whole group batch, as the split layers need.

prescaled_batch on: the ranks of a TP group load the same batch, tp times larger
(the loader shards over dp ranks only); no gather, no split.

Loss scaling — the same rule in both modes, nothing for the runtime to apply:
each rank's loss is the mean over the rows it sees, gradients are averaged over
the dp ranks (DDP / FSDP default) and the reported loss is averaged over all
dp × tp ranks. Off, the group's gradient would be the *sum* of its tp ranks'
mean losses — tp times the gradient of the group-batch mean — so `split` scales
its backward by 1/tp; a loss the model computes itself on the gathered batch
(`labels=`) is already the group mean and passes `split` untouched. Both then
match one process on the global batch of dp·tp·b rows. (Without `split`'s 1/tp,
the runtime would have to multiply the loss by 1/tp.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...torch_internals import tree_leaves, tree_map


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _rows(tree: Any) -> Optional[int]:
    """Dim-0 size of the first tensor with a batch dim: the batch size of these inputs."""
    return next((t.shape[0] for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim()), None)


def gather_batch(inputs: Any, tp_mesh: DeviceMesh) -> tuple[Any, Optional[int]]:
    """All-gather every batch tensor in `inputs` along dim 0 inside the TP group.

    Batch tensors are those whose dim 0 equals the first tensor's; others (scalars,
    broadcast masks) pass unchanged. Every rank must bring the same number of rows.
    Returns the gathered inputs and the group's row count (for `split_outputs`).
    """
    rows = _rows(inputs)
    if rows is None:
        return inputs, None

    def gather(t):
        if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[0] != rows:
            return t
        return DTensor.from_local(t, tp_mesh, [Shard(0)], run_check=False).full_tensor()

    return tree_map(gather, inputs), rows * tp_mesh.size()


def split_outputs(outputs: Any, tp_mesh: DeviceMesh, group_rows: int) -> Any:
    """This rank's rows of every output tensor whose dim 0 has `group_rows`; the rest unchanged.

    A vocab-sharded DTensor (loss-parallel logits) is re-sharded by rows with one
    all-to-all, so the rank gets its rows with the full vocabulary. Backward:
    all-gather (or all-to-all) of the gradients, scaled by 1/tp (see the module doc).
    """
    tp = tp_mesh.size()

    def split(t):
        if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[0] != group_rows:
            return t
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
        return ScaleGrad.apply(t.redistribute(tp_mesh, [Shard(0)]).to_local(), 1.0 / tp)

    return tree_map(split, outputs)


class TensorParallelBatch:
    """The runtime's handle on batch handling for one TP group: gather before, split after the model."""

    def __init__(self, tp_mesh: DeviceMesh, prescaled_batch: bool):
        self.tp_mesh = tp_mesh
        self.active = tp_mesh.size() > 1 and not prescaled_batch
        self._group_rows: Optional[int] = None

    def gather(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.active:
            return args, kwargs
        (args, kwargs), self._group_rows = gather_batch((args, kwargs), self.tp_mesh)
        return args, kwargs

    def split(self, outputs: Any) -> Any:
        if not self.active or self._group_rows is None:
            return outputs
        return split_outputs(outputs, self.tp_mesh, self._group_rows)

    def install(self, module: nn.Module) -> list:
        """Gather in a forward pre-hook and split in a forward hook of `module`; returns the handles."""
        return [module.register_forward_pre_hook(lambda _, args, kwargs: self.gather(args, kwargs),
                                                 with_kwargs=True),
                module.register_forward_hook(lambda _, args, outputs: self.split(outputs))]
