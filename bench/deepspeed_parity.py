"""DeepSpeed training scripts under DeepSpeed itself and under shardwise.deepspeed, compared loss by loss.

Each script is run twice on the same world (2 CPU ranks, gloo, the same seed and arguments): once as it is
(`import shardwise.deepspeed as deepspeed`), once with that import swapped back to DeepSpeed's at load time.
No copy of a script is made: the worker below reads the file, replaces `shardwise.deepspeed` by `deepspeed` in
its source for the DeepSpeed run, compiles it under its own path and runs it as `__main__`. The losses are
taken through a hook, not parsed from what the scripts print (they print rounded values, some only every tenth
step): every `engine.backward(loss)` records the loss it is given, and a pipeline engine's `train_batch()` the
loss it returns, tagged with the engine (a GAN has two), on every rank.

    python bench/deepspeed_parity.py                  # every example of examples/deepspeed/, a markdown table
    python bench/deepspeed_parity.py --only gan       # one of them
    python bench/deepspeed_parity.py --script PATH -- ARGS...   # any script (a public one you have), 2 ranks

A script of your own is compared the same way when its only shardwise line is `import shardwise.deepspeed as
deepspeed` (the worker swaps it back for DeepSpeed's run).

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

@dataclass(frozen=True)
class Case:
    """One run of one script: its arguments (given a scratch folder), how many ranks; with `then`, a second
    run after it in the same folder (a resume), whose losses are the ones compared."""

    name: str
    script: str
    args: Callable[[Path], list[str]]
    nproc: int = 2
    then: Optional[Callable[[Path], list[str]]] = None

    @property
    def path(self) -> Path:
        return Path(self.script) if Path(self.script).is_absolute() else EXAMPLES / self.script

    def run(self, flavour: str, folder: Path, launcher: str = "torchrun") -> list[list]:
        losses = launch(flavour, self.path, self.args(folder), self.nproc, launcher=launcher)
        if self.then is not None:
            losses = launch(flavour, self.path, self.then(folder), self.nproc, launcher=launcher)
        return losses


def classifier_args(stage: int, micro: int = 8, *more: str) -> list[str]:
    return ["--stage", str(stage), "--micro-batch", str(micro), "--samples", "128", *more]


def gan_args(*more: str) -> list[str]:
    return ["--steps", "8", "--deepspeed_config", str(EXAMPLES / "gan_config.json"), *more]


def pipeline_args(stages: int) -> list[str]:
    return ["--stages", str(stages), "--steps", "4", "--deepspeed_config", str(EXAMPLES / "pipeline_config.json")]


CASES = [
    *[Case(f"train_classifier ZeRO-{stage}", "train_classifier.py", lambda folder, stage=stage: classifier_args(stage))
      for stage in range(4)],
    Case("train_classifier resumed (saved and resumed at ZeRO-3)", "train_classifier.py",
         lambda folder: classifier_args(3, 8, "--save-dir", str(folder / "ckpt")),
         then=lambda folder: classifier_args(3, 8, "--save-dir", str(folder / "ckpt"), "--resume")),
    Case("train_gan (two engines)", "train_gan.py", lambda folder: gan_args()),
    Case("train_pipeline (PipelineModule, 1 stage)", "train_pipeline.py", lambda folder: pipeline_args(1), 1),
    Case("train_pipeline (PipelineModule, 2 stages)", "train_pipeline.py", lambda folder: pipeline_args(2)),
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
    for flavour in flavours:
        folder = Path(tempfile.mkdtemp(prefix="ds-parity-"))
        start = time.perf_counter()
        try:
            outcome.runs[flavour] = case.run(flavour, folder)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
            outcome.runs[flavour] = _last_error(error)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        outcome.seconds[flavour] = time.perf_counter() - start
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
    parser.add_argument("--script", default=None, help="compare this script (its args after --) instead")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for --script")
    split = argv.index("--") if "--" in argv else len(argv)
    options = parser.parse_args(argv[:split])
    cases = CASES
    if options.script:
        extra = list(argv[split + 1:])
        cases = [Case(Path(options.script).name, str(Path(options.script).resolve()), lambda folder: extra,
                      options.nproc)]
    outcomes = []
    for case in cases:
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
