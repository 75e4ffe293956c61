"""A launch from parsed command-line flags (`shardwise run`, `shardwise demo`, `Job.fit`): the flags resolved, the
scheduler's environment filling the shape flags not given, then `launch`."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Sequence

from ..config import IneffectiveSettingsWarning
from ..config.sources import load_dict, read_distribution
from .environment import detect
from .errors import LaunchError
from .resources import DEEPSPEED_ONLY
from .runner import launch
from .spec import resolve


def launch_from_args(args: argparse.Namespace, script: str, script_args: Sequence[str],
                     overrides: Sequence[str]) -> int:
    """Resolve flags, then launch (which validates the config for the cluster shape); LaunchError → exit 2."""
    with warnings.catch_warnings(record=True) as notes:  # shown as the CLI shows its warnings
        warnings.simplefilter("always", IneffectiveSettingsWarning)
        distribution = read_distribution(args.config)
    for note in notes:
        print(f"shardwise {args.command}: warning: {note.message}", file=sys.stderr)
    try:
        if getattr(args, "flag_conflicts", None):
            raise LaunchError(args.flag_conflicts[0])
        shape = scheduler_shape(args)
        spec = resolve(script, script_args, **shape, hostfile=args.hostfile, run_dir=args.run_dir,
                       console_ranks=args.console_ranks, max_restarts=args.max_restarts,
                       processes_per_host=distribution.processes_per_host, **deepspeed_selection(args))
    except LaunchError as err:
        print(f"shardwise {args.command}: {err}", file=sys.stderr)
        return 2
    data = load_dict(distribution.parameters, overrides)
    # TailLog echoes rank 0 through our stdout; keep it live when stdout is a pipe.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    return launch(spec, data)


def deepspeed_selection(args: argparse.Namespace) -> dict:
    """DeepSpeed's launcher flags as `resolve` takes them (none on `demo`, which has no such flags)."""
    if not hasattr(args, "include"):
        return {}
    deepspeed = any(getattr(args, name) not in (None, False) for name in DEEPSPEED_ONLY)
    return {"include": args.include, "exclude": args.exclude, "num_nodes": args.num_nodes, "num_gpus": args.num_gpus,
            "local_rank_arg": (args.pass_local_rank or deepspeed) and not args.no_local_rank}


def scheduler_shape(args: argparse.Namespace) -> dict:
    """The shape flags, each one not given taken from a SLURM or PyTorchJob environment (not with a hostfile,
    which says the shape itself); the environment found is named on the console."""
    shape = {name: getattr(args, name) for name in ("nproc_per_node", "nnodes", "node_rank", "master_addr",
                                                    "master_port")}
    found = None if args.hostfile or getattr(args, "include", None) or getattr(args, "exclude", None) else detect(
        os.environ)
    if found is None:
        return shape
    print(f"shardwise {args.command}: launch environment: {found.describe()}; shape flags given win", flush=True)
    return {name: getattr(found, name) if value is None else value for name, value in shape.items()}
