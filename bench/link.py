"""Data parallelism across a slow inter-node link: shardwise DDP, ZeRO-3 and MiCS against torch and DeepSpeed.

    python bench/link.py [--rates 200mbit 400mbit 800mbit none] [--rounds 2] [--steps 5] [--per-node 2]
                         [--no-deepspeed] [--json FILE] [--plot FILE.png] [--smoke]

Builds bench/netns.py's two-node cluster (needs root) and, at each link rate,
runs every configuration of link_setups.py on 2 × `per-node` gloo ranks through
`shardwise run` node agents, one launch for all but DeepSpeed's (which keeps
its process groups in globals and gets a launch of its own each); rounds
alternate the order of rates and of configurations. Per configuration and rate:
the median step time (slowest rank per step) of each round, the bytes each
process group's collectives move per step (full buffers), the bytes that left
each node over the link per step (`tx_bytes`) against the volume gloo's ring
algorithms put there (`link_bytes`), and the ratio of the step time to its
bound, max(compute, that volume ÷ link rate), where compute is the step time of
every rank training alone ("compute only"). `--smoke`: a 2-block 64-wide MLP,
one step, one round, the unshaped link, no DeepSpeed: structure and bytes only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import link_setups
import netns

BENCH = Path(__file__).resolve().parent
# Bytes each rank sends its successor in gloo's ring, per byte of the full buffer, for a group of n:
# all-gather passes n − 1 chunks; all-reduce reduce-scatters then all-gathers (2(n − 1) chunks); gloo's
# reduce-scatter of a flat buffer all-reduces it whole and keeps its chunk, so it moves an all-reduce's bytes.
RING_FACTORS = {"all-gather": lambda n: (n - 1) / n, "all-reduce": lambda n: 2 * (n - 1) / n,
                "reduce-scatter": lambda n: 2 * (n - 1) / n}
COMPUTE = "compute only (nothing sent)"
MICS = ("shardwise MiCS", "shardwise MiCS bf16 cross-group", "shardwise MiCS overlapping forward",
        "shardwise MiCS bf16 overlapping forward")


def link_bytes(collectives: dict[str, list[int]], per_node: int) -> tuple[float, list[str]]:
    """Bytes per step from node 0 to node 1 (the same the other way) that the ring of each group sends over
    the link: a ring edge from a node-0 rank to a node-1 rank carries its sender's bytes. Also the collectives
    crossing the link that have no ring model here."""
    total, unmodelled = 0.0, []
    for key, (_, nbytes) in collectives.items():
        op, ranks = key.split("/")
        ring = [int(rank) for rank in ranks.split(",")]
        crossing = sum(a // per_node == 0 and b // per_node == 1 for a, b in zip(ring, ring[1:] + ring[:1]))
        if crossing and op in RING_FACTORS:
            total += RING_FACTORS[op](len(ring)) * nbytes * crossing
        elif crossing:
            unmodelled.append(key)
    return total, unmodelled


def _groups(ranks: list[dict], name: str) -> dict[str, list[int]]:
    """Every process group's collectives of one step, from the ranks that ran them (each group once)."""
    merged: dict[str, list[int]] = {}
    for rank in ranks:
        merged.update(rank["results"][name]["collectives"])
    return merged


def _launch(cluster: netns.Cluster, names: list[str], args, out: Path) -> dict:
    command = [str(BENCH / "link_worker.py"), "--configs", *names, "--out", str(out), "--width", str(args.width),
               "--blocks", str(args.blocks), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    cluster.launch(command, args.per_node, str(out.parent / "run"), timeout=1800)
    return json.loads(out.read_text())


def run(cluster: netns.Cluster, args) -> dict[str, dict[str, list[dict]]]:
    """{rate: {configuration: [one entry per round: step times, per-group collectives, link bytes per node]}}."""
    names = list(link_setups.CONFIGURATIONS)
    launches = [names] + ([[name] for name in link_setups.DEEPSPEED] if args.deepspeed else [])
    results: dict[str, dict[str, list[dict]]] = {rate: {} for rate in args.rates}
    with tempfile.TemporaryDirectory(prefix="shardwise-link-") as scratch:
        for round_ in range(args.rounds):
            for rate in args.rates if round_ % 2 == 0 else reversed(args.rates):
                cluster.shape(None if rate == "none" else rate)
                for index, chosen in enumerate(launches):
                    order = chosen if round_ % 2 == 0 else chosen[::-1]
                    report = _launch(cluster, order, args, Path(scratch) / f"r{round_}-{rate}-{index}.json")
                    for name in chosen:
                        ranks = report["ranks"]
                        steps = [max(step) for step in zip(*(r["results"][name]["times"] for r in ranks))]
                        per_node = {r["node"]: r["results"][name]["link_tx_bytes"] / args.steps for r in ranks}
                        results[rate].setdefault(name, []).append(
                            {"median_s": statistics.median(steps), "times": steps,
                             "collectives": _groups(ranks, name), "link_bytes_per_node": per_node})
                    print(f"round {round_ + 1}, link {rate}: {', '.join(chosen)} done", flush=True)
    return results


def _rate_bytes_per_s(rate: str) -> float:
    if rate == "none":
        return float("inf")
    return float(rate.removesuffix("bit").replace("k", "e3").replace("m", "e6").replace("g", "e9")) / 8


def summarise(results: dict[str, dict[str, list[dict]]], per_node: int) -> dict[str, dict[str, dict]]:
    """Per rate and configuration: step times, bytes per group and over the link, the bound and the ratios."""
    rows: dict[str, dict[str, dict]] = {}
    for rate, by_name in results.items():
        compute = statistics.median(r["median_s"] for r in by_name[COMPUTE])
        rows[rate] = {}
        for name, rounds in by_name.items():
            groups = rounds[0]["collectives"]
            theory, unmodelled = link_bytes(groups, per_node)
            measured = statistics.mean(b for r in rounds for b in r["link_bytes_per_node"].values())
            median = statistics.median(r["median_s"] for r in rounds)
            bound = max(compute, theory / _rate_bytes_per_s(rate))
            rows[rate][name] = {"rounds_s": [r["median_s"] for r in rounds], "median_s": median,
                                "group_bytes": {key: nbytes for key, (_, nbytes) in groups.items()},
                                "link_bytes": measured, "link_bytes_theory": theory,
                                "unmodelled": unmodelled, "bound_s": bound, "vs_bound": median / bound}
        for name in MICS:
            for peer in ("torch FSDP2 HSDP", "torch DDP"):
                if name in rows[rate] and peer in rows[rate]:
                    rows[rate][name][f"vs {peer}"] = rows[rate][name]["median_s"] / rows[rate][peer]["median_s"]
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}"


def print_tables(rows: dict[str, dict[str, dict]], header: str) -> None:
    print(header + "\n")
    print("| link | configuration | step ms (rounds) | median ms | × bound (ms) | MB per node per step over the "
          "link (ring volume) | MB per process group per step |")
    print("|---|---|---|---:|---:|---:|---|")
    for rate, by_name in rows.items():
        for name, r in by_name.items():
            groups = "; ".join(f"{key} {_mb(nbytes)}" for key, nbytes in sorted(r["group_bytes"].items()))
            print(f"| {rate} | {name} | {', '.join(f'{s * 1e3:.0f}' for s in r['rounds_s'])} | "
                  f"{r['median_s'] * 1e3:.0f} | {r['vs_bound']:.2f} ({r['bound_s'] * 1e3:.0f}) | "
                  f"{_mb(r['link_bytes'])} ({_mb(r['link_bytes_theory'])}) | {groups or '–'} |")
    for rate, by_name in rows.items():
        for name in MICS:
            ratios = {k: v for k, v in by_name.get(name, {}).items() if k.startswith("vs torch")}
            if ratios:
                print(f"{rate}, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


def plot(rows: dict[str, dict[str, dict]], path: str) -> None:
    """Step time against link rate, one line per configuration (the unshaped link at the right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(rows)
    order = sorted(range(len(rates)), key=lambda i: _rate_bytes_per_s(rates[i]))
    labels = [rates[i].replace("mbit", " Mbit/s").replace("none", "unshaped") for i in order]
    figure, axes = plt.subplots(figsize=(11, 5))
    axes.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # a colour per configuration
    for name in rows[rates[0]]:
        axes.plot(labels, [rows[rates[i]][name]["median_s"] * 1e3 for i in order], marker="o", label=name,
                  linestyle="--" if not name.startswith("shardwise") else "-")
    axes.set_xlabel("link between the two nodes (each direction)")
    axes.set_ylabel("step time, ms (median)")
    axes.set_yscale("log")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines, not over them
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _header(args) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    versions = f"torch {metadata.version('torch')}"
    if args.deepspeed:
        versions += f", deepspeed {metadata.version('deepspeed')}"
    shape = link_setups.Shape(args.width, args.blocks, args.batch)
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu}, {os.cpu_count()} cores, "
            f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the start; {versions}; "
            f"2 nodes × {args.per_node} gloo ranks (network namespaces, veth shaped by tc tbf); MLP of "
            f"{shape.blocks} blocks + head, width {shape.width}, {shape.parameters / 1e6:.2f}M parameters, fp32, "
            f"Adam, batch {shape.batch} per rank; {args.rounds} rounds of {args.steps} timed steps after "
            f"{args.warmup} untimed ones and one counted")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["200mbit", "400mbit", "800mbit", "none"],
                        help="tc rates of the link, each direction; none: unshaped")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration, rate and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2, help="ranks per node")
    parser.add_argument("--width", type=int, default=link_setups.Shape().width)
    parser.add_argument("--blocks", type=int, default=link_setups.Shape().blocks)
    parser.add_argument("--batch", type=int, default=link_setups.Shape().batch)
    parser.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", help="also write every number to this file")
    parser.add_argument("--plot", help="step time against link rate, as a PNG")
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny model, one step, unshaped, no DeepSpeed")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rates, args.rounds, args.steps, args.warmup = ["none"], 1, 1, 1
        args.width, args.blocks, args.batch, args.deepspeed = 64, 2, 4, False
    cluster = netns.Cluster(str(os.getpid()))  # its own namespaces: a smoke test may run beside it
    try:
        netns.require_root()
    except netns.NotRootError as err:
        print(f"bench/link.py: {err}", file=sys.stderr)
        return 2
    try:
        cluster.up(None)
        header = _header(args)
        rows = summarise(run(cluster, args), args.per_node)
    finally:
        cluster.down()
    print_tables(rows, header)
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": header, "namespaces": cluster.nodes, "results": rows},
                                              indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
