"""ZeRO-1's parameter broadcasts overlap the next forward, and every reader of the parameters sees them updated.

After `optimizer.step()` the owners' updated parameters are still on their way to the
other replicas (parallel/zero1/parameter_broadcasts.py): each module of the next forward
waits for the bucket holding its parameters, and everything else that reads them
waits for all. On 4 gloo ranks with buckets of 8 kB (test_zero1_precision's small
buckets: the 4-layer GPT-2's 50 tensors travel in 18), counting, not timing:

- every broadcast is issued inside `optimizer.step()`, one per tensor, none in forward;
  when the step returns every bucket is pending; the next forward's first module (the
  token embedding) waits for the first bucket only, the buckets complete in forward
  order, and the last one before forward ends — in bf16 (fp32 masters) and in fp32
  (under DDP). Under FSDP2's `replicate` (fp32 with tensor parallelism) the step
  waits for them itself, as documented;
- every other reader waits for all of them: the model's `state_dict`,
  `full_state_dict`, `parameters`, `named_parameters` and `load_state_dict`, the
  optimizer's `state_dict`, `load_state_dict` and next `step`, `synchronize`, an
  evaluation under `torch.no_grad()`, a pipeline stage's forward — and each rank
  then holds the same values as the owners;
- same math with small buckets: bf16 (with microbatches and clipping, GPT-2 and ViT),
  a pipeline and tensor parallelism against test_zero1_precision's one-process
  reference, and fp32 with and without tensor parallelism against
  test_tensor_parallel_runtime's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise.testing import run_distributed
from test_tensor_parallel_runtime import _check, train_all
from test_zero1_precision import (LOSS_TOLERANCE, PARAM_TOLERANCE, ROWS, SIZES, STEPS, WORLD, Collectives, SeedLoop,
                                  _assert_same_math, _rows, reference, small_buckets)
from tiny_models import build, loss_fn

TENSORS = len(list(build("gpt2", **SIZES).parameters()))


def around_steps(loop: SeedLoop, before, after) -> None:
    """Call `before()` and `after()` around every `optimizer.step()` of `loop`."""
    step = loop.optimizer.step

    def stepped():
        before()
        step()
        after()

    loop.optimizer.step = stepped


def broadcasts_in_forward(config: dict) -> dict:
    """Two steps of the seed's loop with small buckets: the buckets pending when each `optimizer.step()`
    returns. Counted over the second step: the broadcasts issued by its `optimizer.step()`, and by the time
    each module of its forward runs, with the buckets still pending then (seen by a hook registered after
    ZeRO-1's)."""
    loop = small_buckets(SeedLoop, config, freeze_key_bias=False, **SIZES)
    broadcasts, counter = loop.optimizer._update.broadcasts, Collectives("broadcast_")
    calls, after_step, seen = [], [], []
    around_steps(loop, lambda: calls.append(counter.calls),
                 lambda: (calls.append(counter.calls), after_step.append(broadcasts.pending)))
    loop.step(0)
    for name, module in loop.model.get_module().named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_pre_hook(
                lambda *_, name=name: seen.append((name, counter.calls, broadcasts.pending)))
    with counter:
        loop.step(1)
    return {"buckets": len(broadcasts.buckets), "in_step": calls[-1] - calls[-2], "seen": seen,
            "after_step": after_step}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_forward_waits_for_each_bucket_as_it_needs_it(precision):
    """The step issues one broadcast per tensor and returns with all buckets pending; forward issues none and
    completes them first to last: the embedding's module leaves all but the first pending, and what stays
    pending is always the last buckets, none by the last module."""
    config = {"shard_optimizer_state": True, "bf16": precision == "bf16"}
    for got in run_distributed(broadcasts_in_forward, WORLD, config, timeout=300):
        buckets = got["buckets"]
        assert buckets > WORLD
        assert got["in_step"] == TENSORS
        assert got["after_step"] == [tuple(range(buckets))] * 2
        names, calls, pending = zip(*got["seen"])
        assert len(set(calls)) == 1, "a broadcast was issued during forward"  # (DDP's own come before it)
        assert names[0] == "transformer.wte" and pending[0] == tuple(range(1, buckets))
        assert all(p == tuple(range(buckets - len(p), buckets)) for p in pending), "not completed in order"
        assert [len(p) for p in pending] == sorted((len(p) for p in pending), reverse=True)
        assert pending[-1] == ()


def test_under_fsdp_replicate_the_step_waits_for_its_broadcasts():
    """fp32 ZeRO-1 with tensor parallelism runs under FSDP2's `replicate`, which copies the parameters whenever
    it unshards them (a pipeline schedule does so before forward): there `optimizer.step()` returns with
    nothing pending."""
    config = {"shard_optimizer_state": True, "tensor_parallel_degree": 2}
    for got in run_distributed(broadcasts_in_forward, WORLD, config, timeout=300):
        assert got["in_step"] == TENSORS
        assert got["after_step"] == [(), ()]
        assert {pending for _, _, pending in got["seen"]} == {()}


def _sum(tensors) -> float:
    return sum(float(t.detach().double().sum()) for t in tensors)


def read_paths() -> dict:
    """ZeRO-1 in bf16 with small buckets: for each way to read (or write) the parameters outside forward, one
    training step, then that read. Per read: the buckets pending before and after it, and what it read — for
    the readers that return no parameters, the parameters once every broadcast has arrived."""
    loop = small_buckets(SeedLoop, {"shard_optimizer_state": True, "bf16": True}, freeze_key_bias=False, **SIZES)
    model, optimizer = loop.model, loop.optimizer
    broadcasts = optimizer._update.broadcasts
    loaded, loaded_sum = {k: v.clone() for k, v in model.state_dict().items()}, _sum(model.parameters())
    batch = _rows(loop.data, 0, sw.dp_rank(), ROWS, sw.dp_size())
    evaluate = sw.step(lambda model, inputs, targets: loss_fn("gpt2", model, inputs, targets))
    loop.step(0)
    saved = copy.deepcopy(optimizer.state_dict())

    def evaluation() -> tuple[float, float]:
        with torch.no_grad():
            first = evaluate(model, *batch).reduce_mean().item()
            optimizer.synchronize()
            return first, evaluate(model, *batch).reduce_mean().item()

    paths = {
        "model.state_dict": lambda: _sum(model.state_dict().values()),
        "model.full_state_dict": lambda: _sum(model.full_state_dict().values()),
        "model.parameters": lambda: _sum(model.parameters()),
        "model.named_parameters": lambda: _sum(p for _, p in model.named_parameters()),
        "model.load_state_dict": lambda: model.load_state_dict(loaded) and None,
        "optimizer.state_dict": lambda: optimizer.state_dict() and None,
        "optimizer.synchronize": optimizer.synchronize,
        "evaluation": evaluation,
        "optimizer.step": optimizer.step,  # these two send parameters again
        "optimizer.load_state_dict": lambda: optimizer.load_state_dict(saved),
    }
    results = {}
    for index, (name, read) in enumerate(paths.items()):
        loop.step(index % STEPS)
        before = broadcasts.pending
        value = read()
        after = broadcasts.pending
        optimizer.synchronize()
        value = _sum(model.get_module().parameters()) if value is None else value
        results[name] = {"before": len(before), "after": len(after), "value": value}
    return {"paths": results, "buckets": len(broadcasts.buckets), "loaded": loaded_sum}


def test_every_reader_outside_forward_waits_for_all_broadcasts():
    """Each reader finds every bucket pending and leaves none (the step and optimizer.load_state_dict wait for
    them, then send the parameters again); what they read is the same on every rank, so no rank read a
    parameter before its owner's value arrived; loaded weights are not overwritten by a late broadcast; and an
    evaluation while broadcasts are pending computes what it computes once they have arrived."""
    ranks = run_distributed(read_paths, WORLD, timeout=300)
    buckets = ranks[0]["buckets"]
    for name in ranks[0]["paths"]:
        got = [r["paths"][name] for r in ranks]
        sends_again = name in ("optimizer.step", "optimizer.load_state_dict")
        assert all(g["before"] == buckets and g["after"] == (buckets if sends_again else 0) for g in got), name
        if name == "evaluation":
            assert all(g["value"][0] == g["value"][1] for g in got)
        else:
            assert len({g["value"] for g in got}) == 1, f"{name}: ranks read different parameters"
    assert ranks[0]["paths"]["model.load_state_dict"]["value"] == ranks[0]["loaded"]


def train_overlapped(kind: str, config: dict, optimizer: str) -> dict:
    """The seed's loop with small buckets: losses, final weights, and the buckets pending when each
    `optimizer.step()` is called (after the @step's forward) and when it returns."""
    loop = small_buckets(SeedLoop, config, kind, optimizer)
    broadcasts, at_step, after_step = loop.optimizer._update.broadcasts, [], []
    around_steps(loop, lambda: at_step.append(broadcasts.pending), lambda: after_step.append(broadcasts.pending))
    losses = [loop.step(index) for index in range(STEPS)]
    return {"losses": losses, "norms": [], "state": loop.weights(), "names": sorted(loop.model.sharded_state_dict()),
            "at_step": at_step, "after_step": after_step, "buckets": len(broadcasts.buckets)}


# name: (model, config keys, the reference's arguments); tensor parallelism with test_zero1_precision's
# optimizer and tolerances for it (SGD; row-parallel partial sums rounded in bf16)
HALF = {
    "gpt2-microbatches-clipping": ("gpt2", {"microbatches": 2, "gradient_clipping": 0.5},
                                   {"microbatches": 2, "clip": 0.5}),
    "vit": ("vit", {}, {}),
    "gpt2-pipeline": ("gpt2", {"pipeline_parallel_degree": 2}, {"replicas": 2}),
    "gpt2-tensor-parallel": ("gpt2", {"tensor_parallel_degree": 2}, {"optimizer": "sgd", "replicas": 2,
                                                                     "rows": 2 * ROWS}),
}


@pytest.mark.parametrize("case", list(HALF))
def test_bf16_same_math_with_broadcasts_in_flight(case):
    """test_zero1_precision's one-process reference, to its tolerances, while every step leaves all buckets in
    flight and the next @step's forward — on a pipeline, its stages'; with tensor parallelism, on DTensor
    parameters — has waited for all of them."""
    kind, extra, arguments = HALF[case]
    config = {"shard_optimizer_state": True, "bf16": True, **extra}
    optimizer = arguments.get("optimizer", "adamw")
    ranks = run_distributed(train_overlapped, WORLD, kind, config, optimizer, timeout=300)
    tolerances = (1e-3, 2e-2) if "tensor_parallel_degree" in extra else (LOSS_TOLERANCE, PARAM_TOLERANCE)
    _assert_same_math(ranks, reference(kind, "bf16", **arguments), *tolerances)
    for got in ranks:
        assert got["buckets"] > 1
        assert got["at_step"] == [()] * STEPS
        assert got["after_step"] == [tuple(range(got["buckets"]))] * STEPS


@pytest.mark.parametrize("config", [{"shard_optimizer_state": True},
                                    {"shard_optimizer_state": True, "tensor_parallel_degree": 2}],
                         ids=["ddp", "tensor-parallel"])
def test_fp32_same_math_with_small_buckets(config):
    """fp32 ZeRO-1 (DDP: overlapped; tensor parallel: FSDP2's `replicate`, waited in the step) trains what one
    process trains, within 1e-5."""
    _check(run_distributed(small_buckets, WORLD, train_all, config, ("gpt2", "llama"), timeout=300)[0])


def pending_across_shutdown() -> list[int]:
    """The buckets pending after a step, and after `sw.shutdown()`."""
    loop = small_buckets(SeedLoop, {"shard_optimizer_state": True, "bf16": True}, freeze_key_bias=False, **SIZES)
    broadcasts = loop.optimizer._update.broadcasts
    loop.step(0)
    before = len(broadcasts.pending)
    sw.shutdown()
    return [before, len(broadcasts.pending)]


def test_shutdown_waits_for_broadcasts_in_flight():
    """A process group must not be destroyed under pending collectives: shutdown lets them finish first."""
    for before, after in run_distributed(pending_across_shutdown, WORLD, timeout=300):
        assert before > 0 and after == 0
