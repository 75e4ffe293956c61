"""`shardwise check-config`: validate a config for a cluster shape without starting anything."""

from __future__ import annotations

import argparse
import sys
import warnings

from ..config import IneffectiveSettingsWarning, ineffective_notice, load_dict
from ..config import deepspeed
from ..config.sources import read_file
from ..topology import Cluster
from ..config.describe import describe_layout
from ..config.layout import validate


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="processes (devices) per node")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M", help="number of nodes")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-config", help="validate a config for a cluster shape and print its layout",
                       description="Validate a config for a cluster shape without starting anything, as `run` and "
                                   "`init` do; print the layout (degrees and the ranks of each group) or every "
                                   "error, and name the settings that have no effect in it. Exit 2 on error.")
    p.add_argument("config", nargs="?", help="JSON or YAML config file (omit for the defaults)")
    p.add_argument("--config", dest="config_flag", default=None, metavar="FILE",
                   help="the config file, as `shardwise run --config` takes it (a DeepSpeed config too)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable)")
    add_cluster_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """The validation `run` and `init` make; the layout on stdout, the no-effect notice `init` warns with on stderr."""
    cluster = Cluster(nodes=args.nnodes, devices_per_node=args.nproc_per_node)
    if args.config and args.config_flag:
        print("shardwise check-config: the config is given twice; fix: pass it as the argument or with --config",
              file=sys.stderr)
        return 2
    source = args.config or args.config_flag
    data = read_file(source) if source else {}
    translated = deepspeed.is_deepspeed(data)
    translation = deepspeed.translate(data) if translated else None
    if translation and not translation.problems:  # else validation below raises them, as init and run do
        print(deepspeed.describe(translation))
    with warnings.catch_warnings():
        if translated:  # what it cannot honour is in the section above, not repeated as a warning
            warnings.simplefilter("ignore", IneffectiveSettingsWarning)
        config, layout = validate(load_dict(data, args.overrides), cluster)
    print(describe_layout(config, layout, cluster))
    notice = ineffective_notice(config)
    if notice:
        print(f"shardwise check-config: warning: {notice}", file=sys.stderr)
    return 0
