"""One rank of bench/link.py, started by `shardwise run` in a namespace of bench/netns.py's cluster.

    link_worker.py --configs NAME [NAME ...] --out FILE [--width W --blocks B --batch N] [--steps S --warmup W]

Joins the gloo group the launcher describes, then for each configuration in
turn (link_setups.py): builds it, runs `warmup` untimed steps and one step that
records the collectives of every process group, then times `steps` steps
(barrier-aligned) while reading how many bytes left this node over the link
(the namespace's end of the veth pair, `GLOO_SOCKET_IFNAME`). Work a step
leaves in flight (MiCS's all-reduces under `cross_group_overlap: forward`) is
waited for around the counted step and after the timed ones, untimed. Rank 0 writes
every rank's numbers to `out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import link_setups
import torch.distributed as dist
from measure import collectives, group_ranks, step_times


def _link_tx_bytes() -> int:
    return int(Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes").read_text())


def measure(name: str, shape: link_setups.Shape, per_node: int, steps: int, warmup: int) -> dict:
    builders = {**link_setups.CONFIGURATIONS, **link_setups.DEEPSPEED}
    setup = builders[name](shape, per_node)
    try:
        for _ in range(warmup):
            setup.step()
        setup.settle()
        counted = collectives(lambda: (setup.step(), setup.settle()), group_ranks)
        dist.barrier()
        before = _link_tx_bytes()
        times = step_times(setup.step, steps)
        setup.settle()  # the last step's all-reduces still in flight (untimed), so `steps` whole steps are counted
        dist.barrier()
        sent = _link_tx_bytes() - before
    finally:
        setup.close()
    return {"times": times, "collectives": counted, "link_tx_bytes": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=link_setups.Shape().width)
    parser.add_argument("--blocks", type=int, default=link_setups.Shape().blocks)
    parser.add_argument("--batch", type=int, default=link_setups.Shape().batch)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    shape = link_setups.Shape(args.width, args.blocks, args.batch)
    mine = {name: measure(name, shape, per_node, args.steps, args.warmup) for name in args.configs}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"node": int(os.environ["GROUP_RANK"]), "results": mine})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"per_node": per_node, "ranks": everyone}))
    dist.barrier()
    # Skip the interpreter's teardown: after DeepSpeed, gloo's threads abort it ("terminate called without an
    # active exception"), and everything is written.
    os._exit(0)


if __name__ == "__main__":
    main()
