"""`shardwise tune`: the planner's best layouts for this cluster, each run with the user's own script for a few steps;
the measured best written as a config `shardwise run --config` takes (docs/tune.md)."""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

from ..config import deepspeed
from ..config.deepspeed.autotuning import ARG_KEYS, tune_settings
from ..config.sources import load_dict, read_file
from ..planner import CHECKPOINTING, MODEL_PRESETS, PlanError, resolve_model
from ..planner.cluster_file import CLUSTER_VALUES, is_cluster_file, resolve_cluster
from ..tune import METRICS, TuneSettings, candidates, tune
from ..tune.bound import DEFAULT_MARGIN
from ..tune.calibrate import calibrate_results
from ..tune.nodes import NodeChannel, across_nodes, follow, free_port
from ..tune.results import RESULT_FILES, best_command, print_results, write_results
from ..tune.trial import NodePlace, launch_best
from ..tune.tuner import TRIALS_FILE
from .flags import fraction, positive
from .plan import _CLUSTER_FLAGS, _shape

# `shardwise plan`'s cluster value flags a tuning run takes (the shape is the launch's): the values a cluster file
# keeps, so `shardwise calibrate` predicts the trials on the cluster they were planned on.
TUNE_CLUSTER_FLAGS = [f for f in _CLUSTER_FLAGS if f[1] in ("peak_flops", *CLUSTER_VALUES)]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="run the planner's best layouts for a few steps each and keep the measured best",
        description="Ask the planner for its ranked layouts of --model on this cluster, run the script under each of "
                    "the top --trials as a real `shardwise run` stopped after --steps optimizer steps, measure step "
                    "time after warm-up, throughput and peak memory per rank, name each failure (refused, "
                    "out_of_memory, hang, crash, unmeasured) and go on. Writes <results>/trials.jsonl, one run "
                    "directory per trial, best_config.json, best_cmd.txt, summary.json and tune_report.html, and "
                    "prints predicted vs measured per trial with Spearman's rho and the regret of the planner's "
                    "pick. Across nodes, run the same command on every node (--nnodes, --node-rank, --master-addr, or "
                    "--hostfile; in a SLURM job or PyTorchJob the flags not given come from its variables). Exit 2 on bad input, 1 when no trial was measured.")
    p.add_argument("--model", required=True, metavar="MODEL",
                   help=f"the model the script trains, as `shardwise plan --model` takes it (a preset such as "
                        f"{', '.join(sorted(MODEL_PRESETS)[:3])}, FAMILY[:key=value,...], a config.json path or "
                        "module:function)")
    p.add_argument("--input-shape", type=_shape, metavar="D[,D...]",
                   help="with module:function: one sample's shape, as `shardwise plan --input-shape` takes it")
    p.add_argument("--nproc-per-node", type=positive(int), default=None, metavar="N",
                   help="ranks per node in each trial (default 1; with --hostfile, its slots; in a SLURM job its GPUs "
                        "per node)")
    nodes = p.add_argument_group(
        "across nodes", "Run the same command on every node, as `shardwise run` is: node 0 plans, announces each "
                        "trial and keeps the results, every node launches its share (docs/tune.md)")
    nodes.add_argument("--nnodes", type=positive(int), default=None, metavar="M", help="nodes (default 1)")
    nodes.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R", help="this node's index")
    nodes.add_argument("--master-addr", "--master_addr", default=None, metavar="ADDR",
                       help="node 0's address, where the nodes meet")
    nodes.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT",
                       help="the port node 0 coordinates the tuning run on (default 29500); each trial's launch "
                            "meets at a free port node 0 picks")
    nodes.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                       help="DeepSpeed's hostfile: sets --nnodes, --master-addr and this node's rank from its hostname")
    p.add_argument("--cluster", default="local", metavar="PRESET|FILE",
                   help="the planner's description of each node's devices (default local: this machine's CPUs); "
                        "e.g. p4d.24xlarge on such nodes, or a cluster file --calibrate wrote")
    values = p.add_argument_group("cluster values (over --cluster's, as `shardwise plan` takes them)")
    for flag, dest, _, kind, text, _ in TUNE_CLUSTER_FLAGS:
        values.add_argument(flag, dest=dest, type=kind if kind is fraction else positive(kind), help=text)
    p.add_argument("--config", metavar="BASE",
                   help="base config (shardwise, SMP or DeepSpeed file) the candidates' layout keys are set over; a "
                        "DeepSpeed config's enabled autotuning block sets the flags not given (docs/tune.md)")
    p.add_argument("--global-batch", type=positive(int), metavar="B",
                   help="sequences per step the planner plans for (default: one per rank); the script's own loader "
                        "sets what runs")
    p.add_argument("--seq", type=positive(int), metavar="S", help="tokens per sequence (default: the model's)")
    p.add_argument("--checkpointing", choices=CHECKPOINTING, default="none",
                   help="the activation checkpointing the script applies; candidates are planned with it")
    p.add_argument("--trials", type=positive(int), metavar="K", help="candidates to run (default 3)")
    p.add_argument("--steps", type=positive(int), metavar="S",
                   help="optimizer steps per trial, warm-up included (default 3)")
    p.add_argument("--warmup", type=int, metavar="W", help="first steps left out of the measurement (default 1)")
    p.add_argument("--metric", choices=list(METRICS),
                   help="what makes a trial best: samples/s (throughput, default), step time (latency) or the "
                        "largest rank's peak memory (memory)")
    p.add_argument("--time-budget", type=positive(float), metavar="SECONDS",
                   help="start no trial after this many seconds")
    p.add_argument("--trial-timeout", type=positive(float), default=600.0, metavar="SECONDS",
                   help="a trial still running after this is stopped and named a hang (default 600)")
    p.add_argument("--micro-batch-sizes", type=positive(int), metavar="N",
                   help="at most N micro batch sizes (microbatch counts at the planned global batch) of each layout, "
                        "the planner's best first (DeepSpeed's num_tuning_micro_batch_sizes; default: no limit)")
    p.add_argument("--min-micro-batch", type=positive(int), metavar="B",
                   help="try no micro batch of fewer than B sequences per rank (DeepSpeed's "
                        "min_train_micro_batch_size_per_gpu)")
    p.add_argument("--max-micro-batch", type=positive(int), metavar="B",
                   help="try no micro batch of more than B sequences per rank (DeepSpeed's "
                        "max_train_micro_batch_size_per_gpu): a layout's best count within the range stands in for "
                        "the planner's pick")
    p.add_argument("--arg-mapping", dest="arg_mappings", action="append", type=_arg_mapping, metavar="KEY=--FLAG",
                   help="pass each trial's KEY (train_micro_batch_size_per_gpu, gradient_accumulation_steps or "
                        "train_batch_size) to the script as --FLAG, for a script that reads its batch from arguments "
                        "(DeepSpeed's arg_mappings; repeatable)")
    p.add_argument("--early-stopping", type=positive(int), metavar="N",
                   help="stop after N trials in a row that do not beat the best")
    p.add_argument("--bound-margin", type=float, default=DEFAULT_MARGIN, metavar="FRACTION",
                   help="stop when no remaining candidate can beat the measured best even with its prediction "
                        "corrected by the most favourable measured/predicted ratio seen and this margin (default "
                        f"{DEFAULT_MARGIN:g}); --no-bound-stop runs them all")
    p.add_argument("--no-bound-stop", action="store_true", help="do not stop by the planner's bound")
    p.add_argument("--results", metavar="DIR", help="where results go (default tune_results)")
    p.add_argument("--runs-dir", metavar="DIR", help="where each trial's run directory goes (default: --results)")
    p.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=None,
                   help="replace an earlier tuning run's results and trial directories (default: refuse them)")
    p.add_argument("--calibrate", action="store_true",
                   help="after the trials, fit the planner's constants for this cluster to the measured step times "
                        "and write <results>/cluster.json, which --cluster FILE reads back (docs/tune.md)")
    p.add_argument("--run-after", action="store_true",
                   help="then launch the real training with best_config.json (DeepSpeed's --autotuning run)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=run)


def _base_config(path: str | None) -> dict:
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        data = load_dict(path)
    for note in notes:
        print(f"shardwise tune: warning: {note.message}", file=sys.stderr)
    return data


def _precision(base: dict) -> str | None:
    """The base config's precision, so the plan predicts what runs (None: the planner's default)."""
    return next((name for name in ("bf16", "fp16") if base.get(name)), None)


def _arg_mapping(text: str) -> tuple[str, str]:
    key, _, flag = text.partition("=")
    if key not in ARG_KEYS or not flag.startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: write KEY=--FLAG with KEY one of {', '.join(ARG_KEYS)}, e.g. "
                                         "train_micro_batch_size_per_gpu=--per_device_train_batch_size")
    return key, flag


_DEFAULTS = {"trials": 3, "steps": 3, "warmup": 1, "metric": "throughput", "early_stopping": None,
             "results": "tune_results", "runs_dir": None, "overwrite": False, "order": "model_based",
             "micro_batch_sizes": None, "min_micro_batch": None, "max_micro_batch": None, "arg_mappings": {}}


def _settings(args: argparse.Namespace) -> dict:
    """Each setting from its flag, else the DeepSpeed config's autotuning block, else the default."""
    block = {}
    if args.config:
        data = read_file(args.config)
        block = tune_settings(data) if deepspeed.is_deepspeed(data) else {}
    if "steps" in block and args.warmup is None and "warmup" not in block:
        block["warmup"] = min(_DEFAULTS["warmup"], block["steps"] - 1)
    flags = {key: getattr(args, key, None) for key in _DEFAULTS}
    if flags["arg_mappings"] is not None:  # --arg-mapping's (key, flag) pairs
        flags["arg_mappings"] = dict(flags["arg_mappings"])
    return {key: flags[key] if flags[key] is not None else block.get(key, default)
            for key, default in _DEFAULTS.items()}


def _clear(results: Path, runs: Path, overwrite: bool) -> bool:
    """Make room for this run's results; False (said why) when an earlier run's are there and may not go. Its
    trial directories go too: a run directory used again appends to its metrics."""
    earlier = [results / name for name in (TRIALS_FILE, *RESULT_FILES) if (results / name).exists()]
    earlier += [path for path in sorted(runs.glob("trial*")) if re.fullmatch(r"trial\d+(\.config\.json)?", path.name)]
    if earlier and not overwrite:
        print(f"shardwise tune: {earlier[0]} exists; pass another --results, or --overwrite", file=sys.stderr)
        return False
    for path in earlier:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return True


def _cluster_values(args: argparse.Namespace) -> dict:
    """The cluster values the flags set (absolute, as a cluster file keeps them)."""
    return {dest: getattr(args, dest) * unit for _, dest, unit, *_ in TUNE_CLUSTER_FLAGS
            if getattr(args, dest) is not None}


def _launch_shape(args: argparse.Namespace) -> tuple[int, NodePlace | None]:
    """Ranks per node and, across nodes, this node's place, from the flags, a hostfile or a SLURM or PyTorchJob
    environment (as `shardwise run` reads them); the launcher's LaunchError names what does not agree."""
    from ..launcher.from_args import scheduler_shape
    from ..launcher.spec import resolve

    shape = scheduler_shape(args)
    across = args.hostfile or any(shape[name] is not None for name in ("nnodes", "node_rank", "master_addr"))
    if not across:
        return shape["nproc_per_node"] or 1, None
    spec = resolve(args.script, args.script_args,
                   **{**shape, "nproc_per_node": shape["nproc_per_node"] or (None if args.hostfile else 1)},
                   hostfile=args.hostfile)
    if spec.nnodes == 1:
        return spec.nproc_per_node, None
    return spec.nproc_per_node, NodePlace(spec.nnodes, spec.node_rank, spec.master_addr, spec.master_port)


def run(args: argparse.Namespace) -> int:
    s = _settings(args)
    if not 0 <= s["warmup"] < s["steps"]:
        print(f"shardwise tune: warm-up {s['warmup']} must be 0 or more and below the {s['steps']} steps, so that "
              "some step is measured", file=sys.stderr)
        return 2
    low, high = s["min_micro_batch"], s["max_micro_batch"]
    if low and high and low > high:
        print(f"shardwise tune: the micro batch range {low} to {high} is empty; give a minimum no larger than the "
              "maximum", file=sys.stderr)
        return 2
    if not 0 <= args.bound_margin < 1:
        print(f"shardwise tune: --bound-margin {args.bound_margin:g} must be at least 0 and below 1; 0.1 allows "
              "10 % better than the most favourable ratio seen", file=sys.stderr)
        return 2
    try:
        nproc, place = _launch_shape(args)
    except ValueError as err:  # the launcher's LaunchError: flags or a hostfile that do not agree
        print(f"shardwise tune: {err}", file=sys.stderr)
        return 2
    results = Path(s["results"])
    runs = Path(s["runs_dir"]) if s["runs_dir"] else results
    settings = TuneSettings(script=args.script, script_args=tuple(args.script_args), nproc=nproc, steps=s["steps"],
                            warmup=s["warmup"], metric=s["metric"], time_budget_s=args.time_budget,
                            trial_deadline_s=args.trial_timeout, early_stopping=s["early_stopping"], results=results,
                            runs=runs, bound_margin=None if args.no_bound_stop else args.bound_margin, place=place,
                            arg_mappings=s["arg_mappings"])
    if place is None:
        return _lead(args, s, settings, None)
    started = time.time()
    try:
        channel = NodeChannel(place)
    except ConnectionError as err:
        print(f"shardwise tune: {err}", file=sys.stderr)
        return 2
    if not place.leads:
        print(f"shardwise tune: node {place.node_rank} of {place.nnodes}: launching the trials node 0 "
              f"({place.master_addr}) announces", flush=True)
        return follow(channel, settings, started)
    code = 1
    try:
        code = _lead(args, s, settings, channel)
        return code
    finally:  # every node hears how it ended, even when node 0 was refused its input or stopped by an error
        if not channel.trained:
            channel.announce({"kind": "end", "code": code, "reason": f"exit code {code}"})
            channel.wait_goodbyes()


def _lead(args: argparse.Namespace, s: dict, settings: TuneSettings, channel: NodeChannel | None) -> int:
    """Plan, run the trials (on this node, or across nodes through `channel`), write and report the results."""
    base = _base_config(args.config)
    nnodes = settings.place.nnodes if settings.place else 1
    try:
        spec = resolve_model(args.model, input_shape=args.input_shape, seq=args.seq)
        cluster = resolve_cluster(args.cluster, nodes=nnodes, devices_per_node=settings.nproc,
                                  **_cluster_values(args))
        chosen = candidates(spec, cluster, base, limit=s["trials"], global_batch=args.global_batch, seq=args.seq,
                            precision=_precision(base), checkpointing=args.checkpointing,
                            shuffled=s["order"] == "random", micro_batch_sizes=s["micro_batch_sizes"],
                            micro_batch_range=(s["min_micro_batch"], s["max_micro_batch"]))
    except PlanError as err:
        print(f"shardwise tune: {err}", file=sys.stderr)
        return 2
    if not _clear(settings.results, settings.runs, s["overwrite"]):
        return 2
    settings = replace(settings, planning=_planning(args, cluster, settings.nproc))
    print(f"shardwise tune: {len(chosen)} candidates of {spec.name} on {cluster.name}; results in "
          f"{settings.results}", flush=True)

    def report(row: dict) -> None:
        outcome = row["failure"] or f"{row['measured_step_time_s']:.4f} s/step"
        print(f"shardwise tune: trial {row['trial']} (plan #{row['plan_rank']}): {outcome}", flush=True)

    runner = None if channel is None else across_nodes(channel, settings)
    result = tune(chosen, settings, on_trial=report, runner=runner,
                  halted=None if channel is None else channel.halted)
    best_path = write_results(result, settings)
    print_results(result, settings, best_path)
    calibrated = None
    if args.calibrate:
        try:
            fitted, path, held = calibrate_results(settings.results, settings.planning)
            print_calibration(fitted, path, held)
            calibrated = fitted, path
        except ValueError as err:  # nothing measured that the planner predicts
            print(f"shardwise tune: no calibration: {err}", file=sys.stderr)
    try:
        from ..tune.report import write_tune_report  # matplotlib (optional) loads only here

        print(f"shardwise tune: report: {write_tune_report(result, settings, calibrated)}")
    except ImportError as err:
        print(f"shardwise tune: no tune_report.html: {err}", file=sys.stderr)
    if best_path is None:
        return 1
    if args.run_after:
        args = result.best["script_args"]
        print(f"shardwise tune: running the best config: {best_command(settings, best_path, args)}", flush=True)
        nodes = []
        if channel is not None:
            port = free_port()
            channel.train(result.best["config"], args, port)
            nodes = settings.place.launch_flags(port)
        return launch_best(settings.script, args, settings.nproc, best_path, nodes)
    return 0


def _planning(args: argparse.Namespace, cluster, nproc: int) -> dict:
    """What the candidates were planned with, kept in summary.json so the trials can be predicted again
    (`shardwise calibrate`)."""
    return {"model": args.model, "input_shape": list(args.input_shape) if args.input_shape else None,
            "seq": args.seq, "global_batch": args.global_batch or cluster.world_size,
            "checkpointing": args.checkpointing, "nproc": nproc, "nnodes": cluster.nodes,
            "cluster_values": _cluster_values(args),
            "cluster": str(Path(args.cluster).resolve()) if is_cluster_file(args.cluster) else args.cluster}


def print_calibration(fitted, path: Path, held: list) -> None:
    """Each trial's predicted step time before and after calibration against the measured one."""
    before, after = fitted.errors(fitted.before), fitted.errors(fitted.after)
    for n, b, a, m, eb, ea in zip(fitted.trials, fitted.before, fitted.after, fitted.measured, before, after):
        print(f"calibration: trial {n}: measured {m:.4f} s, predicted {b:.4f} s ({eb:+.0%}) before, "
              f"{a:.4f} s ({ea:+.0%}) after")
    s = fitted.summary()
    print(f"calibration: mean |error| {s['mean_abs_error_before']:.0%} before, {s['mean_abs_error_after']:.0%} after; "
          f"within 10 %: {s['within_10_percent_before']} before, {s['within_10_percent_after']} after, of "
          f"{len(fitted.trials)}")
    for n, b, a, m in held:
        print(f"calibration: trial {n} held out: measured {m:.4f} s, predicted {b:.4f} s ({b / m - 1:+.0%}) before, "
              f"{a:.4f} s ({a / m - 1:+.0%}) by a fit on the others")
    print(f"calibration: {fitted.described()}; cluster file {path} "
          f"(shardwise plan --cluster {path})")


# `shardwise run` flags that place a tuning run across nodes, passed on to `shardwise tune` as given.
_NODE_FLAGS = {"nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
               "master_port": "--master-port", "hostfile": "--hostfile"}
# `shardwise run` flags that say how to launch one job, which a tuning run decides.
_NOT_WITH_AUTOTUNING = {"include": "--include", "exclude": "--exclude", "num_nodes": "--num_nodes",
                        "overrides": "--set", "run_dir": "--run-dir", "max_restarts": "--max-restarts",
                        "checkpoint_dir": "--checkpoint-dir"}
_DEEPSPEED_CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")


def deepspeed_config_arg(script_args: list[str]) -> str | None:
    """The DeepSpeed config a script is given (`--deepspeed_config ds.json` or `=ds.json`), as DeepSpeed's
    autotuner finds it."""
    for i, arg in enumerate(script_args):
        name, eq, value = arg.partition("=")
        if name in _DEEPSPEED_CONFIG_FLAGS:
            return value if eq else (script_args[i + 1] if i + 1 < len(script_args) else None)
    return None


def autotune(args: argparse.Namespace) -> int:
    """`shardwise run --autotuning tune|run --model M` (DeepSpeed's launcher flag): `shardwise tune` on this
    node's ranks, or across nodes with the run's node flags, with the run's config (else the script's
    --deepspeed_config) as the base, whose autotuning block sets the tuner's settings; `run` then trains with the
    best config."""
    if not args.autotuning:
        print("shardwise run: --model is read only with --autotuning; drop it, or add --autotuning tune|run",
              file=sys.stderr)
        return 2
    if not args.model:
        print("shardwise run: --autotuning needs --model MODEL, the model the script trains as `shardwise plan "
              "--model` takes it (a preset, FAMILY:key=value,..., a config.json or module:function)", file=sys.stderr)
        return 2
    given = [flag for dest, flag in _NOT_WITH_AUTOTUNING.items() if getattr(args, dest, None) not in (None, [], 0)]
    if given:
        print(f"shardwise run: {given[0]} is not taken with --autotuning, which launches each trial itself; drop "
              "it, or use `shardwise tune` (docs/tune.md)", file=sys.stderr)
        return 2
    nproc = args.nproc_per_node or args.num_gpus
    if nproc is None and not args.hostfile:
        print("shardwise run: --autotuning needs --nproc-per-node N (or --num_gpus N, or a --hostfile's slots): the "
              "ranks each trial runs on a node", file=sys.stderr)
        return 2
    config = args.config or deepspeed_config_arg(args.script_args)
    from . import build_parser  # the CLI's parser: `tune` reads its flags as given on its own

    nodes = [part for dest, flag in _NODE_FLAGS.items() if getattr(args, dest, None) is not None
             for part in (flag, str(getattr(args, dest)))]
    argv = ["tune", "--model", args.model, *(["--nproc-per-node", str(nproc)] if nproc else []), *nodes,
            *(["--config", config] if config else []), *(["--run-after"] if args.autotuning == "run" else []),
            args.script, *args.script_args]
    return run(build_parser().parse_args(argv))
