"""`DistributedModel`: the user's module with the configured parallelism applied, same names outside."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..config import ShardwiseConfig
from ..config.effects import changed
from ..parallel import precision
from ..parallel.clipping import clip_grad_norm_
from ..parallel.compose import parallelize
from ..parallel.pipeline import PipelineParallel
from ..parallel.tensor import PlanLike
from ..parallel.materialize import has_meta
from ..parallel.wrap import known_blocks
from ..runtime.init import warn_ineffective
from ..runtime.state import current
from .param_mapping import OriginalNames


def _ineffective_for(module: nn.Module, config: ShardwiseConfig) -> list[tuple[str, str]]:
    """Settings only the model makes ineffective: `init` cannot see them."""
    found = []
    if config.delayed_parameter_initialization and not has_meta(module):
        found.append(("delayed_parameter_initialization", "needs the model built inside sw.delay_param_initialization()"))
    if config.effective_zero_stage >= 2 and changed(config, "auto_wrap_min_params") and known_blocks(module):
        found.append(("auto_wrap_min_params", f"{type(module).__name__} is sharded by its own blocks"))
    return found


class DistributedModel(nn.Module):
    """Wraps `module` per the config given to `init`; `get_module()` returns the module as the user built it.

    `tensor_parallel_plan` splits a model that has no built-in plan (module-path
    pattern → style, see docs/tensor_parallel.md); it is used only when
    tensor_parallel_degree > 1.
    """

    def __init__(self, module: nn.Module, tensor_parallel_plan: PlanLike = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedModel expects a torch.nn.Module, got {type(module).__name__}")
        runtime = current("shardwise.DistributedModel")
        self._runtime = runtime
        # Before parallelizing replaces them: an optimizer built from `module` is mapped by these names.
        self.original_names = OriginalNames(module)
        warn_ineffective(_ineffective_for(module, runtime.config))
        self._parallel = parallelize(module, runtime.mesh, runtime.config, tensor_parallel_plan)
        self.module = self._parallel.module
        # FSDP2 modules cast by their own policy, ZeRO-1's half-precision replicas by hooks alike
        self._autocast = not (isinstance(self.module, FSDPModule) or runtime.config.sharded_master_weights)
        self.loss_scaler = precision.loss_scaler(runtime.config, runtime.device)
        # Set by a DistributedOptimizer that reduces gradients itself (ZeRO-1 in bf16/fp16): run after a
        # pipeline @step's schedule, once the gradients of weights tied across stages are summed.
        self.after_pipeline_step: Optional[Callable[[], None]] = None
        # Set by a DistributedOptimizer whose step leaves parameter broadcasts in flight (ZeRO-1): waits for
        # them. Forward waits module by module; reading or loading parameters here waits for all first.
        self.synchronize_parameters: Optional[Callable[[], None]] = None
        runtime.model = self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._autocast and precision.compute_dtype(self._runtime.config) is not None:
            with precision.autocast(self._runtime.config, self._runtime.device):
                return precision.in_fp32(self.module(*args, **kwargs))  # as FSDP2's and ZeRO-1's outputs
        return self.module(*args, **kwargs)

    def get_module(self) -> nn.Module:
        return self._parallel.inner

    @contextlib.contextmanager
    def microbatch_context(self, last: bool):
        with self._parallel.microbatch_context(last):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`, averaged over the microbatches of the current @step (and loss-scaled in fp16)."""
        self.scaled_loss(loss).backward()

    def scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` as backward takes it: divided by the @step's microbatches, loss-scaled in fp16."""
        if loss.dim() != 0:
            raise ValueError(f"model.backward expects a scalar loss, got shape {tuple(loss.shape)}; reduce it first "
                             "(e.g. loss.mean())")
        microbatch = self._runtime.microbatch
        if microbatch is not None:
            loss = loss / microbatch[1]
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        return loss

    def run_pipeline(self, fn: Any, pieces: list[tuple[tuple, dict]]) -> list[Any]:
        """Run a @step function's microbatches through the pipeline (pipeline_parallel_degree > 1)."""
        outputs = self._parallel.run_step(self, fn, pieces)
        if self.after_pipeline_step is not None and torch.is_grad_enabled():
            self.after_pipeline_step()
        return outputs

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every shard of every gradient; returns the norm before clipping."""
        if self._runtime.config.sharded_master_weights:
            raise RuntimeError("under ZeRO-1 in bf16/fp16 backward sends the gradients to fp32 master copies, "
                               "which optimizer.step() clips; set gradient_clipping in the config instead")
        if isinstance(self._parallel, PipelineParallel):  # counts the other stages' gradients too
            return self._parallel.clip_grad_norm_(max_norm)
        return clip_grad_norm_(self.parameters(), max_norm, self._runtime.device)

    def tied_copies(self) -> set[int]:
        """ids of the parameters that copy a weight tied across pipeline stages: a global norm skips them."""
        return self._parallel.ties.duplicates() if isinstance(self._parallel, PipelineParallel) else set()

    def tied_across_stages(self) -> set[int]:
        """ids of this rank's copies of weights tied across pipeline stages: their gradients are final only
        once the schedule has run and summed them."""
        return self._parallel.ties.held() if isinstance(self._parallel, PipelineParallel) else set()

    def wait_for_parameters(self) -> None:
        """Wait for parameter updates still in flight (ZeRO-1 overlaps them with the next forward)."""
        if self.synchronize_parameters is not None:
            self.synchronize_parameters()

    # Names as the user's module has them (no "module." prefix from the wrapper).
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        self.wait_for_parameters()
        return self.get_module().named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        self.wait_for_parameters()
        return self.get_module().parameters(recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's state dict (sharded tensors are DTensors; under pipeline parallelism only this rank's
        stages, still named as in the unsplit model); see `full_state_dict` for the whole model."""
        self.wait_for_parameters()
        return self.get_module().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        self.wait_for_parameters()
        return self.get_module().load_state_dict(state_dict, strict=strict, assign=assign)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as a whole tensor on every rank, named as in the user's module."""
        self.wait_for_parameters()
        state = get_model_state_dict(self.get_module(), options=StateDictOptions(full_state_dict=True))
        if isinstance(self._parallel, PipelineParallel):  # add the other stages' parts
            return self._parallel.gather_stages(state)
        return state
