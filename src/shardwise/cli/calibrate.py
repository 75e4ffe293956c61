"""`shardwise calibrate RESULTS`: the planner's constants for this cluster fitted to a tuning run's measured
trials, written as a cluster file `shardwise plan --cluster FILE` reads (docs/tune.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..planner import PlanError
from ..tune.calibrate import calibrate_results, planning_inputs
from .tune import print_calibration


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the planner's constants for this cluster to a tuning run's measurements",
        description="Fit the constants the planner takes from the cluster (sustained FLOP/s, memory bandwidth, "
                    "collective bandwidth and latency inside a node, and between nodes on several; the host time "
                    "of each communication op a rank waits on, where the trials issue such ops) to the step "
                    "times a `shardwise tune` run measured, print each trial's prediction before and after, and "
                    "write a cluster file that "
                    "`shardwise plan --cluster FILE` and `shardwise tune --cluster FILE` read. Exit 2 on bad input.")
    p.add_argument("results", help="the --results directory of a `shardwise tune` run")
    p.add_argument("--out", metavar="FILE", help="the cluster file to write (default <results>/cluster.json)")
    p.add_argument("--held-out", action="store_true",
                   help="also predict each trial from a fit on the others (one fit per trial)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    results = Path(args.results)
    planning = planning_inputs(results)
    if not planning.get("model"):
        print(f"shardwise calibrate: {results}/summary.json does not say what was planned (an older or unfinished "
              "tuning run); run `shardwise tune` again", file=sys.stderr)
        return 2
    try:
        fitted = calibrate_results(results, planning, Path(args.out) if args.out else None, args.held_out)
    except (PlanError, FileNotFoundError, ValueError) as err:
        print(f"shardwise calibrate: {err}", file=sys.stderr)
        return 2
    print_calibration(*fitted)
    return 0
