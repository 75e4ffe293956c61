"""`shardwise` command line: one module per subcommand, each exposing `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from ..checkpoint import CheckpointError
from ..errors import ConfigError

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ["check_config", "run", "demo", "plan", "tune", "calibrate", "export", "report"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Train large PyTorch models across devices and nodes by changing a config.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ConfigError, CheckpointError) as err:
        print(f"shardwise {args.command}: {err}", file=sys.stderr)
        return 2
