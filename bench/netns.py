"""A two-node cluster on one machine: two network namespaces joined by a veth pair shaped with `tc tbf`.

    python bench/netns.py up [--rate 400mbit] [--tag T]   # create it, the link shaped to the rate or not at all
    python bench/netns.py rate 800mbit|none [--tag T]     # reshape the link of the running cluster
    python bench/netns.py down [--tag T]                  # remove it

Each namespace is a node (`sw<tag>n0`, `sw<tag>n1`: clusters of other tags, such as
a smoke test's, stay apart): its own loopback and one end of the pair
(`ADDRESSES`, a /24), both ends' egress shaped by a token bucket (`tc tbf`;
this kernel has no `netem`), so each direction carries at most the rate. Ranks
on one node talk over its loopback; only traffic between the nodes crosses the
pair, and each end's `tx_bytes` counts what left that node. `launch` starts
`shardwise run --nnodes 2` node agents, one in each namespace, with gloo bound to
the node's end of the pair (`GLOO_SOCKET_IFNAME`); `on_nodes` any per-node command
so (bench/tune.py runs `shardwise tune` on both). Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Callable, Optional, Sequence

ADDRESSES = ("10.77.0.1", "10.77.0.2")
MASTER_PORT = 29577


class NotRootError(RuntimeError):
    pass


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError("the namespace cluster needs root (ip netns, tc): run it as root, e.g. with sudo")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def bytes_per_second(rate: str) -> float:
    """tc's rate (e.g. 400mbit) in bytes per second."""
    return float(rate.lower().removesuffix("bit").replace("k", "e3").replace("m", "e6").replace("g", "e9")) / 8


def _burst(rate: str) -> str:
    """The bucket: 4 ms at the rate, at least 64 kB (one GSO segment must fit, or tbf drops it)."""
    return f"{max(int(bytes_per_second(rate) * 0.004), 64 * 1024)}b"


class Cluster:
    """The two namespaces of `tag`."""

    def __init__(self, tag: str = "0"):
        self.nodes = (f"sw{tag}n0", f"sw{tag}n1")
        self.ifaces = (f"sw{tag}v0", f"sw{tag}v1")

    def shape(self, rate: Optional[str]) -> None:
        """Shape both ends' egress to `rate` (tc's syntax, e.g. 400mbit), or remove the shaping (None)."""
        for node, iface in zip(self.nodes, self.ifaces):
            _ip("netns", "exec", node, "tc", "qdisc", "del", "dev", iface, "root", check=False)
            if rate:
                _ip("netns", "exec", node, "tc", "qdisc", "add", "dev", iface, "root", "tbf", "rate", rate,
                    "burst", _burst(rate), "latency", "100ms")

    def up(self, rate: Optional[str]) -> None:
        """Create the cluster (removing an earlier one of this tag first)."""
        self.down()
        for node in self.nodes:
            _ip("netns", "add", node)
            _ip("-n", node, "link", "set", "lo", "up")
        _ip("link", "add", self.ifaces[0], "netns", self.nodes[0], "type", "veth",
            "peer", "name", self.ifaces[1], "netns", self.nodes[1])
        for node, iface, address in zip(self.nodes, self.ifaces, ADDRESSES):
            _ip("-n", node, "addr", "add", f"{address}/24", "dev", iface)
            _ip("-n", node, "link", "set", iface, "up")
        self.shape(rate)

    def down(self) -> None:
        """Remove the namespaces (and with them the pair); nothing to do when there are none."""
        require_root()
        for node in self.nodes:
            _ip("netns", "del", node, check=False)

    def on_nodes(self, command: Callable[[int], list[str]], timeout: float) -> list[str]:
        """Run `command(node)` in each node's namespace, gloo bound to its end of the pair; each node's output.
        Raise if either fails."""
        agents = []
        for rank, (node, iface) in enumerate(zip(self.nodes, self.ifaces)):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": iface}
            agents.append(subprocess.Popen(["ip", "netns", "exec", node, *command(rank)], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
        for rank, (agent, output) in enumerate(zip(agents, outputs)):
            if agent.returncode != 0:
                raise RuntimeError(f"node {rank} exited {agent.returncode}:\n{output[-3000:]}")
        return outputs

    def launch(self, script: Sequence[str], nproc_per_node: int, run_dir: str, timeout: float) -> None:
        """Run `shardwise run ... script` on both nodes (2 × `nproc_per_node` ranks); raise if either fails."""
        shardwise = shutil.which("shardwise") or sys.exit("bench/netns.py: the `shardwise` command is not installed")
        self.on_nodes(lambda rank: [shardwise, "run", *self.node_flags(rank), "--nproc-per-node", str(nproc_per_node),
                                    "--run-dir", run_dir, "--console-ranks", "none", *script], timeout)

    @staticmethod
    def node_flags(rank: int) -> list[str]:
        """Node `rank`'s place in a launch (or a tuning run) across the two nodes."""
        return ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", ADDRESSES[0], "--master-port",
                str(MASTER_PORT)]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="0", help="names this cluster's namespaces (several can coexist)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up").add_argument("--rate", help="tc rate of each direction, e.g. 400mbit (default: none)")
    commands.add_parser("rate").add_argument("rate", help="e.g. 800mbit, or none")
    commands.add_parser("down")
    args = parser.parse_args(argv)
    cluster = Cluster(args.tag)
    try:
        require_root()
        if args.command == "up":
            cluster.up(args.rate)
        elif args.command == "rate":
            cluster.shape(None if args.rate == "none" else args.rate)
        else:
            cluster.down()
    except NotRootError as err:
        print(f"bench/netns.py: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
