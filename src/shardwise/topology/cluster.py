"""The cluster's shape: how many nodes, how many devices on each.

Read from flags, torchrun's environment or SLURM's; never from probing devices,
so a 512-GPU plan validates on a laptop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from ..config.errors import ConfigError, Problem


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    devices_per_node: int = 1

    def __post_init__(self) -> None:
        problems = [
            Problem(name, value, "must be a positive integer", f"pass {flag} 1 or more")
            for name, value, flag in (
                ("nnodes", self.nodes, "--nnodes"),
                ("nproc_per_node", self.devices_per_node, "--nproc-per-node"),
            )
            if not isinstance(value, int) or value < 1
        ]
        if problems:
            raise ConfigError(problems)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Cluster":
        """torchrun's WORLD_SIZE/LOCAL_WORLD_SIZE, else SLURM's, else one process."""
        env = os.environ if env is None else env
        if "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_WORLD_SIZE", world))
            if local < 1 or world % local:
                local = world
            return cls(nodes=world // local, devices_per_node=local)
        if "SLURM_NTASKS" in env:
            world = int(env["SLURM_NTASKS"])
            nodes = int(env.get("SLURM_NNODES", 1))
            if nodes < 1 or world % nodes:
                nodes = 1
            return cls(nodes=nodes, devices_per_node=world // nodes)
        return cls()
