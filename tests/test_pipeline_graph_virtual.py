"""Virtual stages with the module-graph pipeline cut: several stages per rank, same math as one process.

With pp 2 and an interleaved or zero-bubble schedule the graph is cut into 4 stages, each rank runs two of
them, and reads them as one module under the model's names. The checks are test_pipeline.py's (losses,
evaluation steps, every whole parameter on every rank, each rank holding only its stages' names): BERT
(its masked-LM decoder is the word embedding: under the V-shaped zero-bubble schedule both uses run on pp
rank 0, as two stages of one rank), a CNN of two sub-networks and a stack of blocks in an nn.Sequential.
Placement by hand on partitions (pp ranks) that the forward comes back to runs as later stages.
"""

from __future__ import annotations

import pytest

import shardwise as sw
from shardwise.parallel.pipeline.graph_cut import cut_graph
from shardwise.parallel.stage_split import stage_ranks
from shardwise.testing import run_distributed
from test_pipeline import PP2, check, train_all
from tiny_models import build, dataset

GRAPH = {"pipeline_cut": "graph"}
CASES = {  # name: (world size, config, model kinds)
    # V-shaped: BERT's word embedding and its tied decoder on pp rank 0, as two stages of one rank.
    "zbv-zero-bubble-pp2": (2, {**PP2, "microbatches": 2, "pipeline_schedule": "zbv_zero_bubble", **GRAPH},
                            ("bert", "cnn")),
    "interleaved-1f1b-pp2-dp2": (4, {**PP2, "microbatches": 2, "pipeline_schedule": "interleaved_1f1b", **GRAPH},
                                 ("bert", "sequential")),
}


@pytest.mark.parametrize("case", CASES)
def test_same_math_as_one_process(case):
    world, config, kinds = CASES[case]
    check(config, run_distributed(train_all, world, config, kinds=kinds, timeout=300))


def _placed_cnn(partitions: dict[str, int]):
    model = build("cnn")
    for path, partition in partitions.items():
        sw.set_partition(model.get_submodule(path), partition)
    return model, {"images": dataset("cnn", 4)[:][0]}


def test_a_placement_coming_back_to_a_partition_runs_as_a_later_stage():
    """Partitions 0, 1, 0, 1 in the forward's order: four stages, looped over two ranks; unplaced modules fill in."""
    model, inputs = _placed_cnn({"features.0": 0, "features.2": 1, "classifier.1": 0, "classifier.3": 1})
    cut = cut_graph(model, inputs, 4, memory_weight=0.8, stage_ranks=stage_ranks("interleaved_1f1b", 2, 4))
    stage_of = dict(zip(cut.units, cut.stage_of_unit))
    assert [stage_of[u] for u in ("features.0", "features.2", "classifier.1", "classifier.3")] == [0, 1, 2, 3]


@pytest.mark.parametrize("schedule, partitions, words", [
    ("1f1b", {"classifier": 0, "features": 1},
     "pipeline placement: classifier.0 on partition 0 runs after features.4 on partition 1, and no later stage runs "
     "on partition 0 (the module graph is cut into contiguous runs in execution order; stages run on partitions 0, 1 "
     "in turn); fix: place modules on partitions in that order as the forward calls them"),
    ("interleaved_1f1b", {"features": 0, "classifier": 1},
     "pipeline placement leaves stage 2 (partition 0) without a module (after classifier.3; stages run on partitions "
     "0, 1, 0, 1 in turn); fix: place at least one module on every stage's partition, in that order"),
    ("zbv_zero_bubble", {"features": 2},
     "pipeline placement: features.0 is placed on partition 2, but pipeline_parallel_degree is 2; fix: use "
     "partitions 0 to 1"),
], ids=["back-to-a-partition-without-a-later-stage", "a-stage-left-empty", "beyond-the-pipeline-degree"])
def test_a_placement_no_cut_can_honour_is_one_line_naming_the_modules(schedule, partitions, words):
    model, inputs = _placed_cnn(partitions)
    stages = 2 if schedule == "1f1b" else 4
    with pytest.raises(ValueError) as error:
        cut_graph(model, inputs, stages, memory_weight=0.8, stage_ranks=stage_ranks(schedule, 2, stages))
    assert str(error.value) == words


def _zbv_bert_with_replicas() -> str:
    try:
        train_all({**PP2, "microbatches": 2, "pipeline_schedule": "zbv_zero_bubble", **GRAPH}, kinds=("bert",))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_weight_tied_across_two_stages_of_one_rank_is_refused_with_data_parallelism():
    for message in run_distributed(_zbv_bert_with_replicas, 4, timeout=300):
        assert message.startswith("pipeline parallelism: bert.embeddings.word_embeddings.weight is tied to "
                                  "cls.predictions.decoder.weight on stages [0, 3] of one rank"), message
