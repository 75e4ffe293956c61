"""Pipeline parallelism trains the model one plain process would, through the seed's unchanged loop.

Every case runs the seed's loop (`sw.init(config)`, `sw.DistributedModel`,
`sw.DistributedOptimizer`, an `@sw.step` function calling `model.backward`,
`sw.data_loader`) on a tiny GPT-2 (token embedding tied to the head, on the
first and the last stage) and a tiny Llama, each with 4 blocks, and compares
with one plain PyTorch process training on the same global batches:

- losses: the mean over the ranks that hold the loss, per step, 1e-5 relative;
- parameters: every whole tensor of `full_state_dict()` on every rank,
  ‖got − want‖ / max(‖want‖, 1e-3) ≤ 1e-5 (fp32, dropout off, SGD with momentum:
  see tiny_models.py for why Adam would amplify rounding noise).

Each run also checks, on every rank: which ranks hold the loss (`StepOutput.holds_loss`)
and that every other rank of its pipeline gets the same losses (SMP delivered them); an
evaluation `@step` under `torch.no_grad()` before and after training (its loss
equals the reference's first loss, and at the end that of a plain model loaded
from `full_state_dict()`); that `state_dict()` names are those of the unsplit
model (each rank its own stages', all ranks together all of them).
"""

from __future__ import annotations

import contextlib
import functools
import io

import pytest
import torch

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import (blocks, build, dataset, loss_fn, make_optimizer, relative_error, seed_step,
                         train_reference)

LAYERS = 4
ROWS = 8  # rows per data-parallel rank and step (dp counts tensor-parallel ranks, as in SMP)
STEPS = 2
TOLERANCE = 1e-5
KINDS = ("gpt2", "llama")


def train_kind(kind: str, checkpointing: bool = False, rows: int = ROWS) -> dict:
    """One rank of the seed's loop on `kind`, between two evaluation steps; `rows` per data_loader batch."""
    printed = io.StringIO()
    with sw.delay_param_initialization():  # on the meta device if the config asks for it
        module = build(kind, freeze_key_bias=True, layers=LAYERS)
    with contextlib.redirect_stdout(printed):
        model = sw.DistributedModel(module)
    held = {name: p.numel() for name, p in model.named_parameters()}
    initial = {name: t.clone() for name, t in model.full_state_dict().items()}
    if checkpointing:
        for block in blocks(model.get_module()):
            sw.set_activation_checkpointing(block)
    dtypes: set[str] = set()  # of the blocks' outputs: the compute precision
    for block in blocks(model.get_module()):
        block.register_forward_hook(lambda m, a, out: dtypes.add(str(out[0].dtype if isinstance(out, tuple)
                                                                     else out.dtype)))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step(kind)

    @sw.step
    def eval_step(model, inputs, targets):
        return loss_fn(kind, model, inputs, targets)

    batches = list(sw.data_loader(dataset(kind, STEPS * ROWS * sw.dp_size()), batch_size=rows, shuffle=False))
    with torch.no_grad():
        first = eval_step(model, *batches[0])
    losses, outputs = [], []
    for inputs, targets in batches:
        opt.zero_grad()
        out = train_step(model, inputs, targets)
        outputs.append(out)
        losses.append(out.reduce_mean().item())  # the last stage's loss, on every rank of its pipeline
        opt.step()
    with torch.no_grad():
        last = eval_step(model, *batches[-1])
    state = model.full_state_dict()
    plain = build(kind, layers=LAYERS)
    plain.load_state_dict(state)
    with torch.no_grad():
        plain_last = loss_fn(kind, plain, *batches[-1]).item()
    return {
        "kind": kind, "pp_rank": sw.pp_rank(), "holds": [o.holds_loss for o in outputs + [first, last]],
        "replica": (sw.dp_rank(), sw.tp_rank()),
        "losses": losses, "eval": (first.reduce_mean().item(), last.reduce_mean().item(), plain_last)
        if last.holds_loss else None,
        "state": state, "initial": initial, "keys": sorted(model.sharded_state_dict()), "held": held,
        "printed": printed.getvalue(), "dtypes": sorted(dtypes),
    }


def train_all(config: dict, kinds=KINDS, **options) -> list[dict]:
    sw.init(config)
    return [train_kind(kind, **options) for kind in kinds]


@functools.cache
def reference(kind: str, global_batch: int, clip: float | None = None) -> dict:
    return train_reference(kind, "sgd", STEPS, global_batch, clip, layers=LAYERS)


def _loss_rank(config: dict) -> int:
    """The pp rank of the last stage: V-shaped schedules bring it back to rank 0."""
    return 0 if config.get("pipeline_schedule") == "zbv_zero_bubble" else config["pipeline_parallel_degree"] - 1


def holders(config: dict, per_kind: tuple[dict, ...]) -> list[dict]:
    """The last stage's ranks; every rank's StepOutputs say whether it is one, and every rank of a pipeline got
    its last stage's losses."""
    found = [r for r in per_kind if r["pp_rank"] == _loss_rank(config)]
    assert len(found) == len(per_kind) // config["pipeline_parallel_degree"]
    for r in per_kind:
        assert all(h == (r in found) for h in r["holds"]), (r["kind"], r["pp_rank"], r["holds"])
        own = next(f for f in found if f["replica"] == r["replica"])
        assert r["losses"] == own["losses"], (r["pp_rank"], r["losses"], own["losses"])
    return found


def mean_losses(found: list[dict]) -> torch.Tensor:
    return torch.tensor([r["losses"] for r in found]).mean(0)


def check_state(per_kind: tuple[dict, ...], want: dict, tolerance: float = TOLERANCE) -> None:
    """Names as in the unsplit model (each rank its own stages'); every whole tensor on every rank."""
    names = set(want)
    assert set().union(*(r["keys"] for r in per_kind)) == names
    for rank, r in enumerate(per_kind):
        assert set(r["keys"]) < names, "each rank holds only its stages, under the unsplit model's names"
        assert set(r["state"]) == names
        errors = {name: relative_error(r["state"][name], value) for name, value in want.items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= tolerance, f"{r['kind']} rank {rank}: {worst} differs by {errors[worst]:.2e}"


def assert_piped_trains_as_flat(config: dict, flat_config: dict, **options) -> list[tuple[tuple[dict, ...], dict]]:
    """`train_all` on 4 ranks with `config` (pp 2) against 2 ranks with `flat_config` (no pipeline, same precision):
    the same losses and, within 2e-3, the same state per kind. Returns (pipelined ranks, flat rank 0) per kind."""
    piped = run_distributed(train_all, 4, config, timeout=300, **options)
    flat = run_distributed(train_all, 2, flat_config, timeout=300, **options)
    pairs = []
    for per_kind, plain in zip(zip(*piped), zip(*flat)):
        torch.testing.assert_close(mean_losses(holders(config, per_kind)), mean_losses(list(plain)), rtol=1e-5, atol=0)
        check_state(per_kind, plain[0]["state"], tolerance=2e-3)
        pairs.append((per_kind, plain[0]))
    return pairs


def check(config: dict, ranks: list[list[dict]], want: dict | None = None) -> None:
    """Every rank's results for one config against the plain process (`want` by kind, else `reference`)."""
    for per_kind in zip(*ranks):
        kind = per_kind[0]["kind"]
        ref = (want or {}).get(kind) or reference(kind, ROWS * len(ranks) // config["pipeline_parallel_degree"],
                                                  config.get("gradient_clipping"))
        found = holders(config, per_kind)
        torch.testing.assert_close(mean_losses(found), torch.tensor(ref["losses"]), rtol=TOLERANCE, atol=0)
        for r in found:
            first, last, plain_last = r["eval"]
            assert last == pytest.approx(plain_last, rel=TOLERANCE)
        assert sum(r["eval"][0] for r in found) / len(found) == pytest.approx(ref["losses"][0], rel=TOLERANCE)
        check_state(per_kind, ref["state"])


PP2, PP4 = {"pipeline_parallel_degree": 2}, {"pipeline_parallel_degree": 4}
REQUIRED = {  # name: (world size, config)
    "pp2": (2, {**PP2, "microbatches": 2}),
    "pp4-active": (4, {**PP4, "microbatches": 8, "active_microbatches": 4}),
    "pp2-dp2": (4, {**PP2, "microbatches": 2}),
    "pp2-tp2": (4, {**PP2, "tensor_parallel_degree": 2, "microbatches": 2}),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", REQUIRED)
def test_same_math_as_one_process(case, schedule):
    """PP alone, PP with rounds of active_microbatches, PP × DP and PP × TP, on GPT-2 and Llama."""
    world, config = REQUIRED[case]
    config = {**config, "pipeline_schedule": schedule}
    check(config, run_distributed(train_all, world, config, timeout=300))


COMPOSED = {  # name: (config, activation checkpointing); all on 4 ranks, pp 2 × dp 2 (or × tp 2)
    # Two stages per rank, looped; ZeRO-2 shards each stage's gradients over its dp pair.
    "interleaved-1f1b-zero2": ({"pipeline_schedule": "interleaved_1f1b", "zero_stage": 2,
                                "sharded_data_parallel_degree": 2}, False),
    # Backward split into input and weight passes; ZeRO-3 keeps a stage gathered between them.
    "interleaved-zero-bubble-zero3-checkpointing": ({"pipeline_schedule": "interleaved_zero_bubble",
                                                     "sharded_data_parallel_degree": 2}, True),
    # V-shaped: the first and the last stage (embedding and its tied head) on pp rank 0.
    "zbv-zero-bubble-zero1-clipping": ({"pipeline_schedule": "zbv_zero_bubble", "shard_optimizer_state": True,
                                        "gradient_clipping": 0.5}, False),
    # Two stages per rank under tensor and sequence parallelism (pp 2 × tp 2): each stage's run of blocks is one
    # sequence-parallel region, the hidden states passing between stages whole.
    "interleaved-1f1b-tp2-sp": ({"pipeline_schedule": "interleaved_1f1b", "tensor_parallel_degree": 2,
                                 "sequence_parallel": True}, False),
    "zbv-zero-bubble-tp2-sp-regather": ({"pipeline_schedule": "zbv_zero_bubble", "tensor_parallel_degree": 2,
                                         "sequence_parallel": True, "sequence_parallel_regather": True}, False),
    # Rounds of one microbatch: below pp, 1F1B's rounds run as GPipe.
    "1f1b-active-1-zero3": ({"pipeline_schedule": "1f1b", "active_microbatches": 1,
                             "sharded_data_parallel_degree": 2}, True),
}


@pytest.mark.parametrize("case", COMPOSED)
def test_schedules_compose_with_sharding_checkpointing_and_clipping(case):
    extra, checkpointing = COMPOSED[case]
    config = {**PP2, "microbatches": 4, **extra}
    check(config, run_distributed(train_all, 4, config, checkpointing=checkpointing, timeout=300))


def test_manual_split_points_any_block_model_and_printed_partition():
    """Manual split points on Hugging Face models and on plain stacks of blocks (in an nn.ModuleList the forward
    walks and in an nn.Sequential it calls); rank 0 prints the cut."""
    config = {**PP2, "microbatches": 2, "pipeline_split_points": [1]}
    ranks = run_distributed(train_all, 2, config, kinds=("gpt2", "llama", "stack", "sequential"), timeout=300)
    check(config, ranks)
    assert ranks[0][0]["printed"].splitlines() == [
        "pipeline partition of transformer.h (4 blocks) into 2 stages, at the configured split points:",
        "  stage 0 (pp rank 0): transformer.wte, transformer.wpe, transformer.h.0 — 0.0171M params",
        "  stage 1 (pp rank 1): transformer.h.1-3, transformer.ln_f, lm_head — 0.0423M params",
    ]
    assert "stage 1 (pp rank 1): blocks.1-3, norm, head" in ranks[0][2]["printed"]
    assert "stage 1 (pp rank 1): blocks.1-3, norm, head" in ranks[0][3]["printed"]
    assert ranks[1][0]["printed"] == ""


def count_calls(steps: int) -> list[dict]:
    """Per training step on this rank: how often the step function started, and how often it got past
    `model(...)` (2 stages × 2 replicas, 2 microbatches)."""
    sw.init({**PP2, "microbatches": 2})
    model = sw.DistributedModel(build("gpt2"))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    counts = {"started": 0, "past_model": 0}

    @sw.step
    def train_step(model, inputs, targets):
        counts["started"] += 1
        loss = loss_fn("gpt2", model, inputs, targets)
        counts["past_model"] += 1
        model.backward(loss)
        return loss

    per_step = []
    for inputs, targets in sw.data_loader(dataset("gpt2", steps * 2 * 2 * sw.dp_size()), batch_size=4, shuffle=False):
        opt.zero_grad()
        train_step(model, inputs, targets)
        opt.step()
        per_step.append({**counts, "last": sw.pp_rank() == sw.pp_size() - 1})
        counts.update(started=0, past_model=0)
    return per_step


def test_the_step_function_contract_under_a_pipeline():
    """docs/pipeline.md: code before `model(...)` runs once per microbatch on every rank and once more on the
    last stage; code after it only on the last stage, once per microbatch, and on the first step once more
    for the first microbatch (the schedule's trial run that learns what stages send)."""
    for per_step in run_distributed(count_calls, 4, 2, timeout=300):
        first, second = per_step
        if first["last"]:
            assert (first["started"], first["past_model"]) == (5, 3)
            assert (second["started"], second["past_model"]) == (4, 2)
        else:
            assert [(s["started"], s["past_model"]) for s in per_step] == [(2, 0), (2, 0)]


def _accumulating_over_steps(world: int) -> dict:
    """Two @step calls per optimizer step, gradients accumulating between them (no zero_grad): GPT-2's embedding
    and head, tied across the two stages, must each count once."""
    sw.init({"pipeline_parallel_degree": world, "microbatches": 1})
    model = sw.DistributedModel(build("gpt2", layers=LAYERS))
    optimizer = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    data = dataset("gpt2", 16)
    for step in range(2):
        optimizer.zero_grad()
        for half in range(2):
            start = step * 8 + half * 4
            train_step(model, *data[start:start + 4])
        optimizer.step()
    return model.full_state_dict()


def test_gradients_accumulated_over_several_steps_count_tied_weights_once():
    want = run_distributed(_accumulating_over_steps, 1, 1)[0]
    for state in run_distributed(_accumulating_over_steps, 2, 2):
        for name, value in want.items():
            assert relative_error(state[name], value) <= TOLERANCE, name
