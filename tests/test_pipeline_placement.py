"""SMP v1's manual placement: `partition(i)` and `set_partition(module, i)` steer the block-list cutter.

Pure tests cut GPT-2-like models built on the meta device; placements are
chosen to differ from the automatic cut (2 blocks per stage), so honouring them
shows. The training test runs the seed's loop on a 2-stage pipeline of a tiny
GPT-2 placed by `set_partition` (3 blocks, then 1) and of a small stack built
inside `partition` contexts (1 block, then 3), and compares with one plain
process: losses per step (1e-5 relative) and every parameter after training
(‖got − want‖ / max(‖want‖, 1e-3) ≤ 1e-5), and that each stage holds the
blocks asked for. Then every placement the cutter cannot honour, refused in one line.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.parallel.pipeline import partition as cut
from shardwise.parallel.pipeline.placement import partition, placed_on, set_partition
from shardwise.testing import run_distributed
from tiny_models import (SEED, VOCAB, TinyStack, _Residual, blocks, build, dataset, make_optimizer,
                         relative_error, seed_step, tiny_gpt2, train_reference)

LAYERS = 4
ROWS = 8
STEPS = 3
TOLERANCE = 1e-5


def meta_gpt2(*placements) -> nn.Module:
    """A 4-block GPT-2 on the meta device, block i placed on `placements[i]` (None: unplaced)."""
    with torch.device("meta"):
        model = tiny_gpt2(layers=LAYERS)
    for block, index in zip(model.transformer.h, placements):
        if index is not None:
            set_partition(block, index)
    return model


def test_the_innermost_context_places_a_module_and_set_partition_wins():
    module_init = nn.Module.__init__
    with partition(0):
        outer = nn.Linear(2, 2)
        with partition(1):
            inner = nn.Sequential(nn.Linear(2, 2))
        overridden = nn.Linear(2, 2)
        set_partition(overridden, 2)
    outside = nn.Linear(2, 2)
    assert [placed_on(m) for m in (outer, inner, inner[0], overridden, outside)] == [0, 1, 1, 2, None]
    assert nn.Module.__init__ is module_init, "closing the outermost context restores torch's own __init__"


@pytest.mark.parametrize("index, error", [
    ("1", "TypeError: set_partition: the partition index must be an int (a pipeline stage from 0), got '1'"),
    (True, "TypeError: set_partition: the partition index must be an int (a pipeline stage from 0), got True"),
    (-1, "ValueError: set_partition: the partition index must be 0 or more (a pipeline stage), got -1"),
])
def test_an_index_that_is_not_a_stage_is_refused_at_once(index, error):
    with pytest.raises((TypeError, ValueError)) as info:
        set_partition(nn.Linear(2, 2), index)
    assert f"{info.typename}: {info.value}" == error
    with pytest.raises(info.type, match="^partition: the partition index must be"):
        with partition(index):
            pass


def test_blocks_placed_by_hand_override_the_balance():
    assert cut(meta_gpt2(), 2).bounds == ((0, 2), (2, 4))  # what the automatic cut would do
    part = cut(meta_gpt2(0, 0, 0, 1), 2)
    assert part.describe([0, 1]).splitlines() == [
        "pipeline partition of transformer.h (4 blocks) into 2 stages, placed by hand:",
        "  stage 0 (pp rank 0): transformer.wte, transformer.wpe, transformer.h.0-2 — 0.0425M params",
        "  stage 1 (pp rank 1): transformer.h.3, transformer.ln_f, lm_head — 0.0169M params",
    ]


@pytest.mark.parametrize("placements, stages, bounds", [
    ((None, None, None, 1), 2, ((0, 2), (2, 4))),  # the unplaced blocks balanced before the placed one
    ((None, 1, None, None), 2, ((0, 1), (1, 4))),  # ... or kept after it
    ((0, None, None, 2), 3, ((0, 1), (1, 3), (3, 4))),  # the middle stage from the unplaced blocks
])
def test_with_auto_partition_unplaced_blocks_are_balanced_around_placed_ones(placements, stages, bounds):
    part = cut(meta_gpt2(*placements), stages)
    assert (part.bounds, part.how) == (bounds, "placed by hand, the rest balanced by parameters")


def test_without_auto_partition_unplaced_blocks_go_to_default_partition():
    """SMP's rule for blocks; what runs before and after the blocks stays on the first and last stage."""
    assert cut(meta_gpt2(0), 2, auto_partition=False, default_partition=1).bounds == ((0, 1), (1, 4))
    part = cut(meta_gpt2(None, None, 1, 1), 2, auto_partition=False, default_partition=0)
    assert (part.bounds, part.how) == (((0, 2), (2, 4)), "placed by hand")
    assert part.describe([0, 1]).splitlines()[2].startswith("  stage 1 (pp rank 1): transformer.h.2-3, "
                                                            "transformer.ln_f, lm_head")


def test_placing_the_ends_where_they_run_is_accepted():
    model = meta_gpt2(0, 1, 1, 1)
    set_partition(model.transformer.wte, 0)
    set_partition(model.lm_head, 1)
    assert cut(model, 2).bounds == ((0, 1), (1, 4))


def _refusal(model: nn.Module, stages: int = 2, **options) -> str:
    with pytest.raises(ValueError) as info:
        cut(model, stages, **options)
    return str(info.value)


def _placed(model: nn.Module, placements: dict[str, int]) -> nn.Module:
    """`model` with `set_partition` on the submodules `placements` names by path."""
    for path, index in placements.items():
        set_partition(model.get_submodule(path), index)
    return model


NOT_CONTIGUOUS = "non-contiguous placement is not supported by the block-list cutter"
REFUSALS = {
    "blocks out of order": (
        lambda: meta_gpt2(0, 1, 0, 1), {},
        f"pipeline placement: transformer.h.1 (partition 1) runs before transformer.h.2 (partition 0): "
        f"{NOT_CONTIGUOUS} (a stage holds a contiguous run of transformer.h); fix: place the blocks on "
        "non-decreasing partitions"),
    "head off the last stage": (
        lambda: _placed(meta_gpt2(0, 0, 1, 1), {"lm_head": 0}), {},
        f"pipeline placement: lm_head (partition 0) runs after the blocks transformer.h, so on the last partition "
        f"(1): {NOT_CONTIGUOUS}; fix: place it on partition 1, or leave it unplaced"),
    "embedding placed with its enclosing module off the first stage": (
        lambda: _placed(meta_gpt2(), {"transformer": 1}), {},
        f"pipeline placement: transformer.wte (partition 1, from transformer) runs before the blocks "
        f"transformer.h, so on the first partition (0): {NOT_CONTIGUOUS}; fix: place it on partition 0, or leave "
        "it unplaced"),
    "a block split over two stages": (
        lambda: _placed(meta_gpt2(0, 0, 1, 1), {"transformer.h.1.mlp": 1}), {},
        "pipeline placement: block transformer.h.1 is split over transformer.h.1 (partition 0), "
        "transformer.h.1.mlp (partition 1); the block-list cutter keeps each block on one stage; fix: place whole "
        "blocks"),
    "an index past the pipeline degree": (
        lambda: meta_gpt2(0, 0, 1, 2), {},
        "pipeline placement: transformer.h.3 is on partition 2, but pipeline_parallel_degree is 2; fix: use "
        "partitions 0 to 1"),
    "a stage left without a block": (
        lambda: meta_gpt2(0, None, 3, 3), {"stages": 4},
        "pipeline placement: partitions 1-2 would get no block of transformer.h: 1 unplaced block lies between "
        "transformer.h.0 (partition 0) and transformer.h.2 (partition 3); fix: place at least one block on every "
        "partition 0 to 3"),
    "every block on default_partition": (
        lambda: meta_gpt2(), {"auto_partition": False},
        "pipeline placement: partition 1 would get no block of transformer.h: no unplaced block lies after "
        "transformer.h.3 (partition 0, default_partition); fix: place at least one block on every partition 0 to 1"),
    "placement with virtual stages": (
        lambda: meta_gpt2(0, 0, 1, 1), {"stages": 4, "virtual_stages": 2},
        "pipeline placement: placing transformer.h.0 by hand on partition 0 needs one stage per rank, but this "
        "schedule runs 2 (virtual_stages); fix: use pipeline_schedule gpipe or 1f1b, or leave the cut to the "
        "automatic partition"),
    "placement and split points": (
        lambda: meta_gpt2(0, 0, 1, 1), {"split_points": [2]},
        "pipeline placement: pipeline_split_points [2] and blocks of transformer.h placed by hand both fix the cut; "
        "fix: drop pipeline_split_points, or the placements"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_placements_the_block_list_cutter_cannot_honour_are_refused_in_one_line(case):
    build_model, options, message = REFUSALS[case]
    assert _refusal(build_model(), **options) == message


# --- training on a placed pipeline --------------------------------------------------------------------------


def placed_gpt2() -> nn.Module:
    """As SMP's example scripts do: contiguous assignments over the blocks, by set_partition."""
    model = build("gpt2", freeze_key_bias=True, layers=LAYERS)
    for block, index in zip(model.transformer.h.children(), (0, 0, 0, 1)):
        set_partition(block, index)
    return model


class PlacedStack(nn.Module):
    """TinyStack's modules, built in its order inside `partition` contexts: one block on stage 0, three on 1."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        with partition(0):
            self.embed = nn.Embedding(VOCAB, hidden)
            self.blocks = nn.ModuleList([_Residual(hidden)])
            with partition(1):  # the innermost context wins
                self.blocks.extend(_Residual(hidden) for _ in range(LAYERS - 1))
                self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    forward = TinyStack.forward


def placed_stack() -> nn.Module:
    torch.manual_seed(SEED)
    return PlacedStack()


PLACED = {"gpt2": (placed_gpt2, [["0", "1", "2"], ["3"]]), "stack": (placed_stack, [["0"], ["1", "2", "3"]])}


def train_placed(kind: str) -> dict:
    """One rank of the seed's loop on the placed model `kind`."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model = sw.DistributedModel(PLACED[kind][0]())
    held = [name for name, _ in blocks(model.get_module()).named_children()]
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step(kind)
    losses = []
    for inputs, targets in sw.data_loader(dataset(kind, STEPS * ROWS), batch_size=ROWS, shuffle=False):
        opt.zero_grad()
        out = train_step(model, inputs, targets)
        opt.step()
        losses.append(out.reduce_mean().item() if out.holds_loss else None)
    return {"blocks": held, "losses": losses, "state": model.full_state_dict(), "printed": printed.getvalue()}


def train_all_placed(config: dict) -> dict[str, dict]:
    sw.init(config)
    return {kind: train_placed(kind) for kind in PLACED}


@pytest.mark.parametrize("auto_partition", [True, False])
def test_placed_stages_train_as_one_process(auto_partition):
    """SMP's example scripts place the blocks with auto_partition true or false; both cut where placed."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": auto_partition}
    ranks = run_distributed(train_all_placed, 2, config, timeout=300)
    for kind, (build_placed, held) in PLACED.items():
        want = train_reference(kind, "sgd", STEPS, ROWS, model=build_placed())
        assert [r[kind]["blocks"] for r in ranks] == held
        assert "into 2 stages, placed by hand:" in ranks[0][kind]["printed"]
        assert ranks[0][kind]["losses"] == [None] * STEPS
        torch.testing.assert_close(torch.tensor(ranks[1][kind]["losses"]), torch.tensor(want["losses"]),
                                   rtol=TOLERANCE, atol=0)
        for rank, r in enumerate(ranks):
            assert set(r[kind]["state"]) == set(want["state"])
            errors = {name: relative_error(r[kind]["state"][name], value) for name, value in want["state"].items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOLERANCE, f"{kind} rank {rank}: {worst} differs by {errors[worst]:.2e}"


def refused_at_distributed_model(config: dict) -> str:
    sw.init(config)
    model = build("gpt2", layers=LAYERS)
    set_partition(model.transformer.h[3], 2)
    try:
        sw.DistributedModel(model)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_distributed_model_refuses_a_partition_past_the_degree():
    messages = run_distributed(refused_at_distributed_model, 2, {"pipeline_parallel_degree": 2}, timeout=120)
    assert messages == ["pipeline placement: transformer.h.3 is on partition 2, but pipeline_parallel_degree is 2; "
                        "fix: use partitions 0 to 1"] * 2


def test_without_a_pipeline_every_placement_means_the_one_stage(monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "SHARDWISE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    module = placed_stack()
    set_partition(module.blocks[0], 5)
    sw.init({})
    try:
        model = sw.DistributedModel(module)
        assert len(model.get_module().blocks) == LAYERS
        assert model(torch.zeros(2, 3, dtype=torch.long))["logits"].shape == (2, 3, VOCAB)
    finally:
        sw.shutdown()
