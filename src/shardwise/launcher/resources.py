"""DeepSpeed's launcher resource selection, as `deepspeed/launcher/runner.py` does it.

`--include` / `--exclude` take `NODE_SPEC[@NODE_SPEC ...]` with `NODE_SPEC = NAME[:SLOT[,SLOT ...]]`
(a bare NAME is the whole host), over the hosts of the hostfile in file order (`parse_resource_filter`);
`--num_nodes N` keeps the first N hosts and `--num_gpus G` slots 0..G-1 of each
(`apply_num_nodes_and_gpus`); the two pairs exclude each other. A slot is a device index on its host.
Without a hostfile the only host is this node, `localhost`, with one slot per accelerator torch
sees; a node without accelerators has no devices to pick, so its slots only count processes.
Every refusal is one line naming the fix (a LaunchError), where DeepSpeed raises a ValueError.
"""

from __future__ import annotations

from typing import Mapping, Optional

from .errors import LaunchError

# DeepSpeed's launcher flags that shardwise's own do not spell: a command line using one is a DeepSpeed command
# line, whose script expects --local_rank.
DEEPSPEED_ONLY = ("num_gpus", "num_nodes", "include", "exclude", "no_ssh")
LOCALHOST = "localhost"
# host -> its slots (device indices), or None for a node without accelerators, whose slots only count processes
Pool = Mapping[str, Optional[list[int]]]


def parse_filter(text: str, flag: str) -> dict[str, list[int]]:
    """`NAME[:SLOT[,SLOT ...]]` specs joined by `@` → {host: its slots, sorted, [] for the whole host}."""
    nodes: dict[str, list[int]] = {}
    for spec in text.split("@"):
        host, colon, slots = spec.strip().partition(":")
        try:
            numbers = [int(slot) for slot in slots.split(",")] if colon else []
        except ValueError:
            numbers = [-1]
        if not host or any(n < 0 for n in numbers):
            raise LaunchError(f"{flag}={text!r}: {spec!r} is not NAME[:SLOT[,SLOT ...]]; fix: e.g. {flag} "
                              "'worker-0@worker-1:0,2' (all of worker-0, slots 0 and 2 of worker-1)")
        nodes.setdefault(host, []).extend(numbers)
    return {host: sorted(set(slots)) for host, slots in nodes.items()}


def _check_exclusive(include: Optional[str], exclude: Optional[str], num_nodes: Optional[int],
                     num_gpus: Optional[int]) -> None:
    if include and exclude:
        raise LaunchError("--include and --exclude cannot both be given (DeepSpeed refuses them together too); "
                          "fix: give one of them")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise LaunchError(f"--num_nodes/--num_gpus cannot be combined with {'--include' if include else '--exclude'} "
                          "(as in DeepSpeed); fix: name the hosts and slots in the filter alone, or drop it")


def _filtered(pool: Pool, flag: str, text: str, source: str, unknown_fix: str) -> dict[str, Optional[list[int]]]:
    """`parse_resource_filter`: `--include` builds the selection from the named hosts and slots, `--exclude` takes
    them away from the whole pool."""
    include = flag == "--include"
    chosen: dict[str, Optional[list[int]]] = {} if include else {host: slots for host, slots in pool.items()}
    for host, slots in parse_filter(text, flag).items():
        if host not in pool:
            raise LaunchError(f"{flag}={text!r} names host {host!r}, which {source} does not list; fix: "
                              + (unknown_fix or "use one of " + ", ".join(pool)))
        known = pool[host]
        missing = [slot for slot in slots if known is not None and slot not in known]
        if missing:
            raise LaunchError(f"{flag}={text!r}: host {host!r} has no slot {missing[0]} ({source} gives it "
                              f"{len(known)}: 0..{len(known) - 1}); fix: name slots below {len(known)}")
        if known is None and slots and not include:
            raise LaunchError(f"{flag}={text!r}: {host!r} has no accelerators, so no devices to exclude; fix: pass "
                              "--nproc-per-node with the number of processes instead")
        if include:
            chosen[host] = slots or known
        else:
            chosen[host] = [slot for slot in chosen[host] if slot not in slots] if slots else []
    # Hosts left without slots drop out; the rest keep the pool's order, which numbers the nodes.
    return {host: chosen[host] for host in pool if host in chosen and chosen[host] != []}


def select(pool: Pool, *, include: Optional[str] = None, exclude: Optional[str] = None,
           num_nodes: Optional[int] = None, num_gpus: Optional[int] = None, source: str = "the hostfile",
           unknown_fix: str = "") -> dict[str, Optional[list[int]]]:
    """The hosts and slots the flags select from `pool`, in the pool's order (which numbers the nodes);
    `unknown_fix` is the fix for a host the pool lacks (default: name the pool's hosts)."""
    _check_exclusive(include, exclude, num_nodes, num_gpus)
    chosen: dict[str, Optional[list[int]]] = dict(pool)
    if include or exclude:
        flag, text = ("--include", include) if include else ("--exclude", exclude)
        chosen = _filtered(pool, flag, text, source, unknown_fix)
        if not chosen:
            raise LaunchError(f"{flag}={text!r} leaves no host with a slot; fix: select at least one slot")
    if num_nodes is not None:
        if num_nodes > len(chosen):
            raise LaunchError(f"--num_nodes={num_nodes} but {source} lists {len(chosen)} host(s); fix: use at most "
                              f"{len(chosen)}, or add hosts to the hostfile")
        chosen = dict(list(chosen.items())[:num_nodes])
    if num_gpus is not None:
        for host, slots in chosen.items():
            if slots is not None and num_gpus > len(slots):
                raise LaunchError(f"--num_gpus={num_gpus} exceeds the {len(slots)} slots {source} gives {host!r}; "
                                  f"fix: use at most {len(slots)}")
        chosen = {host: list(range(num_gpus)) for host in chosen}
    return chosen
