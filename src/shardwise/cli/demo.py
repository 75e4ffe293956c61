"""`shardwise demo`: train a small GPT-2 on 4 CPU processes with MiCS and activation
checkpointing, through `shardwise run`, to show the whole path working in under a minute."""

from __future__ import annotations

import argparse

from .flags import positive
from .run import add_launch_flags, launch_from_args

DEFAULT_NPROC = 4
# 4 ranks in ZeRO partition groups of 2: two sharded replicas (MiCS / ZeRO-2D).
DEFAULT_OVERRIDES = ["sharded_data_parallel_degree=2"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train a small GPT-2 on 4 CPU processes with MiCS (no downloads)",
        description="Train a randomly initialised 4-layer GPT-2 on synthetic data that it can learn, on "
                    f"{DEFAULT_NPROC} processes with sharded_data_parallel_degree=2 (MiCS: 2 partition groups of 2) "
                    "and activation checkpointing on every block, launched exactly like `shardwise run`. "
                    "--config replaces the default sharded_data_parallel_degree=2; --set adds to it.")
    add_launch_flags(p, default_nproc=str(DEFAULT_NPROC))
    demo = p.add_argument_group("training")
    demo.add_argument("--steps", type=positive(int), default=None, metavar="N", help="optimizer steps (default 40)")
    demo.add_argument("--batch-size", type=positive(int), default=None, metavar="B",
                      help="sequences per data-parallel rank per step (default 8)")
    demo.add_argument("--lr", type=positive(float), default=None, help="AdamW learning rate (default 3e-3)")
    p.set_defaults(handler=run)


def script_args(args: argparse.Namespace) -> list[str]:
    forwarded = []
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--lr", args.lr)):
        if value is not None:
            forwarded += [flag, str(value)]
    return forwarded


def run(args: argparse.Namespace) -> int:
    from ..demo import SCRIPT

    if args.nproc_per_node is None and args.hostfile is None:
        args.nproc_per_node = DEFAULT_NPROC
    overrides = ([] if args.config else DEFAULT_OVERRIDES) + list(args.overrides)
    return launch_from_args(args, str(SCRIPT), script_args(args), overrides)
