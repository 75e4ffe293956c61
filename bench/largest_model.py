"""The largest GPT-2 each layout trains on this machine, found by search, against the planner's prediction.

    python bench/largest_model.py [--layouts DDP,ZeRO-3,...] [--variants plain,checkpointing,offload]
                                  [--depths 6,12,24,48] [--widths 512,768,1024,1536,2048] [--seq 64]
                                  [--steps 2] [--memory-gib GiB] [--json FILE] [--plot FILE] [--smoke]
                                  [--replan FILE]

Layouts run on 4 gloo CPU ranks: DDP, ZeRO-1, ZeRO-2, ZeRO-3, MiCS 2×2, TP 2 and
PP 2 (each beside data parallelism over the other ranks). Variants: plain; every
block activation-checkpointed; checkpointed with offloading (the inputs the
checkpointed regions keep, and the optimizer's states where the layout shards
them). Every model is built under delayed initialisation, so each rank
materialises only what it keeps, and trains `--steps` steps of AdamW in fp32 on
2 sequences per data-parallel rank.

A model fits when it trains with every rank's peak resident memory within an
equal share of the machine's memory (what the planner's `local` preset gives each
rank). Each trial runs in fresh processes, once the machine has room for every
rank's share, under a watchdog that stops it as soon as a rank exceeds its share
or the machine runs short of memory (then other processes took it, and the trial
runs again). The grid's
models (depth × width) are sorted by parameter count and searched, assuming a
larger model never needs less memory: first where the planner predicts the
largest fitting model, then in steps doubling away from it until the
boundary is bracketed, then by bisection.

On a CPU device host and device memory are one, so offloading saves nothing
(the runtime says so, and the planner predicts the same). The bytes each offload
option moves per step are counted anyway, for the largest model its variant
trained, beside the planner's count: what an accelerator would copy. Activations
are counted from the offload schedule's moves. ZeRO-1's count is its fp32 masters,
whose gradients go to the host and whose values come back. FSDP2's count comes
from its gathers (each rank's shards copied to the device) and its
reduce-scatters (gradient shards copied back).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

import psutil

from shardwise.config import parse_config
from shardwise.planner import cluster_preset, predict_memory, spec_from_hf
from shardwise.planner.offload import activation_transfers, state_transfers
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster

RANKS = 4
ROWS = 2  # sequences per data-parallel rank and step: PP 2 splits them into 2 microbatches
VOCAB = 50257
GiB = 2 ** 30
LAYOUTS = {
    "DDP": {},
    "ZeRO-1": {"shard_optimizer_state": True},
    "ZeRO-2": {"zero_stage": 2, "sharded_data_parallel_degree": RANKS},
    "ZeRO-3": {"sharded_data_parallel_degree": RANKS},
    "MiCS 2×2": {"sharded_data_parallel_degree": 2},
    "TP 2": {"tensor_parallel_degree": 2},
    "PP 2": {"pipeline_parallel_degree": 2, "microbatches": 2},
}
VARIANTS = ("plain", "checkpointing", "offload")
DESCRIBED = {"plain": "plain", "checkpointing": "checkpointing", "offload": "checkpointing + offloading"}
MACHINE_RESERVE = 1.5 * GiB  # a trial stops when the machine has less than this available
SHORT = f"the machine had under {MACHINE_RESERVE / GiB:.1f} GiB available"
ATTEMPTS = 3  # a trial stopped because other processes held the machine's memory runs again, after they let go


@dataclass(frozen=True)
class Cell:
    depth: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.depth}×{self.width}"

    def hf_config(self, seq: int) -> dict:
        return dict(n_layer=self.depth, n_embd=self.width, n_head=self.width // 64, vocab_size=VOCAB,
                    n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def spec(self, seq: int):
        return spec_from_hf({"model_type": "gpt2", **self.hf_config(seq)}, f"gpt2 {self.name}")


def config_of(layout: str, variant: str) -> dict:
    """The config keys of one layout and variant: offload adds the optimizer's states where the layout shards."""
    config = {**LAYOUTS[layout], "delayed_parameter_initialization": True}
    if variant == "offload":
        config["offload_activations"] = True
        if parse_config(config).effective_zero_stage:
            config["offload_optimizer_state"] = True
    return config


def checkpointing_of(variant: str) -> str:
    return "none" if variant == "plain" else "each"


# ------------------------------------------------------------------------------------------ one trial, per rank

def _counting_mover():
    from shardwise.parallel.recompute.offload import StayOnDevice

    class Counting(StayOnDevice):
        """Keeps tensors where they are (a CPU device) and counts what an accelerator would copy."""

        def __init__(self):
            self.to_host = self.to_device = 0

        def store(self, tensor):
            self.to_host += tensor.nbytes
            return tensor

        def fetch(self, stored):
            self.to_device += stored.nbytes
            return stored

    return Counting()


def _state_moves(model, optimizer, collectives: dict[str, list[int]], shard: int) -> dict[str, int]:
    """Bytes offloaded optimizer states moved in the step `collectives` counted: FSDP2's shards (a gather's
    output over the group, its input) to the device, gradient shards (a reduce-scatter's output) back;
    ZeRO-1's masters' gradients to the host and values back."""
    params = {id(p) for p in model.parameters()}
    masters = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in params]
    if masters:
        nbytes = sum(p.nbytes for p in masters)
        return {"to_device": nbytes, "to_host": nbytes}
    gathered, scattered = (collectives.get(f"{op}/{shard}", [0, 0])[1] for op in ("all-gather", "reduce-scatter"))
    return {"to_device": gathered // shard, "to_host": scattered // shard}


@dataclass
class Training:
    """One rank's model, optimizer and batches, ready to step."""

    model: object
    optimizer: object
    batches: list
    mover: Optional[object]   # the activation offload's counting mover, if the variant offloads
    train_step: Callable

    def step(self, ids) -> float:
        self.optimizer.zero_grad()
        out = self.train_step(self.model, ids)
        self.optimizer.step()
        return out.reduce_mean().item() if out.holds_loss else float("nan")


def prepare(spec: dict, mark: Callable[[str], None] = lambda phase: None) -> Training:
    """Initialise shardwise with the trial's config, build the model under delayed initialisation, wrap it
    and its optimizer; `mark` is told as each phase ends (init, build, wrap, optimizer)."""
    import torch
    import torch.nn.functional as F
    import transformers
    from torch.utils.data import TensorDataset

    import shardwise as sw
    from shardwise.api.recompute import runtime_offload
    from shardwise.runtime.state import current

    sw.init(spec["config"])
    mark("init")
    cell = Cell(**spec["cell"])
    with sw.delay_param_initialization():
        module = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cell.hf_config(spec["seq"])))
    mark("build")
    model = sw.DistributedModel(module)
    if spec["checkpointing"]:
        for block in model.get_module().transformer.h:
            sw.set_activation_checkpointing(block)
    mark("wrap")
    schedule = runtime_offload(current())
    mover = None
    if schedule is not None:
        mover = schedule.mover = _counting_mover()
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    mark("optimizer")

    @sw.step
    def train_step(model, ids):
        logits = model(ids)["logits"]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        model.backward(loss)
        return loss

    ids = torch.randint(0, VOCAB, (spec["steps"] * ROWS * sw.dp_size(), spec["seq"]),
                        generator=torch.Generator().manual_seed(0))
    batches = [batch for (batch,) in sw.data_loader(TensorDataset(ids), batch_size=ROWS, shuffle=False)]
    return Training(model, optimizer, batches, mover, train_step)


def trial(spec: dict, out: str) -> None:
    """One rank: build the model, train the steps, write peak memory, losses and bytes moved."""
    import shardwise as sw
    from measure import collectives

    baseline = {}  # the process before the model: Python, torch, the process group
    run = prepare(spec, lambda phase: baseline.setdefault(phase, psutil.Process().memory_info().rss))
    config = spec["config"]
    losses = [run.step(batch) for batch in run.batches[:-1]]
    if run.mover is not None:
        run.mover.to_host = run.mover.to_device = 0
    counts = collectives(lambda: losses.append(run.step(run.batches[-1])))
    moved = {"activations": {"to_device": run.mover.to_device, "to_host": run.mover.to_host} if run.mover else None,
             "optimizer": (_state_moves(run.model, run.optimizer, counts,
                                        parse_config(config).sharded_data_parallel_degree)
                           if config.get("offload_optimizer_state") else None)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(out, f"rank{sw.rank()}.json").write_text(json.dumps({"peak": peak, "baseline": baseline["init"],
                                                               "losses": losses, "moved": moved}))
    sw.shutdown()


# ------------------------------------------------------------------------------------------ trials, from the parent

@dataclass
class Outcome:
    cell: str
    params: int
    fits: bool
    peak: float                  # most resident bytes of one rank (as far as the trial got)
    predicted: float             # the planner's total for one rank
    baseline: float              # most resident bytes of one rank before it built the model (0: stopped before)
    seconds: float
    reason: str = ""
    moved: Optional[dict] = None  # rank 0's counted bytes


class TrialError(RuntimeError):
    """A trial failed for a reason other than memory."""


def _watch(process: subprocess.Popen, capacity: float, timeout: float) -> tuple[float, str]:
    """Poll the ranks' resident memory until `process` ends; stop it and its ranks (torchrun starts each in a
    session of its own) when a rank exceeds `capacity`, the machine runs short, or `timeout` passes. (the most
    any rank held, why it was stopped or "")."""
    start, peak, reason, ranks = time.monotonic(), 0.0, "", []
    parent = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            ranks = parent.children(recursive=True) or ranks
            rss = max((rank.memory_info().rss for rank in ranks), default=0)
        except psutil.NoSuchProcess:
            rss = 0
        peak = max(peak, rss)
        if rss > capacity:
            reason = f"a rank reached {rss / GiB:.2f} GiB"
        elif psutil.virtual_memory().available < MACHINE_RESERVE:
            reason = SHORT
        elif time.monotonic() - start > timeout:
            reason = f"not done after {timeout:.0f} s"
        if reason:
            os.killpg(process.pid, signal.SIGKILL)
            for rank in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.kill()
            process.wait()
            break
        time.sleep(0.1)
    return peak, reason


def _wait_for_room(needed: float, limit: float) -> None:
    """Wait, up to `limit` seconds, until the machine has `needed` bytes available: other users come and go."""
    deadline = time.monotonic() + limit
    while psutil.virtual_memory().available < needed and time.monotonic() < deadline:
        time.sleep(10)


def run_trial(layout: str, variant: str, cell: Cell, args, predicted: float) -> Outcome:
    """One trial, once the machine has room for every rank's share; one that other processes' memory stopped
    is no measurement and runs again."""
    for _ in range(ATTEMPTS):
        _wait_for_room(RANKS * args.capacity + MACHINE_RESERVE, args.trial_timeout)
        outcome = _attempt(layout, variant, cell, args, predicted)
        if outcome.reason != SHORT:
            return outcome
        print(f"  {layout} {variant} {cell.name}: stopped, {SHORT}; once more", flush=True)
    raise TrialError(f"{layout} {variant} {cell.name}: {SHORT} in {ATTEMPTS} attempts: other processes held it")


def _attempt(layout: str, variant: str, cell: Cell, args, predicted: float) -> Outcome:
    spec = {"config": config_of(layout, variant), "cell": asdict(cell), "seq": args.seq, "steps": args.steps,
            "checkpointing": variant != "plain"}
    params = cell.spec(args.seq).parameters
    with tempfile.TemporaryDirectory(prefix="largest-model-") as out:
        log = Path(out, "log.txt")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
                   __file__, "--trial", json.dumps(spec), "--out", out]
        start = time.monotonic()
        with open(log, "w") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            watched, reason = _watch(process, args.capacity, args.trial_timeout)
        seconds = time.monotonic() - start
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        if not reason and (process.returncode != 0 or len(ranks) != RANKS):
            tail = log.read_text()[-3000:]
            if any(sign in tail for sign in ("MemoryError", "out of memory", "SIGKILL")):
                reason = "ran out of memory"
            else:
                raise TrialError(f"{layout} {variant} {cell.name}: exit {process.returncode}\n{tail}")
    peak = max([watched, *(r["peak"] for r in ranks)])
    if not reason and peak > args.capacity:
        reason = f"a rank reached {peak / GiB:.2f} GiB"
    baseline = max((r["baseline"] for r in ranks), default=0)
    return Outcome(cell.name, params, not reason, peak, predicted, baseline, seconds, reason,
                   ranks[0]["moved"] if ranks and not reason else None)


def search(count: int, first: int, fits: Callable[[int], bool]) -> tuple[Optional[int], list[int]]:
    """The largest index below `count` that fits, for a `fits` true up to some index and false after it: probe
    `first` (clamped), then gallop towards the boundary (1, 2, 4… steps from the last probe) until it is
    bracketed, then bisect. (that index or None, the probes). A prediction off by k costs about 2·log2(k) + 2
    trials, an exact one two."""
    lo, hi, probes = -1, count, []

    def probe(index: int) -> bool:
        nonlocal lo, hi
        probes.append(index)
        if fits(index):
            lo = index
        else:
            hi = index
        return lo == index

    index = min(max(first, 0), count - 1)
    up, step = probe(index), 1
    while hi - lo > 1:
        index = min(index + step, hi - 1) if up else max(index - step, lo + 1)
        if probe(index) != up:
            break
        step *= 2
    while hi - lo > 1:
        probe((lo + hi) // 2)
    return (lo if lo >= 0 else None), probes


def prediction(layout: str, variant: str, cell: Cell, args, fixed_mmap_threshold: bool = False):
    """The planner's MemoryBreakdown for one rank (the `local` device: this machine's memory shared by the ranks;
    `fixed_mmap_threshold`: its ranks run with glibc's mmap threshold fixed)."""
    parsed = parse_config(config_of(layout, variant))
    micro = ROWS // parsed.microbatches * parsed.tensor_parallel_degree  # a TP group trains its ranks' rows
    preset = cluster_preset("local", devices_per_node=RANKS, fixed_mmap_threshold=fixed_mmap_threshold)
    device = replace(preset.device, memory_bytes=args.capacity)
    return predict_memory(cell.spec(args.seq), parsed, layout_for(parsed, Cluster(1, RANKS)), micro, args.seq,
                          checkpointing_of(variant), device)


def predicted_total(layout: str, variant: str, cell: Cell, args) -> float:
    return prediction(layout, variant, cell, args).total


def planned_moves(layout: str, variant: str, cell: Cell, args) -> dict:
    """The planner's bytes moved per step for the offload options, as on an accelerator (device None)."""
    parsed = parse_config(config_of(layout, variant))
    shape = layout_for(parsed, Cluster(1, RANKS))
    micro = ROWS // parsed.microbatches * parsed.tensor_parallel_degree
    spec = cell.spec(args.seq)
    return {"activations": activation_transfers(spec, parsed, shape, micro, args.seq, checkpointing_of(variant),
                                                None)._asdict(),
            "optimizer": state_transfers(spec, parsed, shape, None)._asdict()}


def planner_largest(layout: str, variant: str, cells: list[Cell], args) -> tuple[list[float], int]:
    """The planner's total for every model of the grid, and the index of the largest that fits (-1: none)."""
    predicted = [predicted_total(layout, variant, cell, args) for cell in cells]
    return predicted, max((i for i, total in enumerate(predicted) if total <= args.capacity), default=-1)


def _planner_columns(layout: str, variant: str, cells: list[Cell], planner: int, args) -> dict:
    return {"planner": cells[planner].name if planner >= 0 else None,
            "planner_params": cells[planner].spec(args.seq).parameters if planner >= 0 else 0}


def largest(layout: str, variant: str, cells: list[Cell], args) -> dict:
    """Search the grid for one layout and variant; the planner's largest fitting model beside it."""
    predicted, planner = planner_largest(layout, variant, cells, args)
    outcomes: dict[int, Outcome] = {}

    def fits(index: int) -> bool:
        try:
            outcome = run_trial(layout, variant, cells[index], args, predicted[index])
        except TrialError as err:  # once more, in case the failure was the machine's (a rendezvous port taken)
            print(f"  {layout} {variant} {cells[index].name}: failed, trying once more; its log ends:\n"
                  + "\n".join(str(err).splitlines()[-15:]), flush=True)
            outcome = run_trial(layout, variant, cells[index], args, predicted[index])
        outcomes[index] = outcome
        print(f"  {layout} {variant} {outcome.cell}: {'fits' if outcome.fits else 'does not fit'} "
              f"(peak {outcome.peak / GiB:.2f} GiB, planner {outcome.predicted / GiB:.2f} GiB, "
              f"{outcome.seconds:.0f} s){' — ' + outcome.reason if outcome.reason else ''}", flush=True)
        return outcome.fits

    row = {"layout": layout, "variant": variant, **_planner_columns(layout, variant, cells, planner, args)}
    try:
        found, probes = search(len(cells), planner, fits)
    except TrialError as err:
        first, *log = str(err).splitlines()
        return {**row, "error": first, "log": log[-40:], "trials": [asdict(o) for o in outcomes.values()]}
    row.update(largest=cells[found].name if found is not None else None,
               params=cells[found].spec(args.seq).parameters if found is not None else 0,
               trials=[asdict(outcomes[i]) for i in probes])
    if found is not None and variant == "offload":
        row.update(moved=outcomes[found].moved, planned_moves=planned_moves(layout, variant, cells[found], args))
    return row


def replan(row: dict, cells: list[Cell], args) -> dict:
    """A saved row with its planner columns recomputed by the planner as it is now: its largest model, its
    total for each trial, and its bytes moved for the largest model trained."""
    layout, variant = row["layout"], row["variant"]
    predicted, planner = planner_largest(layout, variant, cells, args)
    by_name = {cell.name: total for cell, total in zip(cells, predicted)}
    row = {**row, **_planner_columns(layout, variant, cells, planner, args),
           "trials": [{**t, "predicted": by_name[t["cell"]]} for t in row["trials"]]}
    if "planned_moves" in row:
        found = next(cell for cell in cells if cell.name == row["largest"])
        row["planned_moves"] = planned_moves(layout, variant, found, args)
    return row


# ------------------------------------------------------------------------------------------ report

def _millions(params: int) -> str:
    return f"{params / 1e6:,.0f}M"


def table(rows: list[dict]) -> str:
    lines = ["| layout | variant | largest trained | planner's largest | peak / rank GiB (planner) | before the model "
             "GiB | trials |", "|---|---|---|---|---:|---:|---|"]
    for r in rows:
        trials = "; ".join(f"{t['cell']} {'✓' if t['fits'] else '✗'}" for t in r["trials"])
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['variant']} | error: {r['error']} | {r['planner']} | | | {trials} |")
            continue
        best = next((t for t in r["trials"] if t["cell"] == r["largest"]), None)
        largest = f"{r['largest']} ({_millions(r['params'])})" if r["largest"] else "none"
        planner = f"{r['planner']} ({_millions(r['planner_params'])})" if r["planner"] else "none"
        peak = f"{best['peak'] / GiB:.2f} ({best['predicted'] / GiB:.2f})" if best else ""
        baseline = f"{best['baseline'] / GiB:.2f}" if best else ""
        lines.append(f"| {r['layout']} | {r['variant']} | {largest} | {planner} | {peak} | {baseline} | {trials} |")
    return "\n".join(lines)


def moves_table(rows: list[dict]) -> str:
    lines = ["| layout | model | activations to host / back, MB (planner) | optimizer states to device / host, MB "
             "(planner) |", "|---|---|---|---|"]
    for r in rows:
        if r.get("moved"):
            cells = [_moves(r["moved"][kind], r["planned_moves"][kind], order)
                     for kind, order in (("activations", ("to_host", "to_device")),
                                         ("optimizer", ("to_device", "to_host")))]
            lines.append(f"| {r['layout']} | {r['largest']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _moves(got: Optional[dict], want: dict, order: tuple[str, str]) -> str:
    """`a / b (planned a / planned b)` in MB, the two directions in `order`."""
    if got is None:
        return "–"
    first, second = order
    return (f"{got[first] / 1e6:,.1f} / {got[second] / 1e6:,.1f} "
            f"({want[first] / 1e6:,.1f} / {want[second] / 1e6:,.1f})")


def plot(rows: list[dict], path: str, memory_gib: float) -> None:
    """Bars: the largest model trained per layout and variant; dots: the planner's largest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for k, variant in enumerate(variants):
        xs = [layouts.index(r["layout"]) + (k - (len(variants) - 1) / 2) * width
              for r in rows if r["variant"] == variant]
        mine = [r for r in rows if r["variant"] == variant]
        ax.bar(xs, [r.get("params", 0) / 1e6 for r in mine], width, label=f"trained: {DESCRIBED[variant]}")
        ax.scatter(xs, [r["planner_params"] / 1e6 for r in mine], color="black", marker="_", s=200, zorder=3,
                   label="planner's largest" if k == 0 else None)
    ax.set_xticks(range(len(layouts)), layouts)
    ax.set_ylabel("parameters (millions)")
    ax.set_title(f"Largest GPT-2 that trains on {RANKS} CPU ranks sharing {memory_gib:g} GiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _header(args, cells: list[Cell]) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if sys.platform == "linux" else platform.processor()
    used = (psutil.virtual_memory().total - psutil.virtual_memory().available) / GiB
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu}, {os.cpu_count()} cores, "
            f"{psutil.virtual_memory().total / GiB:.1f} GiB ({used:.1f} GiB in use at the start); torch "
            f"{metadata.version('torch')}, transformers {metadata.version('transformers')}; {RANKS} gloo ranks, "
            f"{args.capacity / GiB:.2f} GiB each; GPT-2 vocabulary {VOCAB}, seq {args.seq}, {ROWS} sequences per "
            f"data-parallel rank, fp32, AdamW, {args.steps} steps; grid {len(cells)} models: depths "
            f"{sorted({c.depth for c in cells})} × widths {sorted({c.width for c in cells})}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from: " + ", ".join(LAYOUTS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--depths", type=_ints, default=[6, 12, 24, 48])
    parser.add_argument("--widths", type=_ints, default=[512, 768, 1024, 1536, 2048])
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="training steps per trial")
    parser.add_argument("--memory-gib", type=float,
                        default=int((psutil.virtual_memory().available - MACHINE_RESERVE) / GiB),
                        help="memory the ranks share (default: what this machine has available, less the "
                        f"{MACHINE_RESERVE / GiB:g} GiB a trial leaves free, in whole GiB)")
    parser.add_argument("--trial-timeout", type=float, default=1800, help="seconds before a trial is stopped")
    parser.add_argument("--smoke", action="store_true", help="seconds: ZeRO-3 with offload on two tiny models, "
                        "1 GiB per rank")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--replan", metavar="FILE", help="train nothing: recompute the planner's columns of FILE, "
                        "a --json of this command with the same grid and memory, with the planner as it is now")
    parser.add_argument("--plot", help="write the PNG plot to this file")
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial:
        return trial(json.loads(args.trial), args.out)
    if args.smoke:
        args.layouts, args.variants, args.depths, args.widths, args.steps = "ZeRO-3", "offload", [1, 2], [64], 1
        args.memory_gib = 4
    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS] + [
        x for x in args.variants.split(",") if x not in VARIANTS]
    if unknown:
        parser.error(f"unknown layout or variant {unknown[0]!r}; choose from {', '.join([*LAYOUTS, *VARIANTS])}")
    args.capacity = args.memory_gib * GiB / RANKS
    cells = sorted((Cell(d, w) for d in args.depths for w in args.widths), key=lambda c: c.spec(args.seq).parameters)
    if args.replan:
        saved = json.loads(Path(args.replan).read_text())
        header, rows = saved["setup"], [replan(row, cells, args) for row in saved["results"]]
        if args.json:
            Path(args.json).write_text(json.dumps({"setup": header, "results": rows}, indent=1))
    else:
        header, rows = _header(args, cells), []
        print(header, flush=True)
        for layout in args.layouts.split(","):
            for variant in args.variants.split(","):
                rows.append(largest(layout, variant, cells, args))
                if args.json:  # after every search: a long run keeps what it found
                    Path(args.json).write_text(json.dumps({"setup": header, "results": rows}, indent=1))
    print("\n" + table(rows) + "\n\nBytes moved per step by the offload options (rank 0; planner beside)\n\n"
          + moves_table(rows))
    if args.plot:
        plot(rows, args.plot, args.memory_gib)


if __name__ == "__main__":
    main()
