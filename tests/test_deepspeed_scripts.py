"""Public DeepSpeed scripts (examples/deepspeed/, their origins in its README) train under shardwise.deepspeed.

Each runs as it is, with `import shardwise.deepspeed as deepspeed`, under `shardwise run` on 2 CPU ranks, with
small values passed through its own arguments, and its losses (every `engine.backward(loss)` argument, and a
pipeline's `train_batch()` result, recorded by bench/deepspeed_parity.py's worker) are compared with a
one-process reference of the same script:

- data parallel (CIFAR-10 at ZeRO 0-3, ZeRO-3 with zero.Init): one process sees each step's samples of both
  ranks, the micro batch x 2 (CIFAR-10's config gives train_batch_size 16 only, so one process gets 16 where
  each of two gets 8; the ZeRO-3 example's config is written with micro batch 2 for it). The mean of the two
  ranks' losses is the one process's loss, each step.
- the GAN (two engines): its loader is not distributed and every rank seeds alike, so each rank trains on the
  one process's batches; each rank's losses are the one process's.
- the pipeline (2 stages): one process with `-p 1` (one stage) runs the same micro-batches in the same order.

The tests marked `deepspeed` run the same scripts under DeepSpeed itself (where installed) and compare.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import deepspeed_parity as parity  # noqa: E402

TOLERANCE = 1e-5  # relative, fp32: a reduction's order changes the last bits, a wrong update far more

def _run(script: str, args: list[str], nproc: int) -> list[list]:
    return parity.launch("shardwise", parity.EXAMPLES / script, args, nproc, launcher="shardwise", timeout=300)


def _values(records: list) -> list[float]:
    return [value for _, value in records]


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} losses against {len(want)}"
    for step, (x, y) in enumerate(zip(got, want)):
        assert abs(x - y) <= TOLERANCE * abs(y), f"{what}, loss {step}: {x} against {y}"


def _assert_mean_of_ranks(ranks: list[list], reference: list[list], what: str) -> None:
    """Each step, the mean of the ranks' losses is the one process's (each rank had half its samples)."""
    per_rank = [_values(records) for records in ranks]
    assert len({len(values) for values in per_rank}) == 1, f"{what}: the ranks took different step counts"
    _assert_close([sum(step) / len(step) for step in zip(*per_rank)], _values(reference[0]), what)


# ----- data parallel: DeepSpeedExamples' CIFAR-10 at ZeRO 0-3 -----

CIFAR = ["--epochs", "1", "--dtype", "fp32", "--log-interval", "4"]


@pytest.fixture(scope="module")
def cifar_one_process():
    return _run("cifar10_deepspeed.py", [*CIFAR, "--stage", "0"], 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cifar10_at_each_zero_stage_trains_as_one_process(stage, cifar_one_process):
    ranks = _run("cifar10_deepspeed.py", [*CIFAR, "--stage", str(stage)], 2)
    assert len(ranks[0]) == 16  # 256 samples, 16 a step
    _assert_mean_of_ranks(ranks, cifar_one_process, f"CIFAR-10 at ZeRO-{stage}")


# ----- ZeRO-3 with deepspeed.zero.Init: DeepSpeed's own example -----

def test_zero3_with_zero_init_trains_as_one_process(tmp_path):
    two = parity._zero3_args(tmp_path)
    config = Path(two[two.index("--deepspeed_config") + 1])
    one = list(two)
    one[one.index("--deepspeed_config") + 1] = str(parity.json_config(
        config, tmp_path, train_micro_batch_size_per_gpu=2))
    _assert_mean_of_ranks(_run("train_zero3.py", two, 2), _run("train_zero3.py", one, 1), "ZeRO-3 zero.Init")


# ----- two engines: DeepSpeedExamples' GAN -----

def test_gan_with_two_engines_trains_as_one_process():
    args = parity._gan_args()
    ranks, reference = _run("gan/gan_deepspeed_train.py", args, 2), _run("gan/gan_deepspeed_train.py", args, 1)
    engines = [tag for tag, _ in reference[0]]
    assert engines[:3] == [0, 0, 1] and len(engines) == 3 * 16  # D real, D fake, G; 1000 images, 64 a step
    for rank, records in enumerate(ranks):
        assert [tag for tag, _ in records] == engines
        _assert_close(_values(records), _values(reference[0]), f"GAN, rank {rank}")


# ----- pipeline: DeepSpeedExamples' pipeline_parallelism (PipelineModule over AlexNet) -----

def test_pipeline_module_on_two_stages_trains_as_one_stage(tmp_path):
    ranks = _run("pipeline_parallelism/train.py", parity._pipeline_args(tmp_path, stages=2), 2)
    reference = _run("pipeline_parallelism/train.py", parity._pipeline_args(tmp_path, stages=1), 1)
    assert len(reference[0]) == 3
    for rank, records in enumerate(ranks):  # every stage returns the batch's loss, as DeepSpeed's do
        _assert_close(_values(records), _values(reference[0]), f"pipeline, rank {rank}")


# ----- against DeepSpeed itself -----

# Measured differences that are not shardwise's arithmetic (docs/deepspeed.md, "Measured against DeepSpeed").
AGAINST_DEEPSPEED = {
    "gan": pytest.mark.xfail(reason=(
        "Adam's first step amplifies the last bits of near-zero gradients (a BatchNorm bias summed with "
        "cancellation, in another order): 2e-9 apart after one step, and a GAN's losses part by 1e-2 over the "
        "epoch"),
        strict=False),
    "zero.Init": pytest.mark.xfail(reason=(
        "deepspeed.zero.Init leaves parameters on the meta device and shardwise initialises each module seeded by "
        "its name (the same model in every layout), not with DeepSpeed's draws: training starts from other "
        "weights"), strict=False),
    "pipeline": pytest.mark.xfail(reason=(
        "DeepSpeed draws from torch's generator between the script's seed and the first train_batch, shardwise "
        "does not: AlexNet's dropout masks differ from the first step"), strict=False),
}


def _deepspeed_case(case):
    marks = [mark for key, mark in AGAINST_DEEPSPEED.items() if key in case.name]
    return pytest.param(case, id=case.name.split(" ")[0] + "-" + case.name.rsplit(" ", 1)[-1], marks=marks)


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", [_deepspeed_case(case) for case in parity.CASES])
def test_example_gives_deepspeeds_losses(case):
    pytest.importorskip("deepspeed")
    with tempfile.TemporaryDirectory() as folder:
        args = case.args(Path(folder))
        theirs = parity.launch("deepspeed", parity.EXAMPLES / case.script, args, case.nproc, timeout=300)
        ours = _run(case.script, args, case.nproc)
    worst_abs, worst_rel, count = parity.max_difference(ours, theirs)
    assert count > 0
    assert worst_rel <= TOLERANCE, json.dumps({"max_abs": worst_abs, "max_rel": worst_rel})
