"""Context parallelism's config keys, layout axis and errors: each bad input gets its one-line message."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config.decisions import Decisions
from shardwise.config.layout import layout_problems
from shardwise.config.validate import config_problems
from shardwise.config.layout import validate
from shardwise.parallel.context import shard_batch, unsplittable_reason
from shardwise.parallel.context.hooks import _hugging_face_attention
from shardwise.topology import Cluster, Layout
from test_context_parallel import tiny


def _layout(cluster: Cluster = Cluster(1, 8), **keys):
    config, problems = config_problems(keys)
    assert not problems, problems
    return config, *layout_problems(config, cluster)


def test_cp_is_an_axis_next_to_tp_and_the_rest_is_data_parallelism():
    layout = Layout(dp_replicate=2, cp=2, tp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # neighbours of the tp groups, inside a node
    assert layout.degrees() == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 2}
    config, layout, problems = _layout(context_parallel_degree=2, shard_optimizer_state=True)
    assert not problems and (layout.cp, layout.dp, layout.world_size) == (2, 4, 8)
    decisions = Decisions(config, layout)
    assert (decisions.context_parallel, decisions.context_parallel_degree, decisions.context_parallel_mode) == \
        (True, 2, "ring")
    assert decisions.shards_optimizer_state  # over the replicas and the cp ranks together
    config, layout, _ = _layout(Cluster(1, 4), context_parallel_degree=4)
    assert layout.dp == 1 and Decisions(config, layout).wrapping().value == "ddp"  # cp ranks reduce gradients


def test_a_degree_that_does_not_divide_the_world_is_refused():
    _, layout, problems = _layout(context_parallel_degree=3, tensor_parallel_degree=2)
    assert layout is None
    assert [str(p) for p in problems] == [
        "context_parallel_degree=3: must divide the 4 ranks left by tensor and pipeline parallelism "
        "(world / (tensor_parallel_degree × pipeline_parallel_degree)): every sequence is split over cp ranks and "
        "the rest is data parallelism; fix: use a divisor of 4: 1, 2, 4"]


def test_an_unknown_mode_is_refused():
    _, problems = config_problems({"context_parallel_mode": "tree"})
    assert [str(p) for p in problems] == ["context_parallel_mode='tree': input should be 'ring' or 'all_to_all'; "
                                          "fix: use one of 'ring' or 'all_to_all'"]


def test_what_cp_does_not_run_with_yet_is_named():
    _, _, problems = _layout(Cluster(1, 8), context_parallel_degree=2, pipeline_parallel_degree=2,
                             pipeline_cut="graph")
    assert [str(p) for p in problems] == [
        "pipeline_cut='graph': does not run with context_parallel_degree 2 in this release (context parallelism "
        "composes with DDP, ZeRO-1/2/3, MiCS outside pipelines, tensor, sequence and expert parallelism, pipelines "
        "cut at their blocks, checkpointing and precision); fix: leave pipeline_cut at its default, or set "
        "context_parallel_degree to 1"]
    assert _layout(Cluster(1, 8), context_parallel_degree=2, tensor_parallel_degree=2)[2] == []
    assert _layout(Cluster(1, 8), context_parallel_degree=2, pipeline_parallel_degree=2)[2] == []
    assert _layout(Cluster(1, 8), context_parallel_degree=2, sharded_data_parallel_degree=2)[2] == []  # MiCS
    assert _layout(Cluster(1, 8), context_parallel_degree=2, sharded_data_parallel_degree=2,
                   delayed_parameter_initialization=True)[2] == []
    _, _, problems = _layout(Cluster(1, 16), context_parallel_degree=2, sharded_data_parallel_degree=2,
                             pipeline_parallel_degree=2)
    assert [p.path for p in problems] == ["sharded_data_parallel_degree"]  # MiCS by FSDP2's hybrid sharding
    assert validate({"context_parallel_degree": 2, "sharded_data_parallel_degree": 2}, Cluster(1, 4))[1].cp == 2


def test_all_to_all_with_heads_the_degree_does_not_divide_is_refused():
    assert unsplittable_reason(tiny("llama"), "all_to_all", 3) == (
        "context_parallel_mode all_to_all splits attention heads over context_parallel_degree 3, and "
        "LlamaForCausalLM has 4: choose a degree dividing 4, or mode ring")
    assert unsplittable_reason(tiny("llama"), "ring", 3) is None
    assert unsplittable_reason(tiny("llama"), "all_to_all", 4, tensor_parallel=2) == (
        "context_parallel_mode all_to_all splits attention heads over context_parallel_degree 4, and "
        "LlamaForCausalLM has 2 per tensor-parallel rank (4 over tensor_parallel_degree 2): choose a degree "
        "dividing 2, or mode ring")
    assert unsplittable_reason(tiny("gpt2"), "all_to_all", 4) is None


def test_a_model_whose_attention_cannot_be_split_is_named():
    assert unsplittable_reason(nn.Sequential(nn.Linear(2, 2))) == (
        "context parallelism cannot split the attention of model Sequential: it splits Hugging Face gpt2, llama, "
        "mistral, qwen2, mixtral, qwen2_moe, qwen3_moe, olmoe attention, and a module class marked "
        "@context_parallel_attention whose forward calls shardwise.parallel.context.attention")


def test_hpz_secondary_groups_cut_the_sharding_group_with_its_cp_ranks():
    config, layout, problems = _layout(Cluster(1, 4), context_parallel_degree=2, zero_stage=3,
                                       zero_hpz_partition_size=2)
    assert not problems and (layout.dp_shard, layout.cp) == (2, 2)
    assert Decisions(config, layout).secondary_partition == 2  # of dp_shard 2 × cp 2 (of dp_shard alone: plain ZeRO-3)
    _, _, problems = _layout(Cluster(1, 4), context_parallel_degree=2, zero_stage=3, zero_hpz_partition_size=3)
    assert [str(p) for p in problems] == [
        "zero_hpz_partition_size=3: must divide the sharding group's 4 ranks (sharded_data_parallel_degree, or the "
        "whole data-parallel group without it): each secondary group is part of one sharding group; fix: use a "
        "divisor of 4: 1, 2, 4",
        "zero_hpz_partition_size=3: must divide the 4 ranks per node: backward's all-gathers run inside a secondary "
        "group, which stays inside a node; fix: use a divisor of 4: 1, 2, 4"]


def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    query = torch.zeros(1, 4, 8, 4)
    with pytest.raises(ValueError, match=r"^sliding-window attention of 4 tokens under context parallelism, which "
                                         r"attends over the whole 8-token sequence: set the model's sliding_window to "
                                         r"None \(or at least the sequence length\), or context_parallel_degree to 1$"):
        _hugging_face_attention(nn.Module(), query, query, query, None, sliding_window=4)


def test_experts_borrow_the_cp_ranks_of_the_sharding_group():
    config, layout, problems = _layout(Cluster(1, 4), context_parallel_degree=4, zero_stage=3,
                                       expert_parallel_degree=2)
    assert not problems and (layout.dp_shard, layout.cp) == (1, 4)
    assert Decisions(config, layout).expert_shards == 2  # dp_shard 1 × cp 4 = expert_shard 2 × ep 2
    _, _, problems = _layout(Cluster(1, 8), context_parallel_degree=2, sharded_data_parallel_degree=2,
                             expert_parallel_degree=8)
    assert [str(p) for p in problems] == [
        "expert_parallel_degree=8: must divide the sharding group's 4 ranks it borrows from "
        "(sharded_data_parallel_degree, or the whole data-parallel group under zero_stage 2/3, times "
        "context_parallel_degree 2); fix: use a divisor of 4: 1, 2, 4"]
    _, _, problems = _layout(Cluster(1, 4), context_parallel_degree=2, expert_parallel_degree=2)
    assert [p.path for p in problems] == ["expert_parallel_degree"]  # DDP shards over nothing, cp or not


def test_a_sequence_the_degree_does_not_split_is_refused():
    with pytest.raises(ValueError, match=r"^sequence length 12 does not split into 2 x context_parallel_degree = 8 "
                                         r"equal chunks: pad sequences to a multiple of 8$"):
        shard_batch(torch.zeros(1, 12, dtype=torch.long), 0, 4)


def test_the_planner_predicts_a_cp_layout_and_names_a_model_it_cannot_split():
    from shardwise.planner import cluster_preset, evaluate, resolve_model

    cluster = cluster_preset("8xg4dn.12xlarge")
    llama = resolve_model("llama:num_hidden_layers=4")
    whole, split = (evaluate(llama, cluster, {"context_parallel_degree": cp}, global_batch=256 // cp, seq=4096)
                    for cp in (1, 2))
    assert split.time.context_parallel > 0 and whole.time.context_parallel == 0
    assert split.micro_batch == whole.micro_batch  # the same rows per replica: each rank keeps half their tokens
    assert split.memory.activations == pytest.approx(whole.memory.activations / 2, rel=0.01)
    result = evaluate(resolve_model("vit-630m"), cluster, {"context_parallel_degree": 2}, global_batch=128)
    assert not result.fits and result.memory is None
    assert result.reason == ("context_parallel_degree=2: the attention of a vit model cannot be split (context "
                             "parallelism splits causal decoders: Hugging Face GPT-2, Llama, Mistral, Qwen2 and "
                             "Mixtral, or a module calling its hook); fix: set context_parallel_degree to 1")
