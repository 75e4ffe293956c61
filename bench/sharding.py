"""Sharded data parallelism side by side: shardwise against plain PyTorch DDP and FSDP2 (and DeepSpeed).

    python bench/sharding.py [--nproc 4] [--steps 5] [--rounds 3] [--model gpt2-small] [--batch 4]
                             [--precision fp32|bf16] [--json FILE]

Every configuration trains the same GPT-2 on the same batches on `nproc` gloo
CPU ranks in this one invocation, in the same precision (setups.py says how each
computes in bf16), and is measured the same way (measure.py):
median step time and its ratio to plain DDP and plain FSDP2, MemTracker's peak
bytes per category on the busiest rank, and the collectives of one step. For
shardwise's configurations the planner's predicted peak stands beside the
measured one. DeepSpeed's ZeRO stages join when `deepspeed` is importable; each
runs in fresh processes because DeepSpeed keeps its process groups in globals.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
from importlib import metadata

import setups
from measure import measure_all

from shardwise.config import parse_config
from shardwise.planner import cluster_preset, predict_memory, spec_from_hf
from shardwise.testing import run_distributed, shutdown_pools
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster

BASELINES = ("torch DDP", "torch FSDP2")
CATEGORIES = ("PARAM", "GRAD", "OPT", "ACT", "TEMP", "BUFFER", "OTH")


def shardwise_configs(nproc: int) -> dict[str, dict]:
    configs = {"DDP": {}, "ZeRO-1": {"shard_optimizer_state": True},
               "ZeRO-2": {"zero_stage": 2, "sharded_data_parallel_degree": nproc},
               "ZeRO-3": {"sharded_data_parallel_degree": nproc},
               f"MiCS {nproc // 2}×2": {"sharded_data_parallel_degree": 2}}
    if nproc >= 4:  # ZeRO++ hpZ: backward gathers inside secondary groups of half the ranks
        configs[f"ZeRO-3 hpZ {nproc // 2}"] = {"sharded_data_parallel_degree": nproc,
                                              "zero_hpz_partition_size": nproc // 2}
    return configs


def _deepspeed_version() -> str | None:
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def _measure(factories: dict, args) -> dict[str, list[dict]]:
    per_rank = run_distributed(measure_all, args.nproc, factories, args.model, args.batch, args.steps, args.rounds,
                               timeout=600 + 60 * args.steps * args.rounds)
    return {name: [rank[name] for rank in per_rank] for name in factories}


def run(args) -> dict[str, list[dict]]:
    """Per configuration, the per-rank results of `measure_all`."""
    precision = {"precision": args.precision}
    factories = {"torch DDP": functools.partial(setups.plain_ddp, **precision),
                 "torch FSDP2": functools.partial(setups.plain_fsdp2, **precision)}
    factories.update({f"shardwise {name}": functools.partial(setups.shardwise, config, **precision)
                      for name, config in shardwise_configs(args.nproc).items()})
    results = _measure(factories, args)
    if args.deepspeed:
        for stage in range(4):
            shutdown_pools()  # fresh processes: DeepSpeed keeps its process groups in module globals
            results.update(_measure({f"DeepSpeed ZeRO-{stage}": functools.partial(setups.deepspeed, stage,
                                                                                  **precision)}, args))
    return results


def summarise(results: dict[str, list[dict]], args) -> dict[str, dict]:
    """Step time (slowest rank per step), the busiest rank's peak memory, rank 0's collectives."""
    rows = {}
    for name, ranks in results.items():
        times = [max(step) for step in zip(*(rank["times"] for rank in ranks))]
        memory = max((rank["memory"] for rank in ranks), key=lambda m: m["Total"])
        rows[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                      "memory_bytes": memory, "collectives": ranks[0]["collectives"]}
    for row in rows.values():
        for base in BASELINES:
            row[f"vs {base}"] = row["median_s"] / rows[base]["median_s"]
    spec = spec_from_hf(setups.hf_config(args.model).to_dict(), args.model)
    device = cluster_preset("local", devices_per_node=args.nproc).device
    for name, config in shardwise_configs(args.nproc).items():
        parsed = parse_config({**config, "bf16": args.precision == "bf16"})
        predicted = predict_memory(spec, parsed, layout_for(parsed, Cluster(1, args.nproc)), args.batch,
                                   setups.MODELS[args.model]["seq"], device=device)
        rows[f"shardwise {name}"]["planner_peak_bytes"] = predicted.total
    return rows


def _collectives(counts: dict[str, list[int]]) -> str:
    return "; ".join(f"{kind} {calls}× {nbytes / 1e6:.2f} MB" for kind, (calls, nbytes) in sorted(counts.items()))


def print_tables(rows: dict[str, dict], header: str) -> None:
    print(header + "\n")
    print("| configuration | step ms (median) | min–max ms | × torch DDP | × torch FSDP2 |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.0f}–{r['max_s'] * 1e3:.0f} | "
              f"{r['vs torch DDP']:.2f} | {r['vs torch FSDP2']:.2f} |")
    print("\nPeak memory of the busiest rank, bytes by MemTracker category (planner: predicted total)\n")
    shown = [c for c in CATEGORIES if any(r["memory_bytes"].get(c) for r in rows.values())]
    print("| configuration | " + " | ".join(shown) + " | peak | planner |")
    print("|---|" + "---:|" * (len(shown) + 2))
    for name, r in rows.items():
        m = r["memory_bytes"]
        planner = r.get("planner_peak_bytes")
        planner = f"{planner:,.0f} ({planner / m['Total'] - 1:+.0%})" if planner else "–"
        print(f"| {name} | " + " | ".join(f"{m.get(c, 0):,}" for c in shown) + f" | {m['Total']:,} | {planner} |")
    print("\nCollectives of one step on rank 0 (op/group size: calls, bytes of the full buffers)\n")
    print("| configuration | collectives |")
    print("|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {_collectives(r['collectives'])} |")


def _header(args) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if sys.platform == "linux" else platform.processor()
    versions = f"torch {metadata.version('torch')}, transformers {metadata.version('transformers')}"
    if args.deepspeed:
        versions += f", deepspeed {_deepspeed_version()}"
    shape = setups.MODELS[args.model]["config"]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu}, {platform.machine()}, "
            f"{os.cpu_count()} cores, load average {load} at the start; {versions}; {args.nproc} gloo ranks; "
            f"{args.model} {shape}, "
            f"batch {args.batch} × seq {setups.MODELS[args.model]['seq']} per rank, {args.precision}, AdamW; "
            f"{args.rounds} rounds of {args.steps} timed steps, each after 3 untimed ones")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks (even, for MiCS in groups of 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="passes over all configurations")
    parser.add_argument("--model", choices=sorted(setups.MODELS), default="gpt2-small")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: every configuration computes in bfloat16 with fp32 master weights")
    parser.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=_deepspeed_version() is not None,
                        help="also run DeepSpeed ZeRO-0..3 (default: when deepspeed is installed)")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.nproc % 2:
        parser.error("--nproc must be even and at least 2 (MiCS runs in groups of 2)")
    header = _header(args)
    rows = summarise(run(args), args)
    print_tables(rows, header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": header, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
