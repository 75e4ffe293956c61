"""Where a CPU rank's resident memory goes beyond the tensors the planner counts.

    python bench/memory_overhead.py [--layouts DDP,ZeRO-1,ZeRO-3,MiCS 2×2] [--cells 6x512,12x512]
                                    [--allocators default,...] [--steps 2] [--rounds 1] [--json FILE] [--smoke]

Each run trains a GPT-2 of `bench/largest_model.py` (same config, delayed
initialisation, fp32 AdamW, 2 sequences per data-parallel rank) on 4 gloo CPU
ranks, in fresh processes whose environment carries one glibc malloc setting.
A thread in every rank samples its resident set (RSS) and glibc's own account
(`mallinfo2`: bytes malloc hands out, bytes it holds free) through each phase:
the process group, building the model on the meta device, wrapping it (which
materialises and shards it), the optimizer, the training steps. One more step
runs under torch's MemTracker, whose peak is what the tensors themselves need.
Each training step is timed (until every rank is done with it); the first, which
warms up, is left out of the medians.

At the highest RSS sample, its bytes split into: the process before the model
(Python, torch, transformers, the process group), malloc's bytes in use above
that (tensors and everything else malloc serves), malloc's bytes held free
(retention), and the rest (pages outside malloc: thread stacks, code, ...).

A setting's cost is its step time beside the first setting's: `--rounds N` runs
every layout and model N times, the settings' order alternating from round to
round, so that a loaded machine's drift falls on both alike; the spread of the
runs' medians shows how much the machine itself moved.

A second probe (`--collectives`) measures what one gloo collective of FSDP2's
kinds allocates beyond its input and output: whether gloo makes full-size
buffers of its own.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median
from types import SimpleNamespace

import psutil

from largest_model import GiB, LAYOUTS, RANKS, Cell, config_of, prepare, prediction

MiB = 2 ** 20
# glibc malloc settings (mallopt(3) through the environment) whose effect on the peak and the step time is measured;
# a fixed mmap threshold is what the planner's `fixed_mmap_threshold` CPU device stands for.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
ALLOCATORS = {
    "default": {},
    "arenas 2": {"MALLOC_ARENA_MAX": "2"},
    "mmap 128 KiB": FIXED_MMAP,
    "arenas 2 + mmap 128 KiB": {"MALLOC_ARENA_MAX": "2", **FIXED_MMAP},
}
DEFAULT_LAYOUTS = ("DDP", "ZeRO-1", "ZeRO-3", "MiCS 2×2")
PROBE_BYTES = 64 * MiB


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo():
    """(bytes malloc has handed out, bytes it holds free), from glibc's mallinfo2."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2

    def read() -> tuple[int, int]:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd, info.fordblks

    return read


class Sampler:
    """Samples RSS and malloc's account every few milliseconds and keeps, per phase, its end and its highest
    sample."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.phase, self.phases = interval, PHASES[0], {}
        self.process, self.malloc = psutil.Process(), _mallinfo()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict:
        in_use, free = self.malloc()
        return {"rss": self.process.memory_info().rss, "malloc_in_use": in_use, "malloc_free": free}

    def _record(self) -> dict:
        now = self.sample()
        phase = self.phases.setdefault(self.phase, {"peak": now})
        if now["rss"] > phase["peak"]["rss"]:
            phase["peak"] = now
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._record()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def mark(self, phase: str) -> None:
        """The current phase ends here (its end sample is kept); `phase` follows."""
        self.phases.setdefault(self.phase, {"peak": self.sample()})["end"] = self._record()
        self.phase = phase


PHASES = ("init", "build", "wrap", "optimizer", "steps")  # as `prepare` reports them, then training


def _after(phase: str) -> str:
    return PHASES[PHASES.index(phase) + 1]


def rank_run(spec: dict, out: str) -> None:
    """One rank: the phases of a trial under the sampler, then one step under MemTracker."""
    import torch.distributed as dist

    import shardwise as sw
    from measure import peak_memory, step_times

    with Sampler() as sampler:
        run = prepare(spec, lambda phase: sampler.mark(_after(phase)))
        batches = iter(run.batches)
        times = step_times(lambda: run.step(next(batches)), len(run.batches))
        sampler.mark("tracked step")
        tracked = peak_memory(lambda: run.step(run.batches[-1]), run.model, run.optimizer)
        sampler.mark("end")
    dist.barrier()
    result = {"phases": sampler.phases, "tensors_peak": tracked.get("Total", 0), "tensors": tracked,
              "max_rss": _max_rss(), "step_times": times}
    Path(out, f"rank{sw.rank()}.json").write_text(json.dumps(result))
    sw.shutdown()


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rank_probe(out: str) -> None:
    """One rank: the bytes each gloo collective allocates beyond its own input and output."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    elements = PROBE_BYTES // 4
    full, shard = torch.ones(elements), torch.ones(elements // world)
    collectives = {
        "all-gather": lambda: dist.all_gather_into_tensor(full, shard),
        "reduce-scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all-reduce": lambda: dist.all_reduce(full),
    }
    result = {}
    with Sampler(interval=0.001) as sampler:
        for name, collective in collectives.items():
            dist.barrier()
            before = sampler.sample()
            sampler.mark(name)
            collective()
            sampler.mark("between")
            peak = sampler.phases[name]["peak"]
            result[name] = {"rss": peak["rss"] - before["rss"],
                            "malloc_in_use": peak["malloc_in_use"] - before["malloc_in_use"]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ from the parent

def launch(argument: str, environment: dict, timeout: float) -> list[dict]:
    """Run `--rank-run ARGUMENT` (or the probe) on RANKS fresh ranks with `environment` added; their results."""
    with tempfile.TemporaryDirectory(prefix="memory-overhead-") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
                   __file__, argument, "--out", out]
        done = subprocess.run(command, env={**os.environ, **environment},
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{argument[:80]} failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                               f"{done.stderr[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def breakdown(rank: dict) -> dict:
    """Bytes of one rank at its highest RSS sample: before the model, malloc in use and held free above that,
    the rest; with the phase it fell in and MemTracker's tensor peak."""
    phase, top = max(((name, p["peak"]) for name, p in rank["phases"].items()), key=lambda item: item[1]["rss"])
    base = rank["phases"]["init"]["end"]
    in_use = top["malloc_in_use"] - base["malloc_in_use"]
    free = top["malloc_free"] - base["malloc_free"]
    return {"peak": top["rss"], "max_rss": rank["max_rss"], "phase": phase, "before_model": base["rss"],
            "malloc_in_use": in_use, "malloc_free": free, "rest": top["rss"] - base["rss"] - in_use - free,
            "tensors_peak": rank["tensors_peak"]}


def measure(layout: str, cell: Cell, allocator: str, steps: int, seq: int, timeout: float) -> dict:
    spec = {"config": config_of(layout, "plain"), "cell": {"depth": cell.depth, "width": cell.width}, "seq": seq,
            "steps": steps, "checkpointing": False}
    ranks = launch("--rank-run=" + json.dumps(spec), ALLOCATORS[allocator], timeout)
    busiest = max(ranks, key=lambda r: max(p["peak"]["rss"] for p in r["phases"].values()))
    planned = prediction(layout, "plain", cell, SimpleNamespace(seq=seq, capacity=8 * GiB),
                         fixed_mmap_threshold=FIXED_MMAP.items() <= ALLOCATORS[allocator].items())
    phases = {name: {"end": p.get("end", p["peak"])["rss"], "peak": p["peak"]["rss"]}
              for name, p in busiest["phases"].items()}
    return {"layout": layout, "cell": cell.name, "params": cell.spec(seq).parameters, "allocator": allocator,
            **breakdown(busiest), "phases": phases, "tensors": busiest["tensors"],
            "step_times": busiest["step_times"][1:],
            "planner": planned.detail(), "planner_total": planned.total}


def _gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def _median(seconds: list[float]) -> float:
    """NaN where a run had a single step: only the warm-up, which is not timed."""
    return median(seconds) if seconds else float("nan")


def _step(row: dict) -> float:
    return _median(row["step_times"])


def table(rows: list[dict]) -> str:
    lines = ["| layout | model | malloc | peak RSS GiB (phase) | before the model | malloc in use above it | "
             "malloc held free | rest | MemTracker tensor peak | planner total | step s |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['cell']} | {r['allocator']} | {_gib(r['peak'])} ({r['phase']}) | "
                     f"{_gib(r['before_model'])} | {_gib(r['malloc_in_use'])} | {_gib(r['malloc_free'])} | "
                     f"{_gib(r['rest'])} | {_gib(r['tensors_peak'])} | {_gib(r['planner_total'])} | "
                     f"{_step(r):.2f} |")
    return "\n".join(lines)


def cost_table(rows: list[dict]) -> str:
    """Per layout and model, each setting's step time (median of every timed step of its runs, and the range of
    the runs' medians) and peak RSS (median of its runs), and its change against the first setting."""
    runs: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        runs.setdefault((r["layout"], r["cell"]), {}).setdefault(r["allocator"], []).append(r)
    lines = ["| layout | model | malloc | runs | step s, median (runs' medians) | vs first | peak RSS GiB |",
             "|---|---|---|---:|---:|---:|---:|"]
    for (layout, cell), settings in runs.items():
        first = None
        for allocator, group in settings.items():
            step = _median([t for r in group for t in r["step_times"]])
            first = first or step
            spread = ", ".join(f"{_step(r):.2f}" for r in group)
            lines.append(f"| {layout} | {cell} | {allocator} | {len(group)} | {step:.2f} ({spread}) | "
                         f"{100 * (step / first - 1):+.1f} % | {_gib(median(r['peak'] for r in group))} |")
    return "\n".join(lines)


def phases_table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(name for r in rows for name in r["phases"]))
    lines = ["| layout | model | malloc | " + " | ".join(f"{n} end / peak" for n in names) + " |",
             "|---|---|---|" + "---:|" * len(names)]
    for r in rows:
        cells = [f"{_gib(r['phases'][n]['end'])} / {_gib(r['phases'][n]['peak'])}" if n in r["phases"] else ""
                 for n in names]
        lines.append(f"| {r['layout']} | {r['cell']} | {r['allocator']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def probe_table(ranks: list[dict]) -> str:
    lines = [f"| collective ({PROBE_BYTES // MiB} MiB full buffer) | RSS above its input and output, MiB "
             "(most of any rank) | malloc in use above it, MiB |", "|---|---:|---:|"]
    for name in ranks[0]:
        rss = max(r[name]["rss"] for r in ranks) / MiB
        in_use = max(r[name]["malloc_in_use"] for r in ranks) / MiB
        lines.append(f"| {name} | {rss:.1f} | {in_use:.1f} |")
    return "\n".join(lines)


def _cell(text: str) -> Cell:
    depth, width = text.lower().split("x")
    return Cell(int(depth), int(width))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma-separated, from: "
                        + ", ".join(LAYOUTS))
    parser.add_argument("--cells", default="6x512,12x512", help="GPT-2s as DEPTHxWIDTH, comma-separated")
    parser.add_argument("--allocators", default="default", help="comma-separated, from: " + ", ".join(ALLOCATORS))
    parser.add_argument("--steps", type=int, default=2, help="training steps per run; the first is not timed")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every layout, model and setting")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--collectives", action="store_true", help="also probe gloo's collectives")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run is stopped")
    parser.add_argument("--smoke", action="store_true", help="seconds: ZeRO-3 on a tiny GPT-2, two steps")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--rank-run", help=argparse.SUPPRESS)
    parser.add_argument("--rank-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_run:
        return rank_run(json.loads(args.rank_run), args.out)
    if args.rank_probe:
        return rank_probe(args.out)
    if args.smoke:
        args.layouts, args.cells, args.steps = "ZeRO-3", "1x64", 2
    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS] + [
        x for x in args.allocators.split(",") if x not in ALLOCATORS]
    if unknown:
        parser.error(f"unknown layout or allocator {unknown[0]!r}; choose from {', '.join([*LAYOUTS, *ALLOCATORS])}")
    rows, allocators = [], args.allocators.split(",")
    for round_ in range(args.rounds):
        for layout in args.layouts.split(","):
            for cell in map(_cell, args.cells.split(",")):
                for allocator in allocators[::-1] if round_ % 2 else allocators:
                    start = time.monotonic()
                    rows.append(measure(layout, cell, allocator, args.steps, args.seq, args.timeout))
                    print(f"  {layout} {cell.name} {allocator}: peak {_gib(rows[-1]['peak'])} GiB, step "
                          f"{_step(rows[-1]):.2f} s ({time.monotonic() - start:.0f} s)", flush=True)
    probe = launch("--rank-probe", {}, args.timeout) if args.collectives else None
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "collectives": probe}, indent=1))
    print("\n" + table(rows) + "\n\nRSS per phase (end / highest sample), GiB\n\n" + phases_table(rows))
    print("\nStep time and peak per setting\n\n" + cost_table(rows))
    if probe:
        print("\n" + probe_table(probe))


if __name__ == "__main__":
    main()
