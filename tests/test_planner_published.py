"""The planner held against published, measured training runs (tests/planner_published_runs.yaml, each with its
source and its mapping to a shardwise config). The bounds are what the model achieves, as docs/planner.md
reports it run by run ("Held against published runs"); the issue's goal (every run within ±15 %, Spearman
ρ ≥ 0.8 on MFU, every trained run predicted to fit) is not met, and these say by how much."""

from pathlib import Path

import pytest
import yaml

from shardwise.planner.assumptions import FRAGMENTATION_MARGIN
from shardwise.planner.published import (compare, megatron_core_flops_per_token, megatron_flops_per_token,
                                         spearman, summarize)
from shardwise.planner.families import spec_from_hf

RUNS = yaml.safe_load((Path(__file__).parent / "planner_published_runs.yaml").read_text())

# Trained runs the planner says do not fit, and why (docs/planner.md): Llama 3 405B keeps 16 microbatches of
# activations without checkpointing on its first stage (149 GiB as shardwise would hold them at 16,384 GPUs, and
# 209 GiB in torch's interleaved warm-up at 8,192), beside its stage's gradients whole through the round.
NOT_FITTING = {
    "Llama 3 405B, 8192 x H100 80GB, TP 8 x PP 16 x DP 64",
    "Llama 3 405B, 16384 x H100 80GB, TP 8 x PP 16 x DP 128",
}


@pytest.fixture(scope="module")
def summary():
    return summarize(RUNS)


def test_every_run_has_a_source_a_mapping_and_a_measurement():
    assert len(RUNS) >= 18
    for run in RUNS:
        assert run["source"] and run["mapping"], run["name"]
        assert set(run["measured"]) in ({"tokens_per_s_per_device"}, {"tflops_per_device", "convention"})


def test_megatron_flops_follow_the_paper():
    """Narayanan et al. 2021, eq. 3, for the 145.6B row: 96·B·s·l·h²(1 + s/6h + V/16lh) per iteration."""
    spec = spec_from_hf({"model_type": "gpt2", "n_embd": 12288, "n_layer": 80, "n_head": 96, "vocab_size": 51200,
                         "n_positions": 2048}, "gpt")
    per_token = 96 * 80 * 12288 ** 2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 80 * 12288))
    assert megatron_flops_per_token(spec, 2048) == pytest.approx(per_token)


def test_megatron_core_flops_follow_its_training_loop():
    """megatron/training/training.py's num_floating_point_operations (2024) for a GPT of the H100 table:
    12·l·h²·(2 + s/h + 4 + V/2lh) per token (attention with as many key/value heads as heads, a 4h MLP)."""
    spec = spec_from_hf({"model_type": "gpt2", "n_embd": 18432, "n_layer": 112, "n_head": 144, "vocab_size": 131072,
                         "n_positions": 4096, "tie_word_embeddings": False}, "gpt")
    per_token = 12 * 112 * 18432 ** 2 * (2 + 4096 / 18432 + 4 + 131072 / (2 * 112 * 18432))
    assert megatron_core_flops_per_token(spec, 4096) == pytest.approx(per_token)


def test_megatrons_sequence_parallel_memory_lets_its_largest_h100_runs_fit():
    """Megatron's sequence parallelism gathers each column-parallel input again in backward: as
    sequence_parallel_regather the 314B and 462B runs fit in 80 GB; keeping the gathered inputs, as torch's
    styles do, they would not."""
    for name in ("Megatron-core GPT 314B", "Megatron-core GPT 462B"):
        run = next(r for r in RUNS if r["name"].startswith(name))
        assert run["config"]["sequence_parallel_regather"] and compare(run).fits
        kept = {**run, "config": {k: v for k, v in run["config"].items() if k != "sequence_parallel_regather"}}
        assert not compare(kept).fits


def test_spearman_ranks():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)


def test_the_comparison_as_measured(summary):
    print("\n" + summary.table())
    assert summary.mean_absolute_error < 0.15
    assert summary.mfu_rank_correlation > 0.77
    assert summary.within(0.15) >= 22
    assert summary.within(0.25) >= 34


def test_megatron_weak_scaling_within_15_percent(summary):
    """Megatron's ten GPT runs, 32 to 3072 A100s, TP and PP up to 8 × 64: every one within ±15 %."""
    megatron = [c for c in summary.comparisons if c.name.startswith("Megatron-LM")]
    assert len(megatron) == 10
    assert all(abs(c.error) <= 0.15 for c in megatron), [(c.name, f"{c.error:+.0%}") for c in megatron]


def test_no_run_is_off_by_more_than_60_percent(summary):
    """The lowest are Megatron-core's tensor-parallel runs on H100, whose collectives Megatron overlaps with the
    matmuls (--tp-comm-overlap) and shardwise does not: charged on the critical path, 13-25 % of their steps."""
    assert all(-0.35 < c.error < 0.6 for c in summary.comparisons), \
        [(c.name, f"{c.error:+.0%}") for c in summary.comparisons]


def test_the_published_peak_memory(summary):
    """torchtitan's two published peaks (Llama 3.1 8B on 8 and on 128 H100s, 82.4 and 67.0 GiB reserved by the
    caching allocator): the planner's total less the runtime reserve (the CUDA context, which the allocator does
    not hold) is within ±15 % of each (docs/planner.md: −9 % and −5 %), and the model states it counts differ
    between the two by the peaks' difference, within 5 %: the reserved peak holds the sharded gradients, which
    FSDP2's reduce-scatter stream allocates after the loss's backward, apart from the activations' freed blocks."""
    peaks = {run["name"]: run["published_peak_gib"] for run in RUNS if "published_peak_gib" in run}
    assert len(peaks) == 2
    predicted, states = {}, {}
    for c in summary.comparisons:
        if c.name in peaks:
            memory = c.evaluation.memory
            predicted[c.name] = (memory.total - memory.runtime) / 2 ** 30
            states[c.name] = (1 + FRAGMENTATION_MARGIN) * memory.model_states / 2 ** 30
            assert predicted[c.name] == pytest.approx(peaks[c.name], rel=0.15), (c.name, predicted[c.name])
    small, large = sorted(peaks, key=peaks.get)
    assert states[large] - states[small] == pytest.approx(peaks[large] - peaks[small], rel=0.05)


def test_trained_runs_predicted_not_to_fit_are_the_documented_ones(summary):
    assert set(summary.trained_but_predicted_not_to_fit) == NOT_FITTING


def test_a_published_out_of_memory_is_predicted_not_to_fit():
    """torchtitan's Llama 2 70B with selective op checkpointing ran at local batch 1 because batch 2 ran out of
    memory on the 80 GB A100s (its docs/performance.md footnote at 0413364): the planner fits the one, not the other."""
    run = next(r for r in RUNS if r["name"].endswith("selective op AC, local batch 1"))
    assert compare(run).evaluation.fits
    assert not compare({**run, "global_batch": 2 * run["global_batch"]}).evaluation.fits


def test_a_power_cap_slows_the_prediction():
    run = next(r for r in RUNS if "500 W" in r["name"])
    capped = compare(run)
    uncapped = compare({**run, "cluster": {k: v for k, v in run["cluster"].items() if k != "power_limit_watts"}})
    assert capped.predicted_tokens_per_s < uncapped.predicted_tokens_per_s
    assert capped.predicted_mfu < uncapped.predicted_mfu
