"""`delay_param_initialization`: build a model without allocating or initialising its parameters.

    with sw.delay_param_initialization():      # SMP's name; on when the config says so
        model = build_model()                  # parameters on the meta device: no memory, no init
    model = sw.DistributedModel(model)         # this rank's part materialised on its device

DistributedModel materialises whatever it is given on the meta device (so
`with torch.device("meta"):` works too); see parallel/materialize.py for how the
values are chosen and docs/pipeline.md for what each rank builds.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..runtime.state import current


@contextlib.contextmanager
def delay_param_initialization(enabled: Optional[bool] = None) -> Iterator[None]:
    """Create modules on the meta device inside the block; `enabled` defaults to the config's
    `delayed_parameter_initialization`, so the script stays the same and the config decides."""
    if enabled is None:
        enabled = current("shardwise.delay_param_initialization()").config.delayed_parameter_initialization
    if not enabled:
        yield
        return
    with torch.device("meta"):
        yield
