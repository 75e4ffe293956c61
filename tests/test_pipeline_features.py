"""Pipeline parallelism with mixed precision, delayed initialisation and bounded microbatches in flight,
its clear errors, and the 3-D layout (pp × dp × tp) on 8 ranks.

Runs the seed's loop of test_pipeline.py. Mixed precision has no fp32
reference at 1e-5, so a bf16/fp16 pipeline is held to the same precision
without a pipeline (FSDP2's casting policy on both sides): the same losses, and
parameters within the rounding of low-precision gradients. Activation memory is
measured with torch's MemTracker (bytes, not time).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import shardwise as sw
from shardwise.config import ConfigError
from shardwise.parallel.materialize import materialize
from shardwise.testing import run_distributed
from test_pipeline import KINDS, LAYERS, PP2, ROWS, assert_piped_trains_as_flat, check, train_all
from tiny_models import SEED, build, dataset, make_optimizer, seed_step, train_reference

PRECISIONS = {  # precision: data-parallel mode on both sides (2 ranks each)
    "bf16": {"zero_stage": 2, "sharded_data_parallel_degree": 2},
    "fp16": {"sharded_data_parallel_degree": 2},
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_mixed_precision_matches_the_same_precision_without_pipeline(precision):
    """Blocks compute in the low precision on every stage, master weights stay fp32; bf16 with every block
    recomputed in backward."""
    common = {precision: True, "microbatches": 2, **PRECISIONS[precision]}
    checkpointing = precision == "bf16"
    for per_kind, _ in assert_piped_trains_as_flat({**PP2, **common}, common, checkpointing=checkpointing):
        for r in per_kind:
            assert r["dtypes"] == [str(torch.bfloat16 if precision == "bf16" else torch.float16)]
            assert all(t.dtype == torch.float32 for t in r["state"].values())


@functools.cache
def materialized_reference(kind: str, global_batch: int) -> dict:
    """One plain process materialising the whole meta-built model with the seed the ranks agree on."""
    with torch.device("meta"):
        model = build(kind, freeze_key_bias=True, layers=LAYERS)
    materialize(model, torch.device("cpu"), SEED)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    sizes = {name: p.numel() for name, p in model.named_parameters(remove_duplicate=False)}
    return {**train_reference(kind, "sgd", 2, global_batch, model=model), "initial": initial, "sizes": sizes}


def test_delayed_initialisation_builds_only_each_ranks_stages():
    """With delayed_parameter_initialization the script's `sw.delay_param_initialization()` builds on the
    meta device; each rank materialises only its stage, its data-parallel peer the same values without a
    broadcast, and the whole model equals one process materialising all of it — then trains the same."""
    config = {**PP2, "microbatches": 2, "delayed_parameter_initialization": True}
    ranks = run_distributed(train_all, 4, config, timeout=300)
    want = {kind: materialized_reference(kind, 2 * ROWS) for kind in KINDS}
    check(config, ranks, want)
    for per_kind in zip(*ranks):
        sizes = want[per_kind[0]["kind"]]["sizes"]
        stages = {r["pp_rank"]: set(r["held"]) for r in per_kind}
        assert not stages[0] & stages[1] and stages[0] | stages[1] == set(sizes)
        for r in per_kind:
            assert sum(r["held"].values()) < 0.7 * sum(sizes.values()), "no rank holds the whole model"
            initial = want[r["kind"]]["initial"]
            assert set(r["initial"]) == set(initial)
            assert all(torch.equal(r["initial"][name], t) for name, t in initial.items())


class _StageMemTracker(MemTracker):
    """MemTracker refuses a top-level module that runs again within one forward pass (its guard against
    measuring two iterations); a stage runs once per microbatch, so forget a module's own statistics when it
    starts again. Only the per-category peak over the whole step is read."""

    def _pre_fw_hook(self, module, inputs):
        if not self._mod_tracker.is_bw:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)


def peak_activations(config: dict) -> int:
    """This stage's peak activation bytes in a training step (the second: the first also infers shapes)."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", layers=LAYERS, hidden=64))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")

    inputs, targets = dataset("gpt2", 16)[:16]
    train_step(model, inputs, targets)
    opt.step()
    tracker = _StageMemTracker()
    tracker.track_external(model.get_module(), opt.optimizer)
    with tracker:
        train_step(model, inputs, targets)
    peak = tracker.get_tracker_snapshot("peak")
    return sum(int(snapshot.get("Activation", 0)) for snapshot in
               ({getattr(k, "value", k): v for k, v in per_device.items()} for per_device in peak.values()))


def test_activation_memory_falls_with_active_microbatches():
    """GPipe over 4 microbatches in rounds of 4, 2 and 1: each stage's peak activations halve each time."""
    peaks = [run_distributed(peak_activations, 2, {**PP2, "pipeline_schedule": "gpipe", "microbatches": 4,
                                                   "active_microbatches": active}) for active in (4, 2, 1)]
    for stage in range(2):
        four, two, one = (p[stage] for p in peaks)
        assert 0.4 * four < two < 0.6 * four and 0.4 * two < one < 0.6 * two, (stage, four, two, one)


def clear_errors() -> dict:
    """The messages a pipeline run gives for a model too short to cut and a batch microbatches cannot split."""
    sw.init({**PP2, "microbatches": 2})
    messages = {}
    try:
        sw.DistributedModel(build("gpt2", layers=1))
    except ConfigError as err:
        messages["blocks"] = str(err)
    model = sw.DistributedModel(build("gpt2", layers=2))
    train_step = seed_step("gpt2")

    inputs, targets = dataset("gpt2", 3)[:3]
    for name, call in {"batch": lambda: train_step(model, inputs, targets), "direct": lambda: model(inputs)}.items():
        try:
            call()
        except (ValueError, RuntimeError) as err:
            messages[name] = str(err)
    return messages


def test_bad_partition_and_batch_are_clear_errors():
    for messages in run_distributed(clear_errors, 2):
        assert messages == {
            "blocks": "invalid shardwise config: pipeline_parallel_degree=2: cuts transformer.h into 2 stages of at "
                      "least one block each, but it has 1 blocks; fix: use a pipeline_parallel_degree of at most 1",
            "batch": "@step cannot split a batch of 3 rows into 2 equal microbatches; make the per-rank batch size "
                     "a multiple of microbatches=2",
            "direct": "with pipeline_parallel_degree > 1 the model runs only inside a @sw.step function, which "
                      "feeds its microbatches through the pipeline; call the step function instead",
        }


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},  # 3-D: pp 2 × ZeRO-3 dp 2 × tp 2
    {"sharded_data_parallel_degree": 2, "pipeline_schedule": "interleaved_1f1b"},  # MiCS: 2 groups of 2
], ids=["pp-dp-tp", "pp-mics"])
def test_three_dimensions_on_two_nodes(config):
    """8 ranks as 2 nodes of 4: pipeline stages across the nodes, tensor parallelism and ZeRO inside."""
    config = {**PP2, "microbatches": 2, **config}
    check(config, run_distributed(train_all, 8, config, nproc_per_node=4, timeout=600))
