"""Pipelines cut from the module graph (parallel/pipeline/graph.py): any module torch can capture.

Same math as one process, with the checks of test_pipeline.py (losses, evaluation steps, every whole
parameter on every rank, each rank holding only its stage): a CNN of two sub-networks (no repeated
blocks, so the graph cut is automatic), and with `pipeline_cut: graph` BERT (its masked-LM decoder is
the word embedding, tied across the first and last stage), GPT-2, Llama and a stack of blocks in an
nn.Sequential, under 2 and 4 stages, with data parallelism and ZeRO-3, both SMP schedules. The loss
is computed outside the model, in the step function, and every rank of a pipeline gets it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.parallel.pipeline.graph_cut import cut_graph
from shardwise.testing import run_distributed
from test_pipeline import PP2, PP4, check, train_all
from tiny_models import IMAGE, CHANNELS, TinyCNN, build, dataset

GRAPH = {"pipeline_cut": "graph"}
CASES = {  # name: (world size, config, model kinds)
    "cnn-pp2-gpipe": (2, {**PP2, "microbatches": 2, "pipeline_schedule": "gpipe"}, ("cnn",)),
    "cnn-pp2-dp2-1f1b": (4, {**PP2, "microbatches": 2}, ("cnn",)),
    "graph-pp2-dp2": (4, {**PP2, "microbatches": 2, **GRAPH}, ("bert", "gpt2", "sequential")),
    "graph-pp4": (4, {**PP4, "microbatches": 4, **GRAPH}, ("gpt2", "llama")),
    "graph-pp2-zero3": (4, {**PP2, "microbatches": 2, "sharded_data_parallel_degree": 2, **GRAPH}, ("bert", "cnn")),
    "graph-pp2-zero1": (4, {**PP2, "microbatches": 2, "shard_optimizer_state": True, **GRAPH}, ("bert", "cnn")),
}


@pytest.mark.parametrize("case", CASES)
def test_same_math_as_one_process(case):
    world, config, kinds = CASES[case]
    check(config, run_distributed(train_all, world, config, kinds=kinds, timeout=300))


def _costliest(cut) -> float:
    return max(sum(c for c, s in zip(cut.costs, cut.stage_of_unit) if s == stage)
               for stage in set(cut.stage_of_unit))


def test_the_cut_is_the_best_contiguous_one_by_compute_and_memory_and_keeps_placements():
    """`memory_weight` moves the cut (by compute the convolutions weigh most, by memory the classifier's large
    linear layer); each cut's costliest stage is the least of every split of its units; a placement by hand wins."""
    model = build("cnn")
    images = dataset("cnn", 4)[:][0]
    cuts = {weight: cut_graph(model, {"images": images}, 2, memory_weight=weight) for weight in (0.0, 1.0)}
    assert cuts[0.0].split_points != cuts[1.0].split_points
    for cut in cuts.values():
        splits = [max(sum(cut.costs[:i]), sum(cut.costs[i:])) for i in range(1, len(cut.costs))]
        assert _costliest(cut) == pytest.approx(min(splits))
    sw.set_partition(model.classifier, 1)
    sw.set_partition(model.features, 0)
    assert cut_graph(model, {"images": images}, 2, memory_weight=1.0).split_points == ("classifier.0",)


def test_the_graph_cut_bench_runs_and_its_cut_is_no_better_than_the_best():
    """bench/graph_cut.py in a smoke size: its best contiguous cut bounds the picked one from below."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import graph_cut

    for row in graph_cut.cut_quality(layers=2, stages=2, weights=(0.0, 1.0)):
        assert row["finest_units"] >= row["units"] and 1.0 <= row["ratio"] <= 1.1, row
    assert graph_cut.cut_time(layers=2, width=32, heads=2, seq=16, stages=2)["units"] >= 2


class _Branchy(nn.Module):
    """Python control flow on a tensor's value: torch cannot capture it."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.second(self.first(x))
        return self.first(x)


def uncapturable() -> str:
    sw.init(PP2)
    model = sw.DistributedModel(_Branchy())

    @sw.step
    def train_step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    try:
        train_step(model, torch.ones(2, 4))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_forward_torch_cannot_capture_is_one_line_naming_why():
    messages = run_distributed(uncapturable, 2, timeout=300)
    for message in messages:
        assert message.startswith("pipeline parallelism could not trace _Branchy's forward (")
        assert "fix: make the forward capturable" in message and "\n" not in message


def optimizer_before_the_cut() -> str:
    sw.init(PP2)
    model = sw.DistributedModel(TinyCNN())
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.zero_grad()  # fine before the first step
    whole = len(model.state_dict())  # the whole model until the cut
    try:
        optimizer.state_dict()
    except RuntimeError as error:
        return f"{whole} {error}"
    return "no error"


def test_the_optimizer_waits_for_the_cut_and_the_model_is_whole_before_it():
    expected = len(TinyCNN().state_dict())
    for said in run_distributed(optimizer_before_the_cut, 2, timeout=300):
        count, message = said.split(" ", 1)
        assert int(count) == expected
        assert message.startswith("optimizer.state_dict: this model's pipeline is cut from its module graph at the "
                                  "first @step")


def memory_after_the_cut() -> tuple[int, int, int]:
    """(parameters of the whole model, of this rank's stage, of the whole model's still alive after the cut)."""
    import gc
    import weakref

    sw.init(PP2)
    model = sw.DistributedModel(TinyCNN())
    whole = [weakref.ref(p) for p in model.parameters()]
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @sw.step
    def train_step(model, images, labels):
        loss = F.cross_entropy(model(images)["logits"], labels)
        model.backward(loss)
        return loss

    train_step(model, torch.randn(2, CHANNELS, IMAGE, IMAGE), torch.tensor([0, 1]))
    optimizer.step()
    gc.collect()
    return len(whole), len(list(model.parameters())), sum(ref() is not None for ref in whole)


def test_after_the_cut_a_rank_keeps_only_its_stage():
    counts = run_distributed(memory_after_the_cut, 2, timeout=300)
    assert sum(held for _, held, _ in counts) == counts[0][0]  # the stages hold every parameter once
    assert all(alive == held for _, held, alive in counts)  # the other stages' parameters were freed


def loss_on_rank_0() -> list:
    """The SMP v1 CNN script's pattern: loss computed outside the model, printed on rank 0."""
    sw.init({**PP2, "microbatches": 2})
    torch.manual_seed(0)
    model = sw.DistributedModel(TinyCNN())
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @sw.step
    def train_step(model, images, labels):
        output = model(images)
        loss = F.nll_loss(F.log_softmax(output["logits"], dim=1), labels)
        model.backward(loss)
        return output["logits"], loss

    @sw.step
    def test_step(model, images, labels):  # SMP's MNIST example returns plain numbers from its evaluation step
        output = model(images)["logits"]
        loss = F.nll_loss(F.log_softmax(output, dim=1), labels, reduction="sum").item()
        correct = output.argmax(dim=1).eq(labels).sum().item()
        return loss, correct

    images, labels = torch.randn(4, CHANNELS, IMAGE, IMAGE), torch.tensor([0, 1, 2, 3])
    optimizer.zero_grad()
    logits, loss = train_step(model, images, labels)
    optimizer.step()
    with torch.no_grad():
        losses, corrects = test_step(model, images, labels)
    return [sw.rank(), loss.holds_loss, loss.reduce_mean().item(), tuple(logits.concat().shape), sum(losses),
            sum(corrects)]


def test_the_step_outputs_reach_rank_0_with_the_loss_computed_outside_the_model():
    first, last = run_distributed(loss_on_rank_0, 2, timeout=300)
    assert (first[0], first[1], last[1]) == (0, False, True)
    assert first[2] == pytest.approx(last[2]) and first[3] == last[3] == (4, 5)
    assert first[4:] == last[4:] and 0 <= first[5] <= 4  # the evaluation step's numbers, per microbatch
