"""`model_creation`: SMP's one context for building a model — tensor parallelism, delayed init, dtype."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from ...api.delayed_init import delay_param_initialization
from ...parallel.tensor.marks import tensor_parallelism as tensor_parallelism_context


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: Optional[torch.dtype] = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """Build the model inside: marked for tensor parallelism (`tensor_parallelism`, with
    `tensor_parallel_config` as `sw.tensor_parallelism`'s keyword arguments, e.g.
    `distribute_embedding=True`), on the meta device when the config's
    `delayed_parameter_initialization` says so, and with floating parameters made in
    `dtype` (torch's default dtype inside, restored after; None keeps the default)."""
    previous = torch.get_default_dtype()
    options = tensor_parallel_config if tensor_parallelism else {}
    with tensor_parallelism_context(tensor_parallelism, **options), delay_param_initialization():
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)
