"""DeepSpeed training scripts (examples/deepspeed/) train under `shardwise run` as one process of themselves.

Each script's only shardwise line is its import. It runs under `shardwise run` on 2 CPU ranks and its losses
(every `engine.backward(loss)` argument, and a pipeline's `train_batch()` result, recorded by
bench/deepspeed_parity.py's worker) are compared with a one-process reference of the same script:

- data parallel (train_classifier.py at ZeRO 0-3): one process with the micro batch x 2 sees each micro-step's
  samples of both ranks, so the mean of the two ranks' losses is its loss, each micro-step;
- a resume: saved at ZeRO-3 by a run that goes on training, resumed at ZeRO-1 by a second run (the script
  skips the batches trained before): the resumed run's losses are the first run's after the save;
- two engines (train_gan.py): the same, one process with the batch x 2;
- a PipelineModule on 2 stages (train_pipeline.py): one process with 1 stage.

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
    """Each micro-step, the mean of the ranks' losses is the one process's (each rank had half its samples)."""
    per_rank = [_values(records) for records in ranks]
    assert len({len(values) for values in per_rank}) == 1, f"{what}: the ranks took different step counts"
    _assert_close([sum(step) / len(step) for step in zip(*per_rank)], _values(reference[0]), what)


@pytest.fixture(scope="module")
def classifier_one_process():
    return _run("train_classifier.py", parity.classifier_args(0, 16), 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_classifier_at_each_zero_stage_trains_as_one_process(stage, classifier_one_process):
    ranks = _run("train_classifier.py", parity.classifier_args(stage), 2)
    assert len(ranks[0]) == 8  # 128 samples, 8 per rank per micro-step
    _assert_mean_of_ranks(ranks, classifier_one_process, f"classifier at ZeRO-{stage}")


def test_classifier_resumes_in_another_layout(tmp_path):
    """Saved after step 2 of 4 at ZeRO-3 (the run goes on), resumed from `latest` at ZeRO-1: the same losses."""
    first = _run("train_classifier.py", parity.classifier_args(3, 8, "--save-dir", str(tmp_path)), 2)
    assert (tmp_path / "latest").read_text() == "global_step2"
    resumed = _run("train_classifier.py", parity.classifier_args(1, 8, "--save-dir", str(tmp_path), "--resume"), 2)
    for rank in range(2):  # 2 steps of 2 micro-steps were trained before the checkpoint
        _assert_close(_values(resumed[rank]), _values(first[rank])[4:], f"resumed, rank {rank}")


def test_gan_with_two_engines_trains_as_one_process():
    ranks = _run("train_gan.py", parity.gan_args(), 2)
    one = _run("train_gan.py", parity.gan_args(), 1)  # train_batch_size 32: 16 a rank on 2, 32 on 1
    assert [tag for tag, _ in one[0]][:3] == [0, 0, 1] and len(one[0]) == 3 * 8  # D real, D fake, G; 8 steps
    _assert_mean_of_ranks(ranks, one, "GAN")


def test_pipeline_module_on_two_stages_trains_as_one_stage():
    ranks = _run("train_pipeline.py", parity.pipeline_args(2), 2)
    reference = _run("train_pipeline.py", parity.pipeline_args(1), 1)
    assert len(reference[0]) == 4
    for rank, records in enumerate(ranks):  # every stage returns the batch's loss, as DeepSpeed's do
        _assert_close(_values(records), _values(reference[0]), f"pipeline, rank {rank}")


# ----- against DeepSpeed itself -----

# DeepSpeed builds only a stage's own layers, drawing from torch's generator in turn, so its initial weights
# depend on the number of stages: its 2-stage run starts apart from its 1-stage one (and from one process).
STAGE_DEPENDENT_INIT = pytest.mark.xfail(reason="DeepSpeed's initial weights depend on its stages", strict=True)


def _deepspeed_case(case):
    marks = [STAGE_DEPENDENT_INIT] if "2 stages" in case.name else []
    return pytest.param(case, id=case.name.replace(" ", "-"), marks=marks)


@pytest.mark.deepspeed
@pytest.mark.parametrize("case", [_deepspeed_case(case) for case in parity.CASES])
def test_example_gives_deepspeeds_losses(case):
    pytest.importorskip("deepspeed")
    with tempfile.TemporaryDirectory() as theirs_folder, tempfile.TemporaryDirectory() as ours_folder:
        theirs = case.run("deepspeed", Path(theirs_folder))
        ours = case.run("shardwise", Path(ours_folder), launcher="shardwise")
    worst_abs, worst_rel, count = parity.max_difference(ours, theirs)
    assert count > 0
    assert worst_rel <= TOLERANCE, json.dumps({"max_abs": worst_abs, "max_rel": worst_rel})


@pytest.mark.deepspeed
def test_two_stages_give_deepspeeds_one_stage_losses():
    """shardwise's 2-stage pipeline trains as one process does, which is DeepSpeed's 1-stage run."""
    pytest.importorskip("deepspeed")
    theirs = parity.launch("deepspeed", parity.EXAMPLES / "train_pipeline.py", parity.pipeline_args(1), 1)
    ours = _run("train_pipeline.py", parity.pipeline_args(2), 2)
    for rank in range(2):
        _assert_close(_values(ours[rank]), _values(theirs[0]), f"pipeline, rank {rank}")
