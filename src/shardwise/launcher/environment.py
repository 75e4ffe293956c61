"""The cluster shape a scheduler already put in the environment: SLURM, or a Kubernetes PyTorchJob; and the
variable that says which accelerators a node's ranks see.

`shardwise run` with no shape flags takes this node's place from it, so the same
command runs under `srun` on every node or in every pod; a flag given still wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Mapping, Optional

from .errors import LaunchError


@dataclass(frozen=True)
class Environment:
    """Where the shape came from, and what it says (None: not said)."""

    name: str
    nnodes: Optional[int] = None
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    nproc_per_node: Optional[int] = None

    def describe(self) -> str:
        said = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)[1:]
                         if getattr(self, f.name) is not None)
        return f"{self.name} ({said})"


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list, `node[01-03,07],login1` → node01, node02, node03, node07, login1."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)", text):
        if not ranges:
            hosts += [prefix + suffix] if prefix + suffix else []
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            hosts += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(first), int(last or first) + 1)]
    return hosts


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    """An integer variable; SLURM's `4(x2)` counts and `gpu:4` GPU lists give their number, elastic `1:4` its
    upper bound."""
    text = env.get(name)
    if text is None or not text.strip():
        return None
    match = re.search(r"(\d+)(?:\(x\d+\))?\s*$", text.split(",")[0])
    if not match:
        raise LaunchError(f"{name}={text!r} is not a number; fix: unset it or pass the shape flags")
    return int(match.group(1))


def _slurm(env: Mapping[str, str]) -> Environment:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    per_node = next((n for n in (_int(env, "SLURM_GPUS_ON_NODE"), _int(env, "SLURM_GPUS_PER_NODE"),
                                 _int(env, "SLURM_NTASKS_PER_NODE")) if n), None)
    return Environment("SLURM", nnodes=_int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES"),
                       node_rank=_int(env, "SLURM_NODEID"),
                       master_addr=env.get("MASTER_ADDR") or (expand_nodelist(nodelist)[0] if nodelist else None),
                       master_port=_int(env, "MASTER_PORT"), nproc_per_node=per_node)


def _pytorchjob(env: Mapping[str, str]) -> Environment:
    """The training operator's variables: PET_* for torchrun, else MASTER_ADDR/PORT with WORLD_SIZE counting the
    pods (nodes) and RANK this pod."""
    def either(pet: str, plain: str) -> Optional[int]:
        return _int(env, pet) if pet in env else _int(env, plain)

    return Environment("Kubernetes PyTorchJob", nnodes=either("PET_NNODES", "WORLD_SIZE"),
                       node_rank=either("PET_NODE_RANK", "RANK"),
                       master_addr=env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR"),
                       master_port=either("PET_MASTER_PORT", "MASTER_PORT"),
                       nproc_per_node=_int(env, "PET_NPROC_PER_NODE"))


def detect(env: Mapping[str, str]) -> Optional[Environment]:
    """SLURM when a SLURM job's variables are set, a PyTorchJob when its PET_* or MASTER_ADDR with WORLD_SIZE
    are (outside a torchrun rank, which has LOCAL_RANK), else None."""
    if "SLURM_JOB_ID" in env and ("SLURM_NNODES" in env or "SLURM_JOB_NUM_NODES" in env):
        return _slurm(env)
    if any(name.startswith("PET_") for name in env) or (
            "MASTER_ADDR" in env and "WORLD_SIZE" in env and "LOCAL_RANK" not in env):
        return _pytorchjob(env)
    return None


# The variable each accelerator's runtime reads to hide devices, by torch's device type (DeepSpeed's accelerators
# set the same ones); ROCm's torch reports "cuda" and HIP honours CUDA_VISIBLE_DEVICES.
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK", "hpu": "HABANA_VISIBLE_MODULES",
                   "npu": "ASCEND_RT_VISIBLE_DEVICES", "mlu": "MLU_VISIBLE_DEVICES"}


def accelerator_type() -> Optional[str]:
    """torch's accelerator here ("cuda", "xpu", ...), or None on a node without one."""
    import torch

    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None


def visible_devices_env(slots: tuple[int, ...], env: Mapping[str, str], device_type: Optional[str]) -> dict[str, str]:
    """The variable that shows the ranks only devices `slots` of those the launcher sees: DeepSpeed's
    CUDA_VISIBLE_DEVICES per node, for whatever accelerator `device_type` (torch.accelerator's) is. Slots count
    within what is already visible (a scheduler's own CUDA_VISIBLE_DEVICES=4,5,6,7 and slot 1 give 5). Nothing
    where there is no accelerator (a CPU node has no devices to pick) or no such variable (MPS)."""
    name = VISIBLE_DEVICES.get(device_type or "")
    if name is None:
        return {}
    shown = [part.strip() for part in env.get(name, "").split(",") if part.strip()]
    if shown and max(slots) >= len(shown):
        raise LaunchError(f"slot {max(slots)} is not among the {len(shown)} devices {name}={env[name]} shows; "
                          f"fix: select slots below {len(shown)}")
    return {name: ",".join(shown[slot] if shown else str(slot) for slot in slots)}
