"""`shardwise.hf.Trainer` trains as `transformers.Trainer` does in one process, in every layout it runs.

Each layout runs the same Trainer script (a tiny GPT-2, gradient accumulation 2, clipping at 1.0, a linear
schedule with warmup, labels partly masked so `num_items_in_batch` differs between ranks and micro-steps) with
only the import changed and the layout given as `shardwise run --config` gives it; the reference is
transformers' own Trainer in one process with the ranks' micro batches together. Compared: the loss and
gradient norm the Trainer logs at every step, the learning rates, the evaluation loss and the final weights.
Under tensor and pipeline parallelism the ranks of a tensor-parallel group and the stages of a pipeline share one
batch (the Trainer's batches are dealt to the model replicas), as transformers' own tensor parallelism has it.
"""

from __future__ import annotations

import json

import pytest

from hf_trainer_cases import assert_same, run
from shardwise.testing import run_distributed
from tiny_models import SEQ, VOCAB

MICRO = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_distributed(run, 1, "plain", str(tmp_path_factory.mktemp("plain")), 2 * MICRO, predict=True,
                           timeout=300)[0]


@pytest.mark.parametrize("layout,more", [({}, {}), ({"shard_optimizer_state": True}, {}),
                                         ({"zero_stage": 2, "sharded_data_parallel_degree": 2}, {}),
                                         ({"sharded_data_parallel_degree": 2}, {}),
                                         ({"sharded_data_parallel_degree": 2}, {"activation_checkpointing": True})],
                         ids=["ddp", "zero1", "zero2", "zero3", "zero3-activation-checkpointing"])
def test_trains_and_evaluates_as_one_process(layout, more, reference, tmp_path):
    """`activation_checkpointing=True` is the Trainer's own (its model's checkpointing, enabled before wrapping).
    Then evaluate with compute_metrics and predict: the same metrics and logits, in the same order."""
    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO, layout, predict=True, timeout=300, **more)
    assert ranks[0]["predictions"].shape == (16, SEQ, VOCAB)
    assert_same(ranks, reference)
    assert ranks[0]["global_step"] == 3


def test_tensor_parallel_with_zero3_trains_and_evaluates_as_one_process(reference, tmp_path):
    """2 tensor-parallel ranks per replica, 2 ZeRO-3 replicas: 4 ranks, 2 batches per step."""
    layout = {"tensor_parallel_degree": 2, "prescaled_batch": True, "sharded_data_parallel_degree": 2}
    ranks = run_distributed(run, 4, "shardwise", str(tmp_path), MICRO, layout, timeout=300)
    assert_same(ranks, reference)


def _refusal(out: str, layout: dict) -> str:
    try:
        run("shardwise", out, MICRO, layout, evaluate=False)
    except ValueError as error:
        return str(error)
    return "trained"


def test_tensor_parallel_needs_the_shared_batch(tmp_path):
    message = run_distributed(_refusal, 2, str(tmp_path), {"tensor_parallel_degree": 2}, timeout=120)[0]
    assert message == ("invalid shardwise config: prescaled_batch=False: the Hugging Face Trainer gives the ranks of a "
                       "tensor-parallel group one batch (per_device_train_batch_size rows), as transformers' tensor "
                       "parallelism does; fix: set prescaled_batch: true with tensor_parallel_degree")


@pytest.fixture(scope="module")
def reference_one_batch(tmp_path_factory) -> dict:
    """One process with one micro batch: what a single replica trains (evaluated with compute_metrics, and
    predicting)."""
    return run_distributed(run, 1, "plain", str(tmp_path_factory.mktemp("plain_one")), MICRO, predict=True,
                           timeout=300)[0]


def test_pipeline_trains_evaluates_and_predicts_as_one_process(reference_one_batch, tmp_path):
    """2 stages, each micro-step's batch in 2 pipeline microbatches, the embedding and head tied across stages;
    then evaluate with compute_metrics and predict: the same metrics and logits as one process."""
    layout = {"pipeline_parallel_degree": 2, "microbatches": 2}
    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO, layout, predict=True, timeout=300)
    assert ranks[0]["predictions"].shape == (16, SEQ, VOCAB)  # every evaluation row's logits, once
    assert_same(ranks, reference_one_batch)


def test_sequence_parallel_trains_and_evaluates_as_one_process(reference_one_batch, tmp_path):
    """Tensor parallelism over 2 ranks with sequence parallelism (the activations between the tensor-parallel
    blocks split along the sequence): one replica, one batch per step."""
    layout = {"tensor_parallel_degree": 2, "prescaled_batch": True, "sequence_parallel": True}
    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO, layout, timeout=300)
    assert_same(ranks, reference_one_batch)


def test_pipeline_with_zero3_trains_as_one_process(reference, tmp_path):
    layout = {"pipeline_parallel_degree": 2, "microbatches": 2, "sharded_data_parallel_degree": 2}
    ranks = run_distributed(run, 4, "shardwise", str(tmp_path), MICRO, layout, timeout=300)
    assert_same(ranks, reference)


@pytest.mark.slow
def test_pipeline_with_tensor_parallel_trains_as_one_process(reference_one_batch, tmp_path):
    layout = {"pipeline_parallel_degree": 2, "microbatches": 2, "tensor_parallel_degree": 2, "prescaled_batch": True}
    ranks = run_distributed(run, 4, "shardwise", str(tmp_path), MICRO, layout, timeout=300)
    assert_same(ranks, reference_one_batch)


@pytest.mark.slow
def test_mics_trains_as_one_process(tmp_path):
    """ZeRO-3 in partition groups of 2, replicated twice: 4 ranks against one process with 4 micro batches."""
    want = run_distributed(run, 1, "plain", str(tmp_path / "plain"), 4 * MICRO, timeout=300)[0]
    ranks = run_distributed(run, 4, "shardwise", str(tmp_path / "mics"), MICRO, {"sharded_data_parallel_degree": 2},
                            timeout=300)
    assert_same(ranks, want)


@pytest.fixture(scope="module")
def reference_bf16(tmp_path_factory) -> dict:
    return run_distributed(run, 1, "plain", str(tmp_path_factory.mktemp("plain_bf16")), 2 * MICRO, bf16=True,
                           use_cpu=True, timeout=300)[0]


@pytest.mark.parametrize("layout", [{"sharded_data_parallel_degree": 2}, {"shard_optimizer_state": True}],
                         ids=["zero3", "zero1"])
def test_bf16_trains_as_one_process_in_bf16(layout, reference_bf16, tmp_path):
    """bf16=True (with use_cpu=True, which transformers asks for bf16 on a CPU): shardwise computes in bf16 with
    fp32 master weights where transformers' Trainer autocasts, so the two agree to bf16's precision (the weights
    near zero, the norms' biases, to a few hundredths of their size)."""
    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO, layout, bf16=True, use_cpu=True, timeout=300)
    assert_same(ranks, reference_bf16, tolerance=5e-3, state_tolerance=3e-2)


def test_fp16_trains_as_one_process_to_fp16_precision(reference, tmp_path):
    """fp16=True under ZeRO-3: fp16 compute with shardwise's loss scale and fp32 masters, the Trainer's default
    fused AdamW included; transformers' Trainer on a CPU trains in fp32, so that is the reference."""
    layout = {"sharded_data_parallel_degree": 2}
    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO, layout, fp16=True, use_cpu=True, timeout=300)
    assert_same(ranks, reference, tolerance=5e-3, state_tolerance=3e-2)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {"sharded_data_parallel_degree": 2})], ids=["one", "zero3"])
def test_each_step_reaches_shardwise_metrics(world, layout, tmp_path):
    """metrics_interval 1: each optimizer step's record (global.jsonl, what `shardwise report` reads) counts the
    Trainer's rows over its micro-steps and ranks, and holds the learning rate and gradient norm the Trainer logs
    and, on one rank, its loss (the rank's own: the Trainer logs the mean over ranks)."""
    metrics = tmp_path / "metrics"
    got = run_distributed(run, world, "shardwise", str(tmp_path), MICRO,
                          {**layout, "metrics_interval": 1, "metrics_dir": str(metrics)}, evaluate=False,
                          timeout=300)[0]
    records = [json.loads(line) for line in (metrics / "global.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["samples"] for r in records] == [world * MICRO * 2] * 3  # gradient accumulation 2
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert [r["lr"] for r in records] == got["lrs"]
    assert [r["grad_norm"] for r in records] == pytest.approx(got["grad_norms"], rel=1e-6)
    if world == 1:
        assert [r["loss"] for r in records] == pytest.approx(got["losses"], rel=1e-6)
