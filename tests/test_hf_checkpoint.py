"""The Trainer's checkpoints on shardwise: save_steps, save_total_limit, resume (bit for bit, or in another
layout), and save_model's weights loaded by from_pretrained.

A run under ZeRO-3 on 2 ranks saves every step and keeps 3 checkpoint folders, each holding the Trainer's files
and a shardwise checkpoint. Its later folders are then removed and an unfinished one (a crash mid-save) is left
in their place: `train(resume_from_checkpoint=True)` picks the newest folder written whole and, in the same
layout, continues bit for bit as the run that never stopped; in another layout (DDP), the same within
floating-point tolerance. A pipeline's checkpoint resumes in one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hf_trainer_cases import MICRO_DEFAULT, run
from shardwise.testing import run_distributed

ZERO3 = {"sharded_data_parallel_degree": 2}
SAVING = dict(max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=3, evaluate=False)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("straight")
    ranks = run_distributed(run, 2, "shardwise", str(out), MICRO_DEFAULT, ZERO3, save_to=str(out / "final"),
                            timeout=300, **SAVING)
    return out, ranks


def _resumable_copy(out: Path, to: Path) -> Path:
    """The run's folder as a crash after step 2 leaves it: checkpoint-2 whole, checkpoint-3 half written."""
    shutil.copytree(out / "checkpoint-2", to / "checkpoint-2")
    (to / "checkpoint-3").mkdir()
    shutil.copy(out / "checkpoint-3" / "config.json", to / "checkpoint-3")
    return to


def test_save_steps_and_save_total_limit_keep_the_newest_folders(straight):
    out, ranks = straight
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    for folder in out.glob("checkpoint-*"):
        names = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "config.json", "trainer_state.json", "shardwise", "rng_state_0.pth",
                "rng_state_1.pth"} <= names, names
        assert not {"optimizer.pt", "scheduler.pt"} & names  # in the shardwise checkpoint instead


def test_save_model_writes_weights_from_pretrained_loads(straight):
    _, ranks = straight
    loaded, trained = ranks[0]["loaded"], ranks[0]["state"]
    assert sorted(loaded) == sorted(trained)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name


def test_resume_in_the_same_layout_is_bit_exact(straight, tmp_path):
    out, ranks = straight
    folder = _resumable_copy(out, tmp_path)
    resumed = run_distributed(run, 2, "shardwise", str(folder), MICRO_DEFAULT, ZERO3, resume=True, timeout=300,
                              **SAVING)
    assert resumed[0]["steps_run"] == 2 and ranks[0]["steps_run"] == 4  # steps 3 and 4 only
    assert resumed[0]["losses"] == ranks[0]["losses"] and resumed[0]["grad_norms"] == ranks[0]["grad_norms"]
    for name, value in ranks[0]["state"].items():
        assert torch.equal(resumed[0]["state"][name], value), name


def test_resume_in_another_layout(straight, tmp_path):
    out, ranks = straight
    folder = _resumable_copy(out, tmp_path)
    resumed = run_distributed(run, 2, "shardwise", str(folder), MICRO_DEFAULT, {}, resume=True, timeout=300,
                              **SAVING)
    assert resumed[0]["steps_run"] == 2
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(ranks[0]["losses"]), rtol=1e-5,
                               atol=1e-5)
    for name, value in ranks[0]["state"].items():
        torch.testing.assert_close(resumed[0]["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_a_pipeline_checkpoint_resumes_in_one_process(tmp_path):
    """2 pipeline stages save (their tied embedding and head included); one process without a launcher resumes."""
    saving = dict(max_steps=4, save_strategy="steps", save_steps=2, evaluate=False)
    staged = run_distributed(run, 2, "shardwise", str(tmp_path / "staged"), MICRO_DEFAULT,
                             {"pipeline_parallel_degree": 2, "microbatches": 2}, save_to=str(tmp_path / "final"),
                             timeout=300, **saving)
    shutil.copytree(tmp_path / "staged" / "checkpoint-2", tmp_path / "alone" / "checkpoint-2")
    alone = run_distributed(run, 1, "shardwise", str(tmp_path / "alone"), MICRO_DEFAULT, {}, resume=True,
                            timeout=300, **saving)[0]
    assert alone["steps_run"] == 2
    torch.testing.assert_close(torch.tensor(alone["losses"]), torch.tensor(staged[0]["losses"]), rtol=1e-5, atol=1e-5)
    for name, value in staged[0]["state"].items():
        torch.testing.assert_close(alone["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(staged[0]["loaded"][name], value), name


def test_load_best_model_at_end_loads_the_best_checkpoint_into_the_shards(tmp_path):
    """ZeRO-3 evaluating and saving every step, a learning rate high enough that the first step is the best: at
    the end every rank's shards hold that checkpoint's weights."""
    from safetensors.torch import load_file

    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO_DEFAULT, ZERO3, evaluate=False, max_steps=4,
                            save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                            load_best_model_at_end=True, metric_for_best_model="eval_loss", learning_rate=3e-2,
                            timeout=300)
    evaluations = [entry["eval_loss"] for entry in ranks[0]["history"] if "eval_loss" in entry]
    best = 1 + evaluations.index(min(evaluations))
    assert best < 4
    weights = load_file(tmp_path / f"checkpoint-{best}" / "model.safetensors")
    for name, value in weights.items():
        assert torch.equal(ranks[0]["state"][name], value), name
