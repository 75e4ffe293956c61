"""The public DeepSpeed scripts of examples/deepspeed/ under DeepSpeed itself and under shardwise.deepspeed.

Each script is run twice on the same world (2 CPU ranks, gloo, the same seed and arguments): once as it is
(`import shardwise.deepspeed as deepspeed`), once with that import swapped back to DeepSpeed's at load time.
No copy of a script is made: the worker below reads the file, replaces `shardwise.deepspeed` by `deepspeed` in
its source for the DeepSpeed run, compiles it under its own path and runs it as `__main__`. The losses are
taken through a hook, not parsed from what the scripts print (they print rounded values, some only every tenth
step): every `engine.backward(loss)` records the loss it is given, and a pipeline engine's `train_batch()` the
loss it returns, tagged with the engine (a GAN has two), on every rank.

    python bench/deepspeed_parity.py                  # every example, a markdown table of the differences
    python bench/deepspeed_parity.py --only gan       # one of them

A worker runs under a launcher (torchrun, or `shardwise run`) as:

    torchrun --nproc-per-node 2 bench/deepspeed_parity.py worker --flavour deepspeed --losses DIR -- SCRIPT ARGS...

tests/test_deepspeed_scripts.py uses the same functions for its one-process references and DeepSpeed checks.
"""

from __future__ import annotations

import argparse
import builtins
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "deepspeed"
FLAVOURS = ("deepspeed", "shardwise")


# ----- the worker: one rank of one script -----

def _recording_hooks(flavour: str, records: list) -> None:
    """Record each engine's `backward(loss)` argument and each pipeline engine's `train_batch()` result."""
    if flavour == "deepspeed":
        from deepspeed.runtime.engine import DeepSpeedEngine as Engine
        from deepspeed.runtime.pipe.engine import PipelineEngine as Pipe
    else:
        from shardwise.deepspeed.engine import DeepSpeedEngine as Engine
        try:
            from shardwise.deepspeed.pipeline_engine import PipelineEngine as Pipe
        except ImportError:
            Pipe = None
    engines: dict[int, int] = {}
    inside_pipe = [False]

    def tag(engine: Any) -> int:
        return engines.setdefault(id(engine), len(engines))

    backward = Engine.backward

    def recorded_backward(self, loss, *args, **kwargs):
        if not inside_pipe[0]:  # a pipeline's backward passes are inside train_batch, whose loss is recorded
            records.append([tag(self), float(loss.detach().float())])
        return backward(self, loss, *args, **kwargs)

    Engine.backward = recorded_backward
    if Pipe is not None:
        train_batch = Pipe.train_batch

        def recorded_train_batch(self, *args, **kwargs):
            inside_pipe[0] = True
            try:
                loss = train_batch(self, *args, **kwargs)
            finally:
                inside_pipe[0] = False
            records.append([tag(self), float(loss.detach().float())])
            return loss

        Pipe.train_batch = recorded_train_batch


def _seed(seed: int) -> None:
    import random

    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def worker(flavour: str, losses_dir: str, script: str, script_args: Sequence[str], seed: int = 0) -> None:
    """Run `script` as `__main__` with `script_args`, under DeepSpeed or shardwise, recording its losses."""
    if flavour == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    path = Path(script).resolve()
    source = path.read_text()
    if flavour == "deepspeed":  # the port's one change, undone
        source = source.replace("shardwise.deepspeed", "deepspeed")
    records: list = []
    _recording_hooks(flavour, records)
    # Some scripts never seed (DeepSpeedExamples' CIFAR-10 builds its model from torch's default generator, which
    # torch seeds at random per process): both runs start from the same seed, as each launch of one would.
    _seed(seed)
    sys.argv = [str(path), *script_args]
    sys.path.insert(0, str(path.parent))  # the script's own helper modules, as `python script.py` finds them
    namespace = {"__name__": "__main__", "__file__": str(path), "__builtins__": builtins}
    rank = int(os.environ.get("RANK", 0))
    try:
        exec(compile(source, str(path), "exec"), namespace)
    finally:
        Path(losses_dir).mkdir(parents=True, exist_ok=True)
        (Path(losses_dir) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "losses": records}))


# ----- the driver: launch a script, read its losses back -----

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(flavour: str, script: Path, args: Sequence[str], nproc: int, *, launcher: str = "torchrun",
           timeout: float = 600, cwd: Optional[Path] = None, env: Optional[dict] = None) -> list[list]:
    """Run `script args` on `nproc` CPU ranks under `flavour`; each rank's recorded losses, rank by rank.

    `launcher` is "torchrun" or "shardwise" (`shardwise run`). Raises with the output's tail when it fails."""
    work = Path(tempfile.mkdtemp(prefix="ds-parity-"))
    losses = work / "losses"
    port = free_port()
    worker_args = [str(Path(__file__).resolve()), "worker", "--flavour", flavour, "--losses", str(losses), "--",
                   str(script), *args]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), *worker_args]
    else:
        command = [sys.executable, "-c", "import sys; from shardwise.cli import main; sys.exit(main())", "run", "--nproc-per-node", str(nproc),
                   "--master-port", str(port), "--run-dir", str(work / "run"), *worker_args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu",
                   **(env or {})}
    try:
        done = subprocess.run(command, cwd=cwd or work, env=environment, capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{flavour} run of {script.name} {' '.join(args)} failed ({done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-6000:]}")
        return [json.loads((losses / f"rank{rank}.json").read_text())["losses"] for rank in range(nproc)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def max_difference(a: list[list], b: list[list]) -> tuple[float, float, int]:
    """Max absolute and relative difference between two runs' losses (rank by rank, record by record), and
    how many losses were compared. Different counts or engine tags are an error."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} ranks against {len(b)}")
    worst_abs = worst_rel = 0.0
    count = 0
    for rank, (mine, theirs) in enumerate(zip(a, b)):
        if [tag for tag, _ in mine] != [tag for tag, _ in theirs]:
            raise ValueError(f"rank {rank}: the runs recorded different losses: {mine} against {theirs}")
        for (_, x), (_, y) in zip(mine, theirs):
            worst_abs = max(worst_abs, abs(x - y))
            worst_rel = max(worst_rel, abs(x - y) / max(abs(y), 1e-12))
            count += 1
    return worst_abs, worst_rel, count


# ----- the examples and their runs -----

def json_config(source: Path, folder: Path, **changes: Any) -> Path:
    """A copy of the JSON config `source` in `folder` with `changes` (dotted keys: "optimizer.params.lr")."""
    data = json.loads(source.read_text())
    for dotted, value in changes.items():
        *path, last = dotted.split(".")
        node = data
        for key in path:
            node = node[key]
        node[last] = value
    target = folder / f"{source.stem}-{abs(hash(json.dumps(changes, sort_keys=True))) % 10**8}.json"
    target.write_text(json.dumps(data, indent=2))
    return target


@dataclass(frozen=True)
class Case:
    """One run of one example: its script, its arguments, how many ranks."""

    name: str
    script: str
    args: Callable[[Path], list[str]]  # the arguments, given a scratch folder for configs it writes
    nproc: int = 2


def _zero3_args(folder: Path) -> list[str]:
    # Its config's learning rate (1e-5, warmed up over 10 steps) moves the loss by about 1e-5 in six steps, less
    # than the tolerance: 1e-3 makes a wrong update show.
    config = json_config(EXAMPLES / "train_zero3_stage3.json", folder, **{
        "optimizer.params.lr": 1e-3, "scheduler.params.warmup_max_lr": 1e-3})
    return ["--vocab_size", "256", "--hidden_size", "64", "--num_layers", "2", "--num_heads", "4",
            "--max_seq_len", "32", "--num_samples", "64", "--train_steps", "6", "--deepspeed_config", str(config)]


def _gan_args(batch: int = 64) -> list[str]:
    # Its own config (train_batch_size 64: 32 per rank on two); DCGAN's widths shrunk, 64x64 images as built.
    return ["--dataset", "fake", "--workers", "0", "--batchSize", str(batch), "--ngf", "8", "--ndf", "8", "--nz",
            "16", "--epochs", "1", "--deepspeed_config", str(EXAMPLES / "gan" / "gan_deepspeed_config.json"),
            "--tensorboard_path", "runs", "--outf", "gan_output"]


def _pipeline_args(folder: Path, stages: int, steps: int = 3) -> list[str]:
    # Its config's 256-sample batch of 224x224 images is 32 micro-batches: 16 in 4 keep a step near a second.
    config = json_config(EXAMPLES / "pipeline_parallelism" / "ds_config.json", folder,
                         train_batch_size=16, train_micro_batch_size_per_gpu=4)
    return ["-p", str(stages), "--steps", str(steps), "--backend", "gloo", "--deepspeed_config", str(config)]


CASES = [
    *[Case(f"cifar10_deepspeed ZeRO-{stage}", "cifar10_deepspeed.py",
           lambda folder, stage=stage: ["--epochs", "1", "--dtype", "fp32", "--stage", str(stage),
                                        "--log-interval", "4"])
      for stage in range(4)],
    Case("train_zero3 (zero.Init) ZeRO-3", "train_zero3.py", _zero3_args),
    Case("gan (two engines)", "gan/gan_deepspeed_train.py", lambda folder: _gan_args()),
    Case("pipeline_parallelism (PipelineModule, 2 stages)", "pipeline_parallelism/train.py",
         lambda folder: _pipeline_args(folder, stages=2)),
]


@dataclass
class Outcome:
    case: Case
    runs: dict = field(default_factory=dict)  # flavour -> per-rank losses, or the error's last line
    seconds: dict = field(default_factory=dict)


def _last_error(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if "Error" in line and "errors.html" not in line
             and "ChildFailedError" not in line and "raise " not in line]
    return (lines[-1] if lines else str(error).splitlines()[0]).replace("[rank0]: ", "").strip()


def run_case(case: Case, flavours: Sequence[str] = FLAVOURS) -> Outcome:
    outcome = Outcome(case)
    folder = Path(tempfile.mkdtemp(prefix="ds-parity-config-"))
    try:
        for flavour in flavours:
            start = time.perf_counter()
            try:
                outcome.runs[flavour] = launch(flavour, EXAMPLES / case.script, case.args(folder), case.nproc)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
                outcome.runs[flavour] = _last_error(error)
            outcome.seconds[flavour] = time.perf_counter() - start
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return outcome


def table(outcomes: Sequence[Outcome], tolerance: float) -> str:
    rows = ["| example | ranks | losses compared | max abs. difference | max rel. difference | within 1e-5 rel. |",
            "|---|---|---|---|---|---|"]
    for outcome in outcomes:
        ours, theirs = outcome.runs.get("shardwise"), outcome.runs.get("deepspeed")
        name = f"{outcome.case.name}"
        if isinstance(theirs, str):
            rows.append(f"| {name} | {outcome.case.nproc} | DeepSpeed fails: `{theirs}` | | | |")
        elif isinstance(ours, str):
            rows.append(f"| {name} | {outcome.case.nproc} | shardwise fails: `{ours}` | | | no |")
        else:
            worst_abs, worst_rel, count = max_difference(ours, theirs)
            rows.append(f"| {name} | {outcome.case.nproc} | {count} | {worst_abs:.2e} | {worst_rel:.2e} | "
                        f"{'yes' if worst_rel <= tolerance else 'no'} |")
    return "\n".join(rows)


def report(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="relative difference allowed (fp32)")
    parser.add_argument("--json", default=None, help="also write every run's losses here")
    options = parser.parse_args(argv)
    outcomes = []
    for case in CASES:
        if options.only and options.only not in case.name:
            continue
        outcomes.append(run_case(case))
        print(f"{case.name}: " + ", ".join(f"{flavour} {seconds:.0f} s" for flavour, seconds
                                          in outcomes[-1].seconds.items()), file=sys.stderr, flush=True)
    print(table(outcomes, options.tolerance))
    if options.json:
        Path(options.json).write_text(json.dumps([{"case": o.case.name, "runs": o.runs} for o in outcomes]))


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        parser = argparse.ArgumentParser(prog="deepspeed_parity.py worker")
        parser.add_argument("--flavour", choices=FLAVOURS, required=True)
        parser.add_argument("--losses", required=True, help="folder for each rank's recorded losses")
        parser.add_argument("--seed", type=int, default=0, help="torch's, numpy's and random's seed on every rank")
        parser.add_argument("script")
        parser.add_argument("script_args", nargs=argparse.REMAINDER)
        split = argv.index("--") if "--" in argv else len(argv)
        known = parser.parse_args(argv[1:split] + argv[split + 1:split + 2])
        worker(known.flavour, known.losses, known.script, argv[split + 2:], known.seed)
        return
    report(argv)


if __name__ == "__main__":
    main()
