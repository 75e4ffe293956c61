"""How a plan is shown: a ranked rich table, `--explain` details, JSON, and the best config as a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import yaml
from rich.console import Console
from rich.table import Table

from ..config.recompute import split_policy
from .errors import PlanError
from .hardware import GiB
from .search import Evaluation, Plan
from .wrapping import sharding_ranks

_MEMORY_COLUMNS = ("parameters", "gradients", "optimizer", "activations", "other", "total")


def strategy(e: Evaluation) -> str:
    """Short name of the data-parallel strategy: DDP, ZeRO-k, or MiCS (ZeRO-k in groups of g)."""
    layout, stage = e.layout, e.zero_stage
    if layout.dp * layout.cp == 1:  # cp ranks reduce gradients (and shard) as replicas do
        return "-"
    if stage == 0:
        return "DDP"
    if stage >= 2 and layout.dp_replicate > 1:
        return f"MiCS ZeRO-{stage}/{sharding_ranks(layout)}"  # partition groups span the cp ranks
    return f"ZeRO-{stage}"


def checkpointing_call(strategy: str) -> str:
    """A plan's checkpointing strategy as the call a training script makes (groups need an nn.Sequential)."""
    strategy, policy = split_policy(strategy)
    if strategy == "none":
        return "none"
    selective = f', policy="{policy}"' if policy else ""
    return f'sw.set_activation_checkpointing(blocks, strategy="{strategy}"{selective})'


def _sharding(e: Evaluation) -> str:
    """`strategy`, `hpZ n` added under ZeRO++ hpZ, `EP n` under expert parallelism, `local` where ZeRO-1's
    microbatches add up on each rank (accumulate_gradients_locally), `offload` when the optimizer's states live in
    host memory."""
    hpz, ep = e.config.get("zero_hpz_partition_size", 1), e.config.get("expert_parallel_degree", 1)
    return (strategy(e) + (f" hpZ {hpz}" if hpz > 1 else "") + (f" EP {ep}" if ep > 1 else "")
            + (" local" if e.config.get("accumulate_gradients_locally") else "")
            + (" offload" if e.config.get("offload_optimizer_state") else ""))


def _sequence_keys(e: Evaluation) -> list[str]:
    """The sequence-parallel keys the config sets: sequence_parallel, and sequence_parallel_regather with it."""
    if not e.config.get("sequence_parallel"):
        return []
    return ["sequence_parallel"] + (["sequence_parallel_regather"] if e.config.get("sequence_parallel_regather")
                                    else [])


def _tensor_parallel(e: Evaluation) -> str:
    """The tensor-parallel degree, `sp` added with sequence parallelism (`sp regather` gathering its inputs again
    in backward)."""
    return f"{e.layout.tp}" + ("", " sp", " sp regather")[len(_sequence_keys(e))]


def _context_parallel(e: Evaluation) -> str:
    """The context-parallel degree and its mode (`a2a`: all-to-all); `-` without it."""
    if e.layout.cp == 1:
        return "-"
    return f"{e.layout.cp} " + ("a2a" if e.config.get("context_parallel_mode") == "all_to_all" else "ring")


def _microbatching(e: Evaluation) -> str:
    text = f"{e.micro_batch}×{e.config.get('microbatches', 1)}"
    return text + (" off" if e.config.get("offload_activations") else "")


def _title(plan: Plan) -> str:
    spec, cluster = plan.spec, plan.cluster
    return (f"{spec.name} ({spec.parameters / 1e9:.2f}B parameters) on {cluster.name} "
            f"({cluster.world_size} × {cluster.device.name}), global batch {plan.global_batch} × seq {plan.seq}, "
            f"{plan.precision}: {len(plan.fitting)} of {len(plan.considered)} layouts fit")


def ranked_table(plan: Plan, top: int) -> Table:
    """The `top` fitting layouts: degrees, memory per rank by category (GiB), step time, throughput."""
    table = Table(title=_title(plan), title_justify="left")
    for name in ("#", "tp", "cp", "pp", "dp rep×shard", "sharding", "ckpt", "mb×m"):
        table.add_column(name, justify="left" if name in ("sharding", "ckpt", "mb×m") else "right")
    for name in ("params", "grads", "optim", "act", "other", "total GiB", "step s", "tokens/s", "MFU"):
        table.add_column(name, justify="right")
    for i, e in enumerate(plan.fitting[:top], 1):
        memory = e.memory.summary()
        table.add_row(str(i), _tensor_parallel(e), _context_parallel(e), str(e.layout.pp),
                      f"{e.layout.dp_replicate}×{e.layout.dp_shard}",
                      _sharding(e), e.checkpointing, _microbatching(e),
                      *(f"{memory[k] / GiB:.1f}" for k in _MEMORY_COLUMNS),
                      f"{e.step_time:.3f}", f"{e.time.tokens_per_s:,.0f}", f"{e.time.mfu:.0%}")
    return table


def _time_table(plan: Plan, top: int) -> Table:
    """Where each fitting layout's step time goes, so it is clear why one is slower than another."""
    table = Table(title="step time by part (seconds)", title_justify="left")
    table.add_column("#", justify="right")
    parts = list(plan.fitting[0].time.parts()) if plan.fitting else []
    for name in parts:
        table.add_column(name.replace("_", " "), justify="right")
    for i, e in enumerate(plan.fitting[:top], 1):
        table.add_row(str(i), *(f"{v:.3f}" for v in e.time.parts().values()))
    return table


def _collectives_table(e: Evaluation) -> Table:
    table = Table(title="collectives of #1 per step (volume per rank, time before overlap)", title_justify="left")
    for name in ("collective", "axis", "GiB", "link", "seconds"):
        table.add_column(name, justify="left" if name in ("collective", "axis", "link") else "right")
    for c in e.time.collectives:
        table.add_row(c.name, c.axis, f"{c.bytes_per_step / GiB:.2f}", c.link, f"{c.seconds:.3f}")
    return table


def _degrees(e: Evaluation) -> str:
    return " ".join([*(f"{k}={v}" for k, v in e.layout.degrees().items()), *_sequence_keys(e)])


def print_plan(plan: Plan, top: int, explain: bool, console: Optional[Console] = None) -> None:
    """The ranked table; with `explain`, the time breakdown, #1's collectives and every rejection."""
    # Piped or captured output gets a wide table rather than rich's 80-column default.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    console.print(ranked_table(plan, top))
    if not plan.fitting:
        console.print("No layout fits; run with --explain to see why each fails.")
    if not explain:
        return
    if plan.fitting:
        console.print(_time_table(plan, top))
        console.print(_collectives_table(plan.fitting[0]))
    rejected = [e for e in plan.considered if not e.fits]
    console.print(f"rejected layouts ({len(rejected)}):")
    for e in rejected:
        console.print(f"  {_degrees(e)} {_sharding(e)} ckpt={e.checkpointing}: {e.reason}",
                      markup=False, highlight=False)


def to_json(plan: Plan) -> list[dict]:
    """One object per layout considered, in rank order; `config` is runnable as is."""
    rows = []
    for e in plan.considered:
        row = {"config": e.config, "layout": e.layout.degrees(), "activation_checkpointing": e.checkpointing,
               "batch_size": e.batch_size, "micro_batch": e.micro_batch or None,
               "memory_bytes": e.memory.summary() if e.memory else None,
               "memory_detail_bytes": e.memory.detail() if e.memory else None,
               "step_time_s": e.time.total if e.time else None,
               "step_time_parts_s": e.time.parts() if e.time else None,
               "tokens_per_s": e.time.tokens_per_s if e.time else None,
               "mfu": e.time.mfu if e.time else None,
               "fits": e.fits}
        if not e.fits:
            row["reason"] = e.reason
        rows.append(row)
    return rows


def config_format(path: str) -> str:
    """'json' or 'yaml' from the file name, checked before planning so a typo fails fast."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise PlanError(f"--out {path!r}: use a .json, .yaml or .yml file name")
    return "json" if suffix == ".json" else "yaml"


def write_config(e: Evaluation, path: str) -> None:
    """The config of `e` as JSON (.json) or YAML (.yaml, .yml)."""
    if config_format(path) == "json":
        text = json.dumps(e.config, indent=2) + "\n"
    else:
        text = yaml.safe_dump(e.config, sort_keys=False)
    Path(path).write_text(text, encoding="utf-8")
