"""The cluster's shape: how many nodes, how many devices on each.

Read from flags, torchrun's environment or SLURM's; never from probing devices,
so a 512-GPU plan validates on a laptop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from ..errors import ConfigError, Problem


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
        """torchrun's WORLD_SIZE/LOCAL_WORLD_SIZE, else SLURM's SLURM_NTASKS/SLURM_NNODES, else one process."""
        env = os.environ if env is None else env
        # A launcher that names no nodes (WORLD_SIZE set by hand) ran one: the only shape the world alone gives.
        if "WORLD_SIZE" in env:
            world, local = _node_split({"LOCAL_WORLD_SIZE": env["WORLD_SIZE"], **env}, "WORLD_SIZE", "LOCAL_WORLD_SIZE")
            return cls(nodes=world // local, devices_per_node=local)
        if "SLURM_NTASKS" in env:
            world, nodes = _node_split({"SLURM_NNODES": "1", **env}, "SLURM_NTASKS", "SLURM_NNODES")
            return cls(nodes=nodes, devices_per_node=world // nodes)
        return cls()


def _count(env: Mapping[str, str], key: str) -> Union[int, Problem]:
    """env[key] as a count of processes or nodes, else the Problem, so that one error names every bad variable."""
    text = env[key]
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    return Problem(key, text, "must be a positive integer", f"set {key} to 1 or more, or unset it")


def _node_split(env: Mapping[str, str], world_key: str, part_key: str) -> tuple[int, int]:
    """The launcher's world and its part (processes per node, or nodes), which must divide it: a Cluster
    runs as many processes on every node, and guessing another shape would place groups on the wrong nodes."""
    world, part = _count(env, world_key), _count(env, part_key)
    problems = [value for value in (world, part) if isinstance(value, Problem)]
    if not problems and world % part:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        problems.append(Problem(part_key, part, f"must divide {world_key}={world} (shardwise needs the same number "
                                "of processes on every node)", "start the same number of processes on every node, "
                                f"so that {part_key} is one of {divisors}"))
    if problems:
        raise ConfigError(problems)
    return world, part
