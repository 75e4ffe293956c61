"""Command-line flags → one resolved `LaunchSpec` → torch's own `LaunchConfig`.

Everything that can be wrong with a launch (missing script, node rank out of range, a
hostfile that does not list this machine) is found here, before any process starts.
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..topology import Cluster
from .environment import accelerator_type, visible_devices_env
from .errors import LaunchError
from .hostfile import Host, local_names, node_rank_of, read_hostfile
from .resources import LOCALHOST, select

DEFAULT_MASTER_PORT = 29500
# Static rendezvous keys its store by run id; every node must use the same one.
MULTI_NODE_RUN_ID = "shardwise"


def default_nproc_per_node() -> int:
    """One process per accelerator of whatever kind torch sees here, else one CPU process."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return max(1, accelerator.device_count())
    return 1


def parse_console_ranks(text: Optional[str]) -> Optional[frozenset[int]]:
    """'0' / '0,3' / 'all' / 'none' → global ranks echoed to the console (None = all)."""
    if text is None:
        return frozenset({0})
    text = text.strip().lower()
    if text == "all":
        return None
    if text == "none":
        return frozenset()
    try:
        ranks = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise LaunchError(f"--console-ranks={text!r} is not a list of ranks; "
                          "fix: e.g. '0', '0,1', 'all' or 'none'") from None
    if any(r < 0 for r in ranks):
        raise LaunchError(f"--console-ranks={text!r} has a negative rank; fix: use ranks 0 or above")
    return ranks


@dataclass(frozen=True)
class LaunchSpec:
    """What this node launches: the script, the cluster shape, this node's place in it."""

    script: Path
    script_args: tuple[str, ...] = ()
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: int = DEFAULT_MASTER_PORT
    run_dir: Optional[Path] = None
    console_ranks: Optional[frozenset[int]] = field(default_factory=lambda: frozenset({0}))
    max_restarts: int = 0
    # DeepSpeed's launcher: the device indices this node's ranks see (None: as the launcher sees them), and
    # whether the script gets --local_rank=<local rank> before its own arguments
    visible_devices: Optional[tuple[int, ...]] = None
    local_rank_arg: bool = False
    device_env: dict[str, str] = field(default_factory=dict)  # the variable that shows the ranks those devices

    @property
    def cluster(self) -> Cluster:
        return Cluster(nodes=self.nnodes, devices_per_node=self.nproc_per_node)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def console_local_ranks(self) -> set[int]:
        """Local ranks of this node whose output is echoed (console ranks are global)."""
        local = range(self.nproc_per_node)
        if self.console_ranks is None:
            return set(local)
        return {lr for lr in local if self.global_rank(lr) in self.console_ranks}


def resolve(script: str, script_args: Sequence[str] = (), *, nproc_per_node: Optional[int] = None,
            nnodes: Optional[int] = None, node_rank: Optional[int] = None, master_addr: Optional[str] = None,
            master_port: Optional[int] = None, hostfile: Optional[str] = None, run_dir: Optional[str] = None,
            console_ranks: Optional[str] = None, max_restarts: int = 0,
            processes_per_host: Optional[int] = None, include: Optional[str] = None, exclude: Optional[str] = None,
            num_nodes: Optional[int] = None, num_gpus: Optional[int] = None,
            local_rank_arg: bool = False) -> LaunchSpec:
    """Fill defaults (hostfile, the config's `processes_per_host` as SageMaker's MPI launcher took it, the
    accelerator count) and check the flags agree; raise LaunchError. `include`, `exclude`, `num_nodes` and
    `num_gpus` are DeepSpeed's launcher flags (resources.py); `local_rank_arg` passes `--local_rank` as it does."""
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"script {script!r} does not exist; fix: pass the path of the Python training script")
    for ours, given, theirs, alias in (("--nproc-per-node", nproc_per_node, "--num_gpus", num_gpus),
                                       ("--nnodes", nnodes, "--num_nodes", num_nodes)):
        if given is not None and alias is not None and given != alias:
            raise LaunchError(f"{ours}={given} and {theirs}={alias} disagree; fix: give one of them")
    visible = None
    if hostfile is not None or include or exclude:
        selected, source, listed = _selection(hostfile, include, exclude, num_nodes, num_gpus)
        nnodes, nproc_per_node, node_rank, master_addr, visible = _place(
            selected, source, listed, nnodes, nproc_per_node, node_rank, master_addr,
            filtered=bool(include or exclude or num_gpus))
    else:
        nnodes = num_nodes if nnodes is None else nnodes
        nproc_per_node = num_gpus if nproc_per_node is None else nproc_per_node
    device = accelerator_type() if visible is not None else None
    visible = visible if device is not None else None  # a node without accelerators has no devices to pick
    nnodes = 1 if nnodes is None else nnodes
    if nproc_per_node is None:
        nproc_per_node = default_nproc_per_node() if processes_per_host is None else processes_per_host
    node_rank = 0 if node_rank is None else node_rank
    Cluster(nodes=nnodes, devices_per_node=nproc_per_node)  # ConfigError on non-positive sizes
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank={node_rank} must be in 0..{nnodes - 1} for --nnodes={nnodes}; "
                          f"fix: number the nodes 0 to {nnodes - 1}")
    if nnodes > 1 and not master_addr:
        raise LaunchError(f"--nnodes={nnodes} needs the rendezvous host; fix: pass --master-addr "
                          f"(the address of node 0) or --hostfile")
    port = DEFAULT_MASTER_PORT if master_port is None else master_port
    if not 0 < port < 65536:
        raise LaunchError(f"--master-port={port} is not a TCP port; fix: use 1024..65535")
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts={max_restarts} must be 0 or more")
    return LaunchSpec(script=path, script_args=tuple(script_args), nnodes=nnodes, nproc_per_node=nproc_per_node,
                      node_rank=node_rank, master_addr=master_addr, master_port=port,
                      run_dir=Path(run_dir) if run_dir else None, console_ranks=parse_console_ranks(console_ranks),
                      max_restarts=max_restarts, visible_devices=visible, local_rank_arg=local_rank_arg,
                      device_env={} if visible is None else visible_devices_env(visible, os.environ, device))


def _selection(hostfile: Optional[str], include: Optional[str], exclude: Optional[str], num_nodes: Optional[int],
               num_gpus: Optional[int]) -> tuple[dict[str, Optional[list[int]]], str, list[str]]:
    """The hosts and slots DeepSpeed's flags select, where from, and every host listed there: the hostfile's,
    else this node alone."""
    if hostfile is not None:
        source = f"hostfile {hostfile}"
        pool = {host.name: list(range(host.slots)) for host in read_hostfile(hostfile)}
        return select(pool, include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus,
                      source=source), source, list(pool)
    if num_nodes is not None and num_nodes > 1:
        raise LaunchError(f"--num_nodes={num_nodes} with --include/--exclude needs the hosts; fix: pass --hostfile")
    source = "this node alone (no --hostfile)"
    fix = "pass --hostfile listing the hosts, or select this node as 'localhost'"
    selected = select({LOCALHOST: local_slots()}, include=include, exclude=exclude, num_gpus=num_gpus, source=source,
                      unknown_fix=fix)
    return selected, source, [LOCALHOST]


def _place(selected: dict[str, Optional[list[int]]], source: str, listed: list[str], nnodes: Optional[int],
           nproc_per_node: Optional[int], node_rank: Optional[int], master_addr: Optional[str],
           filtered: bool) -> tuple:
    """The shape the selection gives, checked against the shape flags; this node's rank in it (given, else found
    by hostname among the selected hosts) and, where the flags picked slots, the device indices its ranks see."""
    counts = {host: None if slots is None else len(slots) for host, slots in selected.items()}
    if len(set(counts.values())) > 1:
        shape = ", ".join(f"{host}={n}" for host, n in counts.items())
        raise LaunchError(f"{source}: the selected nodes have different numbers of slots ({shape}), and shardwise "
                          "runs as many processes on every node; fix: give every node the same slots=N, or select "
                          "as many slots on each")
    derived = next(iter(counts.values()))
    for flag, given, value in (("--nnodes", nnodes, len(selected)), ("--nproc-per-node", nproc_per_node, derived)):
        if given is not None and value is not None and given != value:
            raise LaunchError(f"{flag}={given} disagrees with {source} ({value}); fix: drop {flag} or edit the "
                              "hostfile or the selection")
    nnodes, nproc_per_node = len(selected), derived if derived is not None else nproc_per_node
    hosts = list(selected)
    if node_rank is None and len(listed) > 1:
        node_rank = _this_node(hosts, listed, source)
    if master_addr is None and nnodes > 1:
        master_addr = hosts[0]
    mine = selected[hosts[node_rank or 0]] if (node_rank or 0) < nnodes else None
    visible = tuple(mine) if filtered and mine is not None else None
    return nnodes, nproc_per_node, node_rank, master_addr, visible


def _this_node(selected: list[str], listed: list[str], source: str) -> int:
    """This machine's index among the selected hosts; one listed in the hostfile but not selected is told so."""
    names = local_names()
    if not any(h in names or h.split(".")[0] in names for h in selected):
        unselected = [h for h in listed if h in names or h.split(".")[0] in names]
        if unselected:
            raise LaunchError(f"{source}: the selection leaves this node ({unselected[0]}) no slots; fix: run on the "
                              f"selected hosts only ({', '.join(selected)}), or select this one")
    return node_rank_of([Host(h, 1) for h in selected], source=source)


def local_slots() -> Optional[list[int]]:
    """This node's slots without a hostfile: one per accelerator torch sees, or None where it sees none (its
    slots only count processes)."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return list(range(accelerator.device_count()))
    return None


def rendezvous(spec: LaunchSpec) -> dict:
    """torchrun's choices: one node → c10d on a free localhost port (like `--standalone`);
    several → static rendezvous at master addr:port, which honours `--node-rank` (the c10d
    backend would number nodes by arrival and break the node → rank map the layout assumes)."""
    if spec.nnodes == 1:
        return {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "run_id": uuid.uuid4().hex,
                "rdzv_configs": {}}
    return {"rdzv_backend": "static", "rdzv_endpoint": f"{spec.master_addr}:{spec.master_port}",
            "run_id": MULTI_NODE_RUN_ID, "rdzv_configs": {"rank": spec.node_rank}}


class _EmptyPrefix(str):
    """An empty line-prefix template that torch still treats as given (it tests truthiness and
    otherwise prefixes '[rank0]:'). With one echoed rank per node, its lines need no prefix —
    and torch already prefixes tracebacks with '[rankN]:' itself."""

    def __bool__(self) -> bool:
        return True


def line_prefix_template(spec: LaunchSpec) -> str:
    """No prefix when one rank per node is echoed, else each line carries its global rank."""
    return _EmptyPrefix("") if len(spec.console_local_ranks()) <= 1 else "[rank${rank}]: "


def launch_config(spec: LaunchSpec, logs_specs, stop_seconds: int = 30) -> "LaunchConfig":  # noqa: F821
    """The torchrun `LaunchConfig` for `spec`; per-rank log files come from `logs_specs`; the agent waits
    `stop_seconds` for the ranks it stops (SIGTERM) to exit before it kills them."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        logs_specs=logs_specs,
        role="rank",
        max_restarts=spec.max_restarts,
        log_line_prefix_template=line_prefix_template(spec),
        shutdown_timeout=stop_seconds,
        **rendezvous(spec),
    )


def entrypoint(spec: LaunchSpec) -> tuple[str, list[str]]:
    """The worker command, as torchrun builds it: unbuffered so log files and the console stay live. With
    `local_rank_arg`, `--local_rank=<local rank>` right after the script, as DeepSpeed's launcher passes it
    (torch's agent fills in `${local_rank}` for each rank)."""
    from torch.distributed.elastic.utils import macros

    local_rank = [f"--local_rank={macros.local_rank}"] if spec.local_rank_arg else []
    return os.getenv("PYTHON_EXEC", sys.executable), ["-u", str(spec.script), *local_rank, *spec.script_args]
