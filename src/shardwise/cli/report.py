"""`shardwise report RUN_DIR`: write RUN_DIR/report.html from the metrics a run recorded."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write RUN_DIR/report.html: plots of a run's metrics, its layout and config",
                       description="Read the metrics a `shardwise run` recorded in its run directory (metrics/*.jsonl) "
                                   "and write RUN_DIR/report.html, one self-contained page with PNG plots of loss, "
                                   "step time and its breakdown, throughput, memory per rank and bytes per process "
                                   "group, the communication table, the layout and the config. Exit 2 on error.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory `shardwise run` printed")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..observe.report_data import ReportError

    try:
        from ..observe.report import write_report  # matplotlib (optional) loads only when the command runs

        path = write_report(args.run_dir)
    except (ReportError, ImportError) as err:
        print(f"shardwise report: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
