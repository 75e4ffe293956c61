"""`DistributedModule`: what the `shardwise.nn` distributed modules share.

Each computes in one process exactly the math SMP documents for it, from torch's
own layers and functions, and says how tensor parallelism splits it
(`tensor_parallel_plan`, written relative to itself): column-parallel into heads
or hidden units, row-parallel back, as Megatron does. `DistributedModel` splits it
with DTensor when `tensor_parallel_degree` > 1 (parallel/tensor/modules.py); the
parameters keep their names, so a state dict reads the same in every layout.

SMP's module arguments that ask for a kernel torch does not have here are taken and
named once (`note_ineffective`); keyword arguments a module does not take at all
are ignored, as SMP does (its own `init_hook` example passes a whole model
config), and logged once.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ...config import IneffectiveSettingsWarning
from ...parallel.tensor.modules import carriers_below, merged, prefixed
from ...parallel.tensor.plan import TensorParallelPlan
from ...parallel.tensor.styles import StyleSpec

log = logging.getLogger(__name__)
_said: set[tuple[str, str]] = set()


def note_ineffective(owner: str, found: Mapping[str, str]) -> None:
    """Name, once per process and on the first rank, the arguments of `owner` that change nothing here."""
    new = {key: why for key, why in found.items() if (owner, key) not in _said}
    _said.update((owner, key) for key in new)
    if new and (not dist.is_initialized() or dist.get_rank() == 0):
        named = ", ".join(f"{key} ({why})" for key, why in new.items())
        warnings.warn(f"{owner}: these arguments have no effect here: {named}; fix: drop them",
                      IneffectiveSettingsWarning, stacklevel=3)


def ignore_unknown(owner: str, unknown: Mapping[str, Any]) -> None:
    """Keyword arguments the module does not take: ignored, as SMP does, and logged once."""
    new = sorted(key for key in unknown if (owner, f"unknown:{key}") not in _said)
    _said.update((owner, f"unknown:{key}") for key in new)
    if new:
        log.info("%s ignores keyword arguments it does not take: %s", owner, ", ".join(new))


class DistributedModule(nn.Module):
    """SMP's `smp.nn.DistributedModule`: the base of the modules tensor parallelism knows how to split.

    Subclasses list the splits of their own layers (`_styles`, `_dims`); the plan of
    a module is those plus those of the distributed modules below it, less any marked off.
    """

    initializer_range: float = 0.02
    use_normal_initialization: bool = False

    def _styles(self) -> dict[str, StyleSpec]:
        """Own layer path (relative) -> style name (parallel/tensor/styles.py)."""
        return {}

    def _dims(self) -> dict[str, int]:
        """Named sizes the tensor-parallel degree must divide, so errors speak the module's arguments."""
        return {}

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        name = type(self).__name__
        plans = [TensorParallelPlan(self._styles(), dims=self._dims(), name=name)]
        plans += [prefixed(child.tensor_parallel_plan(), path) for path, child in carriers_below(self)]
        return merged(plans, name)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialise one of this module's own layers: normal(0, initializer_range) weights and zero biases
        with `use_normal_initialization`, else torch's default. Delayed initialisation calls it too."""
        if self.use_normal_initialization and isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, self.initializer_range)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    def _init_own_layers(self) -> None:
        if self.use_normal_initialization:
            for child in self.children():
                if not isinstance(child, DistributedModule):
                    self._init_weights(child)
