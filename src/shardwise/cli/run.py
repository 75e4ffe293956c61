"""`shardwise run`: launch a training script on this node's ranks (torchrun underneath)."""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from .flags import positive


class _Given(argparse.Action):
    """Store a flag's value; the same flag or an alias of it given again with another value is a conflict, which
    `launch_from_args` reports in one line before anything starts (argparse would keep the last silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("given_flags", {})
        first = given.setdefault(self.dest, (option_string, values))
        if first[1] != values:
            namespace.__dict__.setdefault("flag_conflicts", []).append(
                f"{first[0]}={first[1]} and {option_string}={values} disagree; fix: give one of them")
        setattr(namespace, self.dest, values)


def add_launch_flags(p: argparse.ArgumentParser, default_nproc: str = "the config's mpi.processes_per_host, else the "
                     "accelerators on this node, else 1") -> None:
    """Flags shared by `run` and `demo`: cluster shape, rendezvous, config, run directory. The shape flags also
    take torchrun's and DeepSpeed's underscore spellings (--nproc_per_node, --node_rank, --master_addr, ...)."""
    shape = p.add_argument_group("cluster")
    shape.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, metavar="N", action=_Given,
                       help=f"processes on this node (default: {default_nproc})")
    shape.add_argument("--nnodes", type=int, default=None, metavar="M", action=_Given,
                       help="number of nodes (default 1)")
    shape.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R", action=_Given,
                       help="this node's index, 0..M-1")
    shape.add_argument("--master-addr", "--master_addr", default=None, metavar="ADDR", action=_Given,
                       help="address of node 0 (multi-node)")
    shape.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT", action=_Given,
                       help="rendezvous port (default 29500)")
    shape.add_argument("-H", "--hostfile", default=None, metavar="FILE", action=_Given,
                       help="DeepSpeed's hostfile, 'host slots=N' lines; sets --nnodes, --nproc-per-node, "
                            "--master-addr and this node's rank from its hostname (run the same command on every "
                            "host; no ssh)")
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


def add_deepspeed_flags(p: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher flags (`deepspeed --num_gpus 4 train.py ...` runs as `shardwise run --num_gpus 4
    train.py ...`), in its spellings and the dashed ones."""
    ds = p.add_argument_group(
        "DeepSpeed's launcher flags",
        "As `deepspeed` takes them. On a node without accelerators there are no devices to pick: --include, "
        "--exclude and --num_gpus only set how many processes start there.")
    ds.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", "--num-accelerators", type=positive(int),
                    default=None, metavar="G", action=_Given,
                    help="processes per node, on devices 0..G-1 of each (with --hostfile: of each host's slots)")
    ds.add_argument("--num_nodes", "--num-nodes", type=positive(int), default=None, metavar="M", action=_Given,
                    help="with --hostfile, run on its first M hosts; without, the same as --nnodes")
    ds.add_argument("-i", "--include", default=None, metavar="SPEC", action=_Given,
                    help="only these hosts and slots: NAME[:SLOT[,SLOT ...]][@NAME...], e.g. 'worker-0@worker-1:0,2' "
                         "(all of worker-0, slots 0 and 2 of worker-1); without --hostfile the host is 'localhost'. "
                         "A node's selected slots become its ranks' devices (CUDA_VISIBLE_DEVICES or the "
                         "accelerator's own variable)")
    ds.add_argument("-e", "--exclude", default=None, metavar="SPEC", action=_Given,
                    help="every host and slot but these (same syntax as --include, and not with it)")
    ds.add_argument("--no_ssh", "--no-ssh", action="store_true",
                    help="accepted: shardwise never uses ssh; run the same command on every node")
    ds.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                    help="do not pass --local_rank to the script")
    ds.add_argument("--pass-local-rank", action="store_true",
                    help="pass --local_rank=<local rank> before the script's arguments, as DeepSpeed's launcher does; "
                         "on by itself when a flag of this group but --no_local_rank is given")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="launch a training script on this node's ranks",
        description="Validate the config for the cluster shape, then start the script on every rank of this node "
                    "through torchrun's agent. Each rank's stdout and stderr go to <run-dir>/logs/rank<R>/; rank 0 "
                    "is echoed here. Exits with the first failing rank's exit code and shows its last log lines.")
    add_launch_flags(p)
    add_deepspeed_flags(p)
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="the config's checkpoint_dir: where a preempted job (SIGTERM) saves, and where the script "
                        "finds the newest complete checkpoint to resume from after a restart")
    tuning = p.add_argument_group("autotuning", "DeepSpeed's launcher flag: `shardwise tune` first, on this node's "
                                                 "ranks or with the node flags across nodes (docs/tune.md)")
    tuning.add_argument("--autotuning", choices=("tune", "run"), default=None,
                        help="tune: run the planner's best layouts for a few steps each and write the results "
                             "(best_config.json ...); run: tune, then train with the best config")
    tuning.add_argument("--model", default=None, metavar="MODEL",
                        help="with --autotuning: the model the script trains, as `shardwise plan --model` takes it")
    p.add_argument("script", help="the training script (run as `python -u script ...` on every rank)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=run)


def launch_from_args(args: argparse.Namespace, script: str, script_args: Sequence[str],
                     overrides: Sequence[str]) -> int:
    """The launcher's `launch_from_args`, imported when called: the launcher loads torch, `shardwise plan` must not."""
    from ..launcher.from_args import launch_from_args as launch

    return launch(args, script, script_args, overrides)


def run(args: argparse.Namespace) -> int:
    if args.autotuning or args.model:
        from .tune import autotune  # the tuner, only when asked for

        return autotune(args)
    overrides = list(args.overrides)
    if args.checkpoint_dir is not None:  # absolute: the ranks and every relaunch find the same directory
        overrides.append(f"checkpoint_dir={os.path.abspath(args.checkpoint_dir)}")
    return launch_from_args(args, args.script, args.script_args, overrides)
