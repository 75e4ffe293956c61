"""`shardwise tune` on GPT-2 and Llama (bench/tune_train.py) on N CPU ranks of this machine, or across
bench/netns.py's two simulated nodes joined by a shaped link (needs root): the trials, how good the planner's
ranking was (Spearman's rho, the regret of its pick, the mean absolute errors), and its step times calibrated to
the trials (`shardwise calibrate --held-out`: fitted on all, and each trial from a fit on the others).

    python bench/tune.py --nproc 4 --trials 6 --steps 4 --out bench_tune
    python bench/tune.py --nodes 2 --nproc 2 --rate 400mbit --trials 6 --steps 4 --out bench_tune

Every candidate is run (--no-bound-stop): the bench measures the planner on each. Across nodes the planner is
told the link's rate (--inter-node-gbs), the same command runs in each node's namespace, node 0 keeps the
results. Each family's results directory holds trials.jsonl, tune_report.html, cluster.json and the trials' run
directories; the tables are printed as markdown for docs/tune.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parent / "tune_train.py"
MODELS = {  # the planner's view of bench/tune_train.py's models
    "gpt2": "gpt2:vocab_size=256,n_positions=64,n_embd=128,n_layer=4,n_head=4",
    "llama": "llama:hidden_size=128,intermediate_size=256,num_hidden_layers=4,num_attention_heads=4,"
             "num_key_value_heads=2,vocab_size=256,max_position_embeddings=64",
}
CLI = "import sys; from shardwise.cli import main; sys.exit(main())"


def _percent(value) -> str:
    return "–" if value is None else f"{value:.0%}"


def _layout(row: dict) -> str:
    """Degrees above 1, then the config's other layout keys, e.g. `dp_shard=4 zero_stage=3 microbatches=2`."""
    degrees = [f"{k}={v}" for k, v in row["layout"].items() if v != 1]
    keys = [f"{k}={v}" for k, v in row["config"].items() if k not in ("sharded_data_parallel_degree", "bf16")]
    return " ".join(degrees + keys) or "DDP"


def _calibration_lines(calibrations: dict) -> list[str]:
    """Per family: mean absolute step-time error and trials within 10 % before and after calibration, fitted on
    all trials and held out one at a time, and the fitted constants (each a scale on the preset's value, or its
    value in seconds where the preset has none)."""
    lines = ["", "| model | before: mean abs error (within 10 %) | fitted on all | each held out | fitted constants |",
             "|---|---|---|---|---|"]
    for family, c in calibrations.items():
        held = c.get("held_out", [])
        held_errors = [abs(h["after"] / h["measured"] - 1) for h in held]
        held_text = (f"{sum(held_errors) / len(held_errors):.0%} ({sum(e <= 0.1 for e in held_errors)})"
                     if held else "–")
        lines.append(f"| {family} | {c['mean_abs_error_before']:.0%} ({c['within_10_percent_before']}) "
                     f"| {c['mean_abs_error_after']:.0%} ({c['within_10_percent_after']}) | {held_text} "
                     f"| {c['fitted']} |")
    return lines


def _tune(family: str, args, results: Path) -> None:
    """One tuning run of `family` on this node's ranks, or on both namespace nodes."""
    command = [sys.executable, "-c", CLI, "tune", "--model", MODELS[family], "--seq", "64", "--global-batch",
               str(args.batch_size * args.nproc * args.nodes), "--nproc-per-node", str(args.nproc), "--trials",
               str(args.trials), "--steps", str(args.steps), "--results", str(results), "--overwrite",
               "--no-bound-stop"]
    script = [str(TRAIN), "--family", family, "--global-batch", str(args.batch_size * args.nproc * args.nodes)]
    if args.nodes == 1:
        done = subprocess.run([*command, *script], capture_output=True, text=True)
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
        if done.returncode not in (0, 1):
            raise SystemExit(f"shardwise tune for {family} exited {done.returncode}")
        return
    import netns  # root only: the namespaces

    cluster = netns.Cluster(str(os.getpid()))
    cluster.up(args.rate)
    try:
        link = ["--inter-node-gbs", str(netns.bytes_per_second(args.rate) / 1e9)] if args.rate else []
        outputs = cluster.on_nodes(lambda node: [*command, *netns.Cluster.node_flags(node), *link, *script],
                                   timeout=7200)
        print(outputs[0][-4000:], outputs[1][-1000:], sep="\n", file=sys.stderr)
    finally:
        cluster.down()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks per node")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: bench/netns.py's two namespace nodes (root)")
    p.add_argument("--rate", default=None, help="with --nodes 2: the link's rate, tc's syntax (default: unshaped)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8,
                   help="sequences per rank: the global batch is this × every rank, split over the replicas")
    p.add_argument("--families", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--out", type=Path, default=Path("bench_tune"))
    args = p.parse_args()
    ranks = f"{args.nodes} × {args.nproc}" + (f" ({args.rate})" if args.nodes > 1 and args.rate else "")
    lines = ["| model | ranks | trial | plan | layout | predicted s | measured s | error | predicted GiB | peak GiB "
             "| error | result |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summaries, calibrations = {}, {}
    for family in args.families:
        results = args.out / family
        _tune(family, args, results)
        summaries[family] = json.loads((results / "summary.json").read_text())
        calibrated = subprocess.run([sys.executable, "-c", CLI, "calibrate", str(results), "--held-out"],
                                    capture_output=True, text=True)
        print(calibrated.stdout, calibrated.stderr, sep="\n", file=sys.stderr)
        if calibrated.returncode == 0:
            calibrations[family] = json.loads((results / "cluster.json").read_text())["calibration"]
        for line in (results / "trials.jsonl").read_text().splitlines():
            row = json.loads(line)
            peak = row["max_memory_bytes"]
            lines.append(
                f"| {family} | {ranks} | {row['trial']} | {row['plan_rank']} | {_layout(row)} "
                f"| {row['predicted_step_time_s']:.4f} | {row['measured_step_time_s'] or 0:.4f} "
                f"| {_percent(row['step_time_error'])} | {row['predicted_memory_bytes'] / 2**30:.2f} "
                f"| {peak / 2**30 if peak else 0:.2f} | {_percent(row['memory_error'])} | {row['failure'] or 'ok'} |")
    lines += ["", "| model | measured trials | Spearman rho | regret of plan #1 | mean abs error step time | memory |",
              "|---|---|---|---|---|---|"]
    for family, s in summaries.items():
        rho = "–" if s["spearman_step_time"] is None else f"{s['spearman_step_time']:.2f}"
        regret = "–" if s["regret"] is None else f"{s['regret']:.2f}"
        lines.append(f"| {family} | {s['trials']} | {rho} | {regret} | {_percent(s['mean_abs_step_time_error'])} "
                     f"| {_percent(s['mean_abs_memory_error'])} |")
    lines += _calibration_lines(calibrations)
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
