"""`shardwise run`: launch a training script on this node's ranks (torchrun underneath)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Sequence

from ..config import IneffectiveSettingsWarning
from ..config.sources import load_dict, read_distribution


def add_launch_flags(p: argparse.ArgumentParser, default_nproc: str = "the config's mpi.processes_per_host, else the "
                     "accelerators on this node, else 1") -> None:
    """Flags shared by `run` and `demo`: cluster shape, rendezvous, config, run directory."""
    shape = p.add_argument_group("cluster")
    shape.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help=f"processes on this node (default: {default_nproc})")
    shape.add_argument("--nnodes", type=int, default=None, metavar="M", help="number of nodes (default 1)")
    shape.add_argument("--node-rank", type=int, default=None, metavar="R", help="this node's index, 0..M-1")
    shape.add_argument("--master-addr", default=None, metavar="ADDR", help="address of node 0 (multi-node)")
    shape.add_argument("--master-port", type=int, default=None, metavar="PORT", help="rendezvous port (default 29500)")
    shape.add_argument("--hostfile", default=None, metavar="FILE",
                       help="DeepSpeed-style 'host slots=N' lines; sets --nnodes, --nproc-per-node, --master-addr "
                            "and this node's rank from its hostname (run the same command on every host; no ssh)")
    conf = p.add_argument_group("config and output")
    conf.add_argument("--config", default=None, metavar="FILE",
                      help="JSON or YAML config file: config keys, or a SageMaker estimator's whole distribution dict")
    conf.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override one config key (repeatable)")
    conf.add_argument("--run-dir", default=None, metavar="DIR",
                      help="where config and per-rank logs go (default runs/<timestamp>-<script name>)")
    conf.add_argument("--console-ranks", default=None, metavar="RANKS",
                      help="global ranks echoed to the console: '0' (default), '0,1', 'all' or 'none'")
    conf.add_argument("--max-restarts", type=int, default=0, metavar="K",
                      help="restart all ranks up to K times after a failure (default 0)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="launch a training script on this node's ranks",
        description="Validate the config for the cluster shape, then start the script on every rank of this node "
                    "through torchrun's agent. Each rank's stdout and stderr go to <run-dir>/logs/rank<R>/; rank 0 "
                    "is echoed here. Exits with the first failing rank's exit code and shows its last log lines.")
    add_launch_flags(p)
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="the config's checkpoint_dir: where a preempted job (SIGTERM) saves, and where the script "
                        "finds the newest complete checkpoint to resume from after a restart")
    p.add_argument("script", help="the training script (run as `python -u script ...` on every rank)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=run)


def launch_from_args(args: argparse.Namespace, script: str, script_args: Sequence[str],
                     overrides: Sequence[str]) -> int:
    """Resolve flags, then launch (which validates the config for the cluster shape); LaunchError → exit 2."""
    from ..launcher import LaunchError, launch, resolve

    with warnings.catch_warnings(record=True) as notes:  # shown as the CLI shows its warnings
        warnings.simplefilter("always", IneffectiveSettingsWarning)
        distribution = read_distribution(args.config)
    for note in notes:
        print(f"shardwise {args.command}: warning: {note.message}", file=sys.stderr)
    try:
        shape = scheduler_shape(args)
        spec = resolve(script, script_args, **shape, hostfile=args.hostfile, run_dir=args.run_dir,
                       console_ranks=args.console_ranks, max_restarts=args.max_restarts,
                       processes_per_host=distribution.processes_per_host)
    except LaunchError as err:
        print(f"shardwise {args.command}: {err}", file=sys.stderr)
        return 2
    data = load_dict(distribution.parameters, overrides)
    # TailLog echoes rank 0 through our stdout; keep it live when stdout is a pipe.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    return launch(spec, data)


def scheduler_shape(args: argparse.Namespace) -> dict:
    """The shape flags, each one not given taken from a SLURM or PyTorchJob environment (not with a hostfile,
    which says the shape itself); the environment found is named on the console."""
    from ..launcher.environment import detect

    shape = {name: getattr(args, name) for name in ("nproc_per_node", "nnodes", "node_rank", "master_addr",
                                                    "master_port")}
    found = None if args.hostfile else detect(os.environ)
    if found is None:
        return shape
    print(f"shardwise {args.command}: launch environment: {found.describe()}; shape flags given win", flush=True)
    return {name: getattr(found, name) if value is None else value for name, value in shape.items()}


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.checkpoint_dir is not None:  # absolute: the ranks and every relaunch find the same directory
        overrides.append(f"checkpoint_dir={os.path.abspath(args.checkpoint_dir)}")
    return launch_from_args(args, args.script, args.script_args, overrides)
