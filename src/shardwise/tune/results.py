"""What a tuning run leaves: <results>/trials.jsonl (one line per trial, written as each ends), best_config.json
(the best trial's config, which `shardwise run --config` takes as it is), best_cmd.txt (the command that runs
it), summary.json (the planner's accuracy), and the table printed on the console."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table

from ..planner.hardware import GiB
from .tuner import TRIALS_FILE, TuneResult, TuneSettings

BEST_CONFIG_FILE = "best_config.json"
BEST_CMD_FILE = "best_cmd.txt"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "tune_report.html"  # written by report.py
RESULT_FILES = (BEST_CONFIG_FILE, BEST_CMD_FILE, SUMMARY_FILE, REPORT_FILE)


def best_command(settings: TuneSettings, config_path: Path, script_args: Sequence[str]) -> str:
    """The `shardwise run` of the best config (and the script's arguments in its trial); across nodes, the one every
    node runs with its own $NODE_RANK."""
    place = settings.place
    nodes = "" if place is None else (f" --nnodes {place.nnodes} --node-rank $NODE_RANK --master-addr "
                                      f"{shlex.quote(place.master_addr)} --master-port {place.master_port}")
    return (f"shardwise run --nproc-per-node {settings.nproc}{nodes} "
            + shlex.join(["--config", str(config_path.resolve()), settings.script, *script_args]))


def write_best_config(results: Path, config: dict[str, Any]) -> Path:
    """<results>/best_config.json holding `config` (left as it is when it already does: a shared file system)."""
    path = results / BEST_CONFIG_FILE
    text = json.dumps(config, indent=2) + "\n"
    if not (path.is_file() and path.read_text(encoding="utf-8") == text):
        results.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return path


def write_results(result: TuneResult, settings: TuneSettings) -> Optional[Path]:
    """best_config.json and best_cmd.txt when a trial was measured (their path, else None), and summary.json."""
    settings.results.mkdir(parents=True, exist_ok=True)
    summary = {"metric": settings.metric, "stopped": result.stopped, "best_trial": result.best and result.best["trial"],
               **asdict(result.accuracy), "planning": dict(settings.planning)}
    (settings.results / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if result.best is None:
        return None
    path = write_best_config(settings.results, result.best["config"])
    (settings.results / BEST_CMD_FILE).write_text(best_command(settings, path, result.best["script_args"]) + "\n",
                                                  encoding="utf-8")
    return path


def number(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def layout_text(row: dict[str, Any]) -> str:
    """A trial's degrees above 1 and its ZeRO stage, e.g. `dp_shard=2 zero3`."""
    shown = " ".join(f"{k}={v}" for k, v in row["layout"].items() if v != 1)
    stage = row["config"].get("zero_stage") or (1 if row["config"].get("shard_optimizer_state") else 0)
    return (shown or "one replica") + (f" zero{stage}" if stage else "")


COLUMNS = ("#", "plan", "layout", "pred s", "step s", "err", "pred GiB", "peak GiB", "err", "samples/s", "result")


def cells(row: dict[str, Any], best: Optional[dict[str, Any]]) -> list[str]:
    """One trial as the console table and the HTML report show it (COLUMNS)."""
    return [str(row["trial"]), str(row["plan_rank"]), layout_text(row),
            number(row["predicted_step_time_s"], ".4f"), number(row["measured_step_time_s"], ".4f"),
            number(row["step_time_error"], "+.0%"), number(row["predicted_memory_bytes"] / GiB, ".2f"),
            number(row["max_memory_bytes"] and row["max_memory_bytes"] / GiB, ".2f"),
            number(row["memory_error"], "+.0%"), number(row["samples_per_s"], ".1f"),
            "best" if best is row else ("ok" if row["failure"] is None else row["failure"])]


def trials_table(rows: Sequence[dict[str, Any]], best: Optional[dict[str, Any]]) -> Table:
    table = Table(title="trials (predicted vs measured; error = predicted / measured - 1)", title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("layout", "result") else "right")
    for row in rows:
        table.add_row(*cells(row, best))
    return table


def print_results(result: TuneResult, settings: TuneSettings, best_path: Optional[Path],
                  console: Optional[Console] = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    console.print(trials_table(result.rows, result.best))
    for row in result.rows:
        if row["failure"]:
            console.print(f"trial {row['trial']} {row['failure']}: {row['message']}", markup=False, highlight=False)
    a = result.accuracy
    console.print(f"planner: Spearman rho {number(a.spearman_step_time, '.2f')} over {a.trials} measured trials; "
                  f"regret of its pick {number(a.regret, '.2f')}; mean |error| step time "
                  f"{number(a.mean_abs_step_time_error, '.0%')}, memory {number(a.mean_abs_memory_error, '.0%')}",
                  markup=False, highlight=False)
    console.print(f"stopped: {result.stopped}", markup=False, highlight=False)
    if best_path is None:
        console.print(f"no trial was measured; see {settings.results / TRIALS_FILE}", markup=False, highlight=False)
    else:
        console.print(f"best ({settings.metric}): trial {result.best['trial']}; config {best_path}; run it with: "
                      f"{best_command(settings, best_path, result.best['script_args'])}", markup=False,
                      highlight=False, soft_wrap=True)
