"""The one live runtime of this process: what `init` resolved, shared by the API objects.

The seed API (`sw.DistributedModel(module)`) takes no mesh, so the API layer
reads it here; everything under `parallel/` still receives the mesh explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from weakref import WeakSet

import torch

from ..config.schema import ShardwiseConfig
from ..topology import Cluster, Layout
from ..parallel.mesh import ParallelMesh


@dataclass
class Runtime:
    config: ShardwiseConfig
    cluster: Cluster
    layout: Layout
    mesh: ParallelMesh
    device: torch.device
    rank: int
    local_rank: int
    owns_process_group: bool
    # Every live DistributedModel, so that shutdown waits for their parameter updates in flight and an
    # optimizer finds the model that owns its parameters. Calls never pick a model from here.
    models: WeakSet = field(default_factory=WeakSet)
    # Where checkpointed regions keep their inputs with offload_activations (parallel/recompute/offload.py), made
    # with the first DistributedModel; None without offloading.
    activation_offload: Optional[object] = field(default=None)
    # Every `sw.data_loader` in creation order (weak references), so checkpoints save their positions, and the
    # positions the last `resume_from_checkpoint` read, for the loaders created after it (same order).
    loaders: list = field(default_factory=list)
    resumed_loader_states: list = field(default_factory=list)
    # Every live DistributedOptimizer, so that a checkpoint finds the one of its model.
    optimizers: WeakSet = field(default_factory=WeakSet)
    # Checkpoints coordinate over a group of their own (a background save must not share collectives with
    # training), made by the first checkpoint call; an asynchronous save still being written.
    checkpoint_group: Optional[object] = field(default=None)
    pending_save: Optional[object] = field(default=None)


    def loader_states(self) -> list[Optional[dict]]:
        """Every `data_loader`'s position in creation order; None for a loader garbage collected since."""
        loaders = [ref() for ref in self.loaders]
        return [loader.state_dict() if loader is not None else None for loader in loaders]

    def restore_loader_states(self, states: list) -> None:
        """Continue saved positions: in the loaders already created, and (kept here) in those created later,
        matched by creation order. None entries are skipped."""
        self.resumed_loader_states = list(states)
        for ref, state in zip(self.loaders, states):
            loader = ref()
            if loader is not None and state is not None:
                loader.load_state_dict(state)

    def wait_for_pending_save(self) -> None:
        """Let an asynchronous checkpoint save finish (raising its error, if it failed) before anything else
        touches its files or the process group goes."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.result()


_current: Optional[Runtime] = None


class NotInitializedError(RuntimeError):
    def __init__(self, what: str):
        super().__init__(f"{what} needs shardwise.init() first; call sw.init(config) at the top of the script")


def current(what: str = "this call") -> Runtime:
    if _current is None:
        raise NotInitializedError(what)
    return _current


def set_current(runtime: Optional[Runtime]) -> None:
    global _current
    _current = runtime


def is_initialized() -> bool:
    return _current is not None
