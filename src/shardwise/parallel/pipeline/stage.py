"""A pipeline stage built from the user's own model, so its own `forward` keeps running unchanged.

A stage is the model with only some of its blocks: the block list keeps just
this stage's blocks (under their original indices, so parameter names stay
those of the unsplit model), and every module with parameters that another
stage holds is replaced by an `Elsewhere` stand-in without parameters. The
model's `forward` then runs as written, from its first line to its last; two
hooks make it a stage:

- after the first stage, a pre-hook on the stage's first block swaps in the
  hidden states received from the previous stage (what the stand-in embeddings
  computed is dropped);
- before the last stage, a hook on the stage's last block keeps that block's
  output, which is what the stage sends on. The rest of the forward runs on
  stand-ins whose outputs cost no memory (a `labels` input is not passed there,
  so a Hugging Face model computes its loss on the last stage only).

A model whose forward sums something over every layer (a mixture of experts'
load-balancing statistics) has a `carry` (experts/load_balancing.py): each stage
before the last sends its running sums after the hidden states, and the next
stage takes them off before the blocks see what it received.

Of a block returning a tuple, only the first element is sent (a Hugging Face
block's hidden states), unless the block's class sets `SENDS_WHOLE_OUTPUT`
(`shardwise.deepspeed.pipe`'s layers, which pass tuples of tensors from layer
to layer as DeepSpeed's do): then the whole tuple is sent, and the next stage's
first block receives it as one tuple argument.

The forward is never cut short by an exception, so every module's forward
hooks run in pairs, as FSDP's and torch's memory and FLOP trackers expect.

The last stage returns the model's outputs flattened to tensors (what
`torch.distributed.pipelining` can handle) and `StageModule.rebuild` restores
their structure (a Hugging Face `ModelOutput`, a dict, …) for the user's loss.
A rank running several stages (virtual stages) has one view of the model per
stage; the views share every block and leaf module, only the containers on the
path to the block list are copied.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Container, ContextManager

import torch
from torch import nn

from ...torch_internals import children_table, tree_flatten, tree_unflatten
from ..stand_in import Elsewhere
from .blocks import Blocks
from .partition import Partition


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    children_table(root.get_submodule(parent))[name] = module


def _block_list(root: nn.Module, blocks: Blocks) -> nn.Module:
    return root.get_submodule(blocks.path)


def _stand_in_ends(root: nn.Module, part: Partition, held: list[int]) -> None:
    """Replace the modules around the blocks that belong to stages not in `held` by stand-ins."""
    for end, paths, free in ((0, part.blocks.before, False), (part.stages - 1, part.blocks.after, True)):
        if end not in held:
            for path in paths:
                if not isinstance(root.get_submodule(path), Elsewhere):
                    _replace(root, path, Elsewhere(root.get_submodule(path), free))


def _keep_blocks(block_list: nn.Module, keep: Container[int]) -> None:
    children = children_table(block_list)
    for key in list(children):
        if int(key) not in keep:
            del children[key]  # not `del block_list[i]`, which renumbers the rest


def prune(model: nn.Module, part: Partition, stages: list[int]) -> None:
    """Keep in `model` only what `stages` hold: their blocks, and the end modules if they hold an end."""
    keep = {i for s in stages for i in range(*part.bounds[s])}
    _keep_blocks(_block_list(model, part.blocks), keep)
    _stand_in_ends(model, part, stages)


def _fork(module: nn.Module) -> nn.Module:
    """A shallow copy with its own tables of children, parameters and hooks; tensors and children shared."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            clone.__dict__[key] = copy.copy(value)
    return clone


def stage_view(model: nn.Module, part: Partition, stage: int) -> nn.Module:
    """`model` (already pruned to this rank's stages) as stage `stage` alone sees it."""
    names = part.blocks.path.split(".")
    root = node = _fork(model)
    for name in names[:-1]:
        children_table(node)[name] = node = _fork(children_table(node)[name])
    blocks = _fork(children_table(node)[names[-1]])
    _keep_blocks(blocks, range(*part.bounds[stage]))
    children_table(node)[names[-1]] = blocks
    _stand_in_ends(root, part, [stage])
    return root


_TENSOR = object()  # marks where a tensor goes back into the last stage's output structure
SENDS_WHOLE_OUTPUT = "_pipeline_sends_whole_output"  # a block class attribute: send its whole output (a tuple)


class StageModule(nn.Module):
    """Stage `index` of `num_stages`: `forward(*received, **model_inputs)` runs the model's forward over it."""

    def __init__(self, view: nn.Module, part: Partition, index: int):
        super().__init__()
        self.module = view
        self.index = index
        self.is_first = index == 0
        self.is_last = index == part.stages - 1
        self._blocks = list(_block_list(view, part.blocks))
        self._received: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None
        self._forwarding = False  # inside this stage's forward (not a checkpointed region's recomputation)
        self._template: tuple[Any, list[Any]] | None = None
        self.precision: Callable[[], ContextManager] = contextlib.nullcontext
        self.carry: Any = None  # sums passed on beside the hidden states (module docstring), when the model has them

    def install_hooks(self) -> None:
        """Call after data-parallel wrapping: the swap must run before FSDP's own pre-hook casts the inputs."""
        if not self.is_first:
            self._blocks[0].register_forward_pre_hook(self._feed, with_kwargs=True, prepend=True)
        if not self.is_last:
            self._blocks[-1].register_forward_hook(self._keep)

    def _feed(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._received is None:
            raise RuntimeError(f"pipeline stage {self.index} ran without hidden states from stage {self.index - 1}")
        if args:
            return (self._received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._received}

    def _keep(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._forwarding:  # a checkpointed region recomputing the block in backward: nothing to send
            return
        whole = getattr(module, SENDS_WHOLE_OUTPUT, False)
        self._sent = output[0] if isinstance(output, (tuple, list)) and not whole else output

    def forward(self, *received: torch.Tensor, **inputs: Any) -> Any:
        carried = None
        if self.carry is not None and received:
            *received, carried = received
        # Several tensors received: a block that sends its whole output sent a tuple (see SENDS_WHOLE_OUTPUT).
        self._received = (received[0] if len(received) == 1 else tuple(received)) if received else None
        if not self.is_last:
            inputs.pop("labels", None)
        self._forwarding = True
        try:
            with self.precision(), (self.carry.stage(carried, self.is_last) if self.carry is not None
                                    else contextlib.nullcontext()):
                outputs = self.module(**inputs)
        finally:
            self._received, self._forwarding = None, False
        if not self.is_last:
            sent, self._sent = self._sent, None
            if sent is None:
                raise RuntimeError(f"pipeline stage {self.index}: the model's forward did not call its last block "
                                   f"({type(self._blocks[-1]).__name__}); the blocks must run in order, every one")
            if isinstance(sent, (tuple, list)) and not all(isinstance(t, torch.Tensor) for t in sent):
                kinds = ", ".join(type(t).__name__ for t in sent)
                raise TypeError(f"pipeline stage {self.index} sends its last block's output ({kinds}) to stage "
                                f"{self.index + 1}, and only tensors pass between stages; fix: return tensors only "
                                "from the block, rebuilding the rest on the next stage")
            if self.carry is not None:
                sums = self.carry.sent((sent[0] if isinstance(sent, (tuple, list)) else sent).device)
                sent = (*sent, sums) if isinstance(sent, (tuple, list)) else (sent, sums)
            return tuple(sent) if isinstance(sent, list) else sent
        leaves, spec = tree_flatten(outputs)
        self._template = (spec, [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
        tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        return tensors[0] if len(tensors) == 1 else tensors

    def rebuild(self, output: Any) -> Any:
        """The last stage's output (tensor or tuple of tensors) in the structure the model returned."""
        spec, leaves = self._template
        tensors = iter(output if isinstance(output, tuple) else (output,))
        return tree_unflatten([next(tensors) if leaf is _TENSOR else leaf for leaf in leaves], spec)
