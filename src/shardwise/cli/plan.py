"""`shardwise plan`: rank the configurations that fit a model on a cluster, before any GPU-hour is spent."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from ..config.sources import load_dict
from ..planner import (CHECKPOINTING, CLUSTER_PRESETS, MODEL_PRESETS, Plan, PlanError, custom_cluster,
                       evaluate, plan, print_plan, resolve_model, to_json, write_config)
from ..planner.cluster_file import resolve_cluster
from ..planner.hardware import GB, GiB
from ..planner.report import checkpointing_call, config_format
from ..config.layout import validate
from .flags import fraction, positive
from .plan_trainer import trainer_plan

# Cluster flags: (flag, ClusterSpec/override field, unit multiplier, type, help, required without --cluster).
_CLUSTER_FLAGS = [
    ("--nodes", "nodes", 1, int, "number of nodes (overrides the N of N x PRESET)", False),
    ("--devices-per-node", "devices_per_node", 1, int, "devices per node", True),
    ("--device-memory-gib", "device_memory_bytes", GiB, float, "memory per device, GiB", True),
    ("--peak-tflops", "peak_flops", 1e12, float, "peak TFLOP/s per device in the plan's precision", True),
    ("--intra-node-gbs", "intra_node_bandwidth", GB, float, "per-device bandwidth inside a node, GB/s", True),
    ("--inter-node-gbs", "inter_node_bandwidth", GB, float, "per-node network bandwidth, GB/s", True),
    ("--intra-node-latency-us", "intra_node_latency", 1e-6, float, "latency per step inside a node, µs", False),
    ("--inter-node-latency-us", "inter_node_latency", 1e-6, float, "latency per step between nodes, µs", False),
    ("--clock-mhz", "clock_mhz", 1, float, "the clock the device sustains, MHz: its preset's peak scaled from the "
     "clock its data sheet's peak is computed at, A100 1410, H100 1830 (a capped or down-clocked part; "
     "nvidia-smi -q -d CLOCK shows it under load)", False),
    ("--power-limit-w", "power_limit_watts", 1, float, "the board power limit, W: its preset's peak scaled by the "
     "cube root of limit / rated power (first order; --clock-mhz or --peak-tflops when known)", False),
    ("--link-efficiency", "link_efficiency", 1, fraction,
     "share of a link's bandwidth a collective gets (default 0.8, NCCL's; 0.95 on local, gloo's TCP)", False),
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="rank the configurations that fit a model on a cluster",
                       description="Predict per-rank memory and step time of every layout (pp × dp_replicate × "
                                   "dp_shard × cp × tp, ZeRO stage, MiCS group, experts' ep degree, context "
                                   "parallelism's mode, checkpointing, microbatching) of a model on a cluster and "
                                   "rank the ones that fit. Exit 2 on bad input.")
    p.add_argument("--model", required=True, metavar="MODEL",
                   help=f"preset ({', '.join(sorted(MODEL_PRESETS))}), FAMILY[:key=value,...] "
                        "(gpt2, llama, bert, vit), a config.json path, or module:function returning any nn.Module "
                        "(built on the meta device; one without a transformers config of those families is traced "
                        "on --input-shape, or on example_inputs(batch, seq) defined in its module)")
    p.add_argument("--input-shape", type=_shape, metavar="D[,D...]",
                   help="with module:function: one sample's shape, e.g. 1024 or 3,224,224; the traced forward gets "
                        "a float tensor of (batch, *shape) as its first argument")
    p.add_argument("--cluster", metavar="[N x]PRESET|FILE",
                   help=f"e.g. 16xp4d.24xlarge; presets: {', '.join(CLUSTER_PRESETS)}; or a cluster file "
                        "(`shardwise tune --calibrate` writes one)")
    p.add_argument("--global-batch", type=positive(int), metavar="B",
                   help="sequences per step (default: one per device)")
    p.add_argument("--seq", type=positive(int), metavar="S", help="tokens per sequence (default: the model's)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="default: the device's fastest (bf16 on A100/H100, fp16 on T4, fp32 on CPU)")
    p.add_argument("--config", metavar="FILE",
                   help="predict this config instead of ranking every layout: a shardwise, SMP or DeepSpeed config "
                        "file, read as `shardwise run` reads it (its precision and batch sizes too)")
    p.add_argument("--training-args", metavar="ARGS",
                   help="plan a Hugging Face Trainer run from its TrainingArguments: their JSON file, or the script's "
                        "flags in one string (--training-args='--per_device_train_batch_size 8 --bf16'); they set the "
                        "batch, precision and checkpointing, and --deepspeed among them the config (docs/hf.md)")
    p.add_argument("--checkpointing", choices=CHECKPOINTING, default="none",
                   help="with --config: the activation checkpointing the script applies (default none)")
    p.add_argument("--top", type=positive(int), default=10, metavar="K", help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print every layout considered as JSON instead of the table")
    p.add_argument("--explain", action="store_true", help="also show step-time parts, collectives and every rejection")
    p.add_argument("--out", metavar="FILE", help="write the best config to FILE (.json, .yaml or .yml)")
    flags = p.add_argument_group("cluster values (override the preset, or describe a cluster without one)")
    for flag, dest, _, kind, text, _ in _CLUSTER_FLAGS:
        flags.add_argument(flag, dest=dest, type=kind if kind is fraction else positive(kind), help=text)
    p.set_defaults(handler=run)


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape; write positive sizes joined by commas, e.g. 3,32,32")
    return shape


def _cluster(args: argparse.Namespace):
    values = {dest: getattr(args, dest) * unit if getattr(args, dest) is not None else None
              for _, dest, unit, *_ in _CLUSTER_FLAGS}
    if args.cluster:
        return resolve_cluster(args.cluster, **values)
    clocked = [flag for flag, dest in (("--clock-mhz", "clock_mhz"), ("--power-limit-w", "power_limit_watts"))
               if values.pop(dest) is not None]
    if clocked:
        raise PlanError(f"{clocked[0]} scales a preset device's peak; without --cluster give --peak-tflops at the "
                        "clock the device runs")
    missing = [flag for flag, dest, *_, required in _CLUSTER_FLAGS if required and values[dest] is None]
    if missing:
        raise PlanError("no --cluster preset given; pass --cluster [N x]PRESET (" + ", ".join(CLUSTER_PRESETS)
                        + ") or describe the cluster with " + ", ".join(missing))
    return custom_cluster(**{**values, "nodes": values["nodes"] or 1})


def _write_best(result: Plan, path: str) -> None:
    """Write the top layout's config; what is not a config key (checkpointing, batch) goes to stderr."""
    best = result.best
    if best is None:
        raise PlanError(f"no layout fits, so nothing was written to {path}")
    write_config(best, path)
    print(f"wrote the best config to {path}; activation checkpointing: {checkpointing_call(best.checkpointing)}; "
          f"data_loader batch_size: {best.batch_size}", file=sys.stderr)


def _planned_config(args: argparse.Namespace, spec, cluster) -> Plan:
    """The one config of --config on `cluster`, as a plan of one layout. Its global batch is its train_batch_size
    (worked out on this cluster, as `run` would), else --global-batch, else one sequence per device."""
    if args.precision:
        raise PlanError("--precision does not go with --config: the config's bf16/fp16 keys set the precision")
    with warnings.catch_warnings(record=True) as notes:  # what the config cannot honour, shown as the CLI shows it
        warnings.simplefilter("always")
        data = load_dict(args.config)
    for note in notes:
        print(f"shardwise plan: warning: {note.message}", file=sys.stderr)
    data.pop("metrics_sinks", None)  # where metrics go changes neither memory nor time
    config, _ = validate(data, cluster.topology)
    total = config.train_batch_size
    if args.global_batch and total and args.global_batch != total:
        raise PlanError(f"--global-batch {args.global_batch} disagrees with the config's train_batch_size {total} "
                        f"on {cluster.world_size} devices; drop one of them")
    global_batch = total or args.global_batch or cluster.world_size
    if not cluster.device.supports(config.dtype_name):
        raise PlanError(f"the config's precision {config.dtype_name} is not supported by {cluster.device.name}")
    e = evaluate(spec, cluster, data, global_batch=global_batch, seq=args.seq, checkpointing=args.checkpointing)
    return Plan(spec, cluster, global_batch, args.seq or spec.seq_len, config.dtype_name, [e])


def run(args: argparse.Namespace) -> int:
    try:
        if args.out:
            config_format(args.out)
        spec = resolve_model(args.model, input_shape=args.input_shape, seq=args.seq)
        if args.training_args:
            result = trainer_plan(args, spec, _cluster(args))
        elif args.config:
            result = _planned_config(args, spec, _cluster(args))
        else:
            result = plan(spec, _cluster(args), global_batch=args.global_batch, seq=args.seq, precision=args.precision)
        if args.json:
            print(json.dumps(to_json(result), indent=1))
        else:
            print_plan(result, args.top, args.explain)
        if args.out:
            _write_best(result, args.out)
    except PlanError as err:
        print(f"shardwise plan: {err}", file=sys.stderr)
        return 2
    return 0
