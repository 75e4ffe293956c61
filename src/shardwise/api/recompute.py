"""`set_activation_checkpointing` and the front ends' checkpoint calls, with this runtime's activation offloading.

Recompute itself is `parallel/recompute/`; here the runtime's one offload schedule
(made at first use, shared by every model's regions) is handed to it explicitly.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from ..parallel.compose import OffloadSchedule, activation_offload, apply_activation_checkpointing, checkpointed
from ..runtime.state import Runtime, current, is_initialized


def runtime_offload(runtime: Runtime) -> Optional[OffloadSchedule]:
    """Where checkpointed regions keep their inputs under this runtime (None without offload_activations)."""
    if runtime.activation_offload is None:
        runtime.activation_offload = activation_offload(runtime.config, runtime.device)
    return runtime.activation_offload


def current_offload() -> Optional[OffloadSchedule]:
    """The running runtime's schedule; None before `init` (a region then keeps its inputs where they are)."""
    return runtime_offload(current()) if is_initialized() else None


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False,
                                 strategy: str = "each", policy: Any = None) -> nn.Module:
    """SMP v1's `set_activation_checkpointing` (see parallel/recompute/apply.py), plus `policy` ("matmul" keeps
    matrix products and attention outputs); with offload_activations the regions' kept inputs go to host memory."""
    return apply_activation_checkpointing(module, preserve_rng_state, pack_args_as_tuple, strategy, policy,
                                          offload=current_offload())


def checkpointed_call(fn: Callable[..., Any], /, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` as one recomputed region (the front ends' `checkpoint` functions), offloaded likewise."""
    return checkpointed(fn, *args, preserve_rng_state=preserve_rng_state, offload=current_offload(), **kwargs)
