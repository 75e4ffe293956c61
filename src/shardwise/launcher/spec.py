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
from .errors import LaunchError
from .hostfile import node_rank_of, read_hostfile, slots_per_node

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
            processes_per_host: Optional[int] = None) -> LaunchSpec:
    """Fill defaults (hostfile, the config's `processes_per_host` as SageMaker's MPI launcher took it, the
    accelerator count) and check the flags agree; raise LaunchError."""
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"script {script!r} does not exist; fix: pass the path of the Python training script")
    if hostfile is not None:
        hosts = read_hostfile(hostfile)
        source = f"hostfile {hostfile}"
        slots = slots_per_node(hosts, source)
        for flag, given, derived in (("--nnodes", nnodes, len(hosts)), ("--nproc-per-node", nproc_per_node, slots)):
            if given is not None and given != derived:
                raise LaunchError(f"{flag}={given} disagrees with {source} ({derived}); "
                                  f"fix: drop {flag} or edit the hostfile")
        nnodes, nproc_per_node = len(hosts), slots
        if node_rank is None and nnodes > 1:
            node_rank = node_rank_of(hosts, source=source)
        if master_addr is None and nnodes > 1:
            master_addr = hosts[0].name
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
                      max_restarts=max_restarts)


def rendezvous(spec: LaunchSpec) -> dict:
    """torchrun's choices: one node → c10d on a free localhost port (like `--standalone`);
    several → static rendezvous at master addr:port, which honours `--node-rank` (the c10d
    backend would number nodes by arrival and break the node → rank map the layout assumes)."""
    if spec.nnodes == 1:
        return {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "run_id": uuid.uuid4().hex,
                "rdzv_configs": {}}
    return {"rdzv_backend": "static", "rdzv_endpoint": f"{spec.master_addr}:{spec.master_port}",
            "run_id": MULTI_NODE_RUN_ID, "rdzv_configs": {"rank": spec.node_rank}}


def rendezvous_env(spec: LaunchSpec) -> dict[str, str]:
    """What torch's agent reads from the environment to rendezvous afresh on every attempt. By default the
    ranks' process groups share the rendezvous store, which outlives an attempt: after a restart, gloo reads the
    addresses the dead attempt's ranks posted there and fails to connect. With sharing off, the first rank hosts
    a new store on a free port every attempt (c10d rendezvous only: the static one of several nodes always
    shares, and `runtime.init` puts each attempt's process group under a prefix of its own there)."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if spec.nnodes == 1 else {}


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
    """The worker command, as torchrun builds it: unbuffered so log files and the console stay live."""
    return os.getenv("PYTHON_EXEC", sys.executable), ["-u", str(spec.script), *spec.script_args]
