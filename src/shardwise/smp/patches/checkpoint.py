"""SMP's `checkpoint` and `checkpoint_sequential`, on torch's non-reentrant `torch.utils.checkpoint`.

    out = sw.patches.checkpoint.checkpoint(self.block, hidden, mask)
    out = sw.patches.checkpoint.checkpoint_sequential(self.layers, hidden, strategy="group_2")

A checkpointed call keeps its inputs and recomputes its activations in backward:
same values and gradients, less memory. Torch's non-reentrant checkpoint takes any
inputs, tuples included, so `pack_args_as_tuple` (which SMP's autograd function
needed to unpack tuples) changes nothing. Under pipeline parallelism the layers of
a sequential that other ranks hold are stand-ins (parallel/pipeline/stage.py): a
group never spans one, and stand-ins run unrecorded, which gives SMP's
"contiguous" and "group_x" strategies their meaning of layers held by this rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...api.recompute import checkpointed_call, current_offload
from ...parallel.compose import checkpoint_in_groups, group_size

STRATEGIES = ('"each"', '"contiguous"', '"group_<n>"')


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True) -> Any:
    """`module(*args)`, its activations recomputed in backward. Only a module, as in SMP: not a function."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint expects an nn.Module, got {type(module).__name__}; SMP checkpoints modules, "
                        "not functions: wrap the code in a module")
    return checkpointed_call(module, *args, preserve_rng_state=preserve_rng_state)  # offloaded with offload_activations


def checkpoint_sequential(sequential_module: nn.Sequential, input: Any, strategy: str = "each",
                          preserve_rng_state: bool = True, pack_args_as_tuple: bool = False) -> Any:
    """`sequential_module(input)`, each group of layers checkpointed as one: `"each"` layer alone,
    `"contiguous"` every run of layers this rank holds, `"group_<n>"` runs of n of them."""
    if not isinstance(sequential_module, nn.Sequential):
        raise TypeError(f"checkpoint_sequential expects an nn.Sequential, got {type(sequential_module).__name__}; "
                        "use checkpoint(module, ...) for other modules")
    try:
        size = group_size(strategy)
    except ValueError:
        raise ValueError(f"checkpoint_sequential: strategy={strategy!r} is not one of {', '.join(STRATEGIES)}; "
                         "fix: e.g. strategy=\"group_2\"") from None
    return checkpoint_in_groups(list(sequential_module), input, size, preserve_rng_state, offload=current_offload())
