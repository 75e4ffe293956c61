"""DeepSpeed-style hostfiles: one `host slots=N` line per node.

A hostfile names every node of the job and how many processes each runs. `shardwise run`
does not ssh anywhere: the same command runs on every node (by hand, pdsh, SLURM, a
container scheduler…) and each copy finds its own node rank by looking up the local
hostname in the file. The first host is the rendezvous master unless `--master-addr`
says otherwise.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

from .errors import LaunchError

# As DeepSpeed reads it: what follows `slots=N` on the line (MPI's `max_slots=M`, ...) is ignored.
_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+)(?:\s+\S.*)?)?\s*$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[Host]:
    """Hosts in file order; `#` starts a comment, blank lines are skipped, a host listed twice is an error (as
    in DeepSpeed's `_parse_hostfile`)."""
    hosts: list[Host] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno}"
        match = _LINE.match(line)
        if not match or match["slots"] is None:
            raise LaunchError(f"{where}: {line!r} is not 'HOST slots=N'; fix: write one 'hostname slots=4' per line")
        try:
            slots = int(match["slots"])
        except ValueError:
            slots = 0
        if slots < 1:
            raise LaunchError(f"{where}: slots={match['slots']} must be a positive integer; fix: e.g. 'slots=4'")
        if match["host"] in seen:
            raise LaunchError(f"{where}: host {match['host']!r} is listed twice; fix: list each node once")
        seen.add(match["host"])
        hosts.append(Host(match["host"], slots))
    if not hosts:
        raise LaunchError(f"{source} lists no hosts; fix: add one 'hostname slots=N' line per node")
    return hosts


def read_hostfile(path: Union[str, Path]) -> list[Host]:
    file = Path(path)
    if not file.is_file():
        raise LaunchError(f"hostfile {str(file)!r} does not exist; fix: pass the path of a 'host slots=N' file")
    return parse_hostfile_text(file.read_text(encoding="utf-8"), source=f"hostfile {file}")


def local_names() -> set[str]:
    """Every name this machine may be listed under: hostname, its short form, FQDN, localhost."""
    names = {"localhost", "127.0.0.1"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.update({name, name.split(".")[0]})
    return names


def slots_per_node(hosts: list[Host], source: str = "hostfile") -> int:
    """Every node must run the same number of processes (the layout assumes a uniform cluster)."""
    counts = {h.slots for h in hosts}
    if len(counts) > 1:
        listed = ", ".join(f"{h.name}={h.slots}" for h in hosts)
        raise LaunchError(f"{source}: nodes have different slots ({listed}); "
                          f"fix: give every node the same slots=N")
    return counts.pop()


def node_rank_of(hosts: list[Host], names: Optional[Iterable[str]] = None, source: str = "hostfile") -> int:
    """Index of this machine in `hosts`, matched by any of its `names`."""
    names = set(local_names() if names is None else names)
    matches = [i for i, h in enumerate(hosts) if h.name in names or h.name.split(".")[0] in names]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise LaunchError(f"{source}: this machine ({socket.gethostname()}) is not listed; "
                          f"fix: run on a listed host, or pass --node-rank")
    listed = ", ".join(hosts[i].name for i in matches)
    raise LaunchError(f"{source}: this machine matches several hosts ({listed}); fix: pass --node-rank")
