"""Tensor parallelism inside pipelines cut from the module graph (parallel/pipeline/graph_tensor.py).

pp 2 × tp 2 on 4 ranks, the same math as one process (losses, every whole parameter under the model's names, each
rank holding only its stage): GPT-2 under `pipeline_cut: graph` (its packed Q/K/V split chunk by chunk, its heads
per rank, the vocabulary-parallel embedding and head tied across the first and last stage; also with
`prescaled_batch`), and a classifier built
as an nn.Sequential of SMP's DistributedLinear layers, which has no blocks, so the graph cut is automatic (its last
layer, 5 outputs, is left whole: tp 2 does not divide it); and BERT, Llama, and GPT-2 with two stages per rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.testing import run_distributed
from test_pipeline import PP2, ROWS, STEPS, check, train_all
from tiny_models import CHANNELS, IMAGE, LABELS, SEED, assert_trains_as, dataset, make_optimizer, seed_step, \
    train_reference

CONFIG = {**PP2, "tensor_parallel_degree": 2, "microbatches": 2}


class Classifier(nn.Sequential):
    """Flattened images through DistributedLinear layers; the logits by name, as the shared loss reads them."""

    def __init__(self, hidden: int = 32):
        torch.manual_seed(SEED)
        super().__init__(nn.Flatten(), sw.nn.DistributedLinear(CHANNELS * IMAGE * IMAGE, hidden), nn.ReLU(),
                         sw.nn.DistributedLinear(hidden, hidden), nn.ReLU(), sw.nn.DistributedLinear(hidden, LABELS))

    def forward(self, images: torch.Tensor) -> dict:
        return {"logits": super().forward(images)}


def train_classifier() -> dict:
    model = sw.DistributedModel(Classifier())
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("cnn")
    losses = []
    for images, labels in sw.data_loader(dataset("cnn", STEPS * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False):
        opt.zero_grad()
        losses.append(train_step(model, images, labels).reduce_mean().item())
        opt.step()
    split = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    return {"losses": losses, "state": model.full_state_dict(), "keys": sorted(model.sharded_state_dict()),
            "split": split}


def train_gpt2_and_classifier(config: dict) -> tuple[dict, dict]:
    gpt2 = train_all(config, kinds=("gpt2",))[0]  # initialises shardwise with `config`
    return gpt2, train_classifier()


def test_same_math_as_one_process_with_tensor_parallel_stages():
    config = {**CONFIG, "pipeline_cut": "graph", "pipeline_schedule": "1f1b"}
    ranks = run_distributed(train_gpt2_and_classifier, 4, config, timeout=300)
    check(config, [[gpt2] for gpt2, _ in ranks])
    classifiers = [classifier for _, classifier in ranks]
    want = train_reference("cnn", "sgd", STEPS, ROWS * 2, model=Classifier())
    assert_trains_as(classifiers, want, tolerance=1e-5)
    names = set(want["state"])
    assert set().union(*(set(r["keys"]) for r in classifiers)) == names
    assert all(set(r["keys"]) < names for r in classifiers), "each rank holds only its stage, under the model's names"
    assert all(r["split"] for r in classifiers), "every stage holds layers split over the tp axis"


@pytest.mark.parametrize("schedule, kinds", [("1f1b", ("bert", "llama")), ("interleaved_1f1b", ("gpt2",))],
                         ids=["bert-llama-1f1b", "gpt2-two-stages-per-rank"])
def test_same_math_as_one_process_for_more_models_and_schedules(schedule, kinds):
    """BERT (tuple layers, the word embedding tied to the decoder across stages) and Llama under 1F1B, and GPT-2
    with two tensor-parallel stages per rank."""
    config = {**CONFIG, "pipeline_cut": "graph", "pipeline_schedule": schedule}
    check(config, run_distributed(train_all, 4, config, kinds=kinds, timeout=300))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"], ids=["one-stage-per-rank", "two-stages-per-rank"])
def test_prescaled_batch_trains_the_same(schedule):
    """`prescaled_batch`: a tensor-parallel group reads one batch tp times larger (so the same rows per step as
    without it) and computes its loss on the logits its head leaves split over the vocabulary."""
    config = {**CONFIG, "pipeline_cut": "graph", "pipeline_schedule": schedule, "prescaled_batch": True}
    check(config, run_distributed(train_all, 4, config, kinds=("gpt2",), rows=ROWS * CONFIG["tensor_parallel_degree"],
                                  timeout=300))
