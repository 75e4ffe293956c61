"""Tensor-parallel plans and rules, without a process group: every broken rule by its message."""

import pytest
import torch
from torch import nn
from transformers import (BertConfig, BertForMaskedLM, BertModel, GPT2Config, GPT2LMHeadModel, GPT2Model,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, ViTConfig,
                          ViTForImageClassification)

from shardwise.config import ConfigError
from shardwise.parallel.tensor import TensorParallelPlan, check_tensor_parallel, plan_for
from shardwise.parallel.tensor.plan import assignments, match


def gpt2(**overrides):
    return GPT2LMHeadModel(GPT2Config(**{"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 256,
                                         "n_positions": 32, **overrides}))


def llama(**overrides):
    return LlamaForCausalLM(LlamaConfig(**{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                           "num_attention_heads": 8, "num_key_value_heads": 4,
                                           "vocab_size": 256, **overrides}))


def mlp(width=30):
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 16))


def problems(model, tp, plan=None):
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(model, tp, plan_for(model, plan))
    return str(err.value)


@pytest.mark.parametrize("pattern, path, hit", [
    ("h.*.attn", "h.0.attn", True),
    ("h.*.attn", "h.0.attn.c_attn", False),  # `*` stays inside one path component
    ("h.*", "h", False),
    ("**.fc1", "vit.layers.3.mlp.fc1", True),
    ("**.fc1", "fc1", True),
    ("layers.[01].mlp", "layers.1.mlp", True),
])
def test_patterns_match_one_component_per_star(pattern, path, hit):
    assert match(pattern, path) is hit


@pytest.mark.parametrize("build, name, head", [
    (gpt2, "gpt2", "lm_head"),
    (lambda: GPT2Model(GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=256)), "gpt2", None),
    (llama, "llama", "lm_head"),
    (lambda: MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=256)),
     "mistral", "lm_head"),
    (lambda: BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=128, vocab_size=256)), "bert", "cls.predictions.decoder"),
    (lambda: BertModel(BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=256)), "bert", None),
    (lambda: ViTForImageClassification(ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                 intermediate_size=128, image_size=16, patch_size=4)), "vit", None),
])
def test_builtin_plan_is_chosen_by_model_type_and_matches_every_block(build, name, head):
    model = build()
    plan = plan_for(model)
    entries = assignments(model, plan)
    assert plan.name == name
    assert check_tensor_parallel(model, 2, plan) == []
    heads = [path for path, entry in entries.items() if entry.spec == "vocab_head"]
    assert heads == ([head] if head else [])


def test_model_without_builtin_plan_asks_for_one():
    with pytest.raises(ConfigError, match=r"tensor_parallel_plan='Sequential': no built-in plan for this model "
                                          r"\(built in: gpt2, llama, mistral, bert, vit, mixtral\); fix: pass sw.DistributedModel\(model, tensor_parallel_plan="):
        plan_for(mlp())


def test_heads_not_divisible():
    message = problems(gpt2(n_embd=96, n_head=6), 4)
    assert message == ("invalid shardwise config: tensor_parallel_degree=4: must divide the model's n_head (6); "
                       "fix: use a tensor_parallel_degree that divides 6 (1, 2), or resize the model")


def test_kv_heads_not_divisible():
    message = problems(llama(num_key_value_heads=2), 4)
    assert message.endswith("tensor_parallel_degree=4: must divide the model's num_key_value_heads (2); "
                            "fix: use a tensor_parallel_degree that divides 2 (1, 2), or resize the model")


def test_hidden_and_mlp_sizes_not_divisible_are_one_line_each():
    message = problems(llama(hidden_size=12, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=100), 8)
    lines = message.splitlines()[1:]
    assert [line.split(";")[0].strip() for line in lines] == [
        "tensor_parallel_degree=8: must divide the model's num_attention_heads (2)",
        "tensor_parallel_degree=8: must divide the model's num_key_value_heads (2)",
        "tensor_parallel_degree=8: must divide the model's hidden_size (12)",
        "tensor_parallel_degree=8: must divide the model's intermediate_size (100)",
    ]


def test_uneven_vocabulary_is_reported_not_refused():
    notes = check_tensor_parallel(gpt2(vocab_size=250), 4, plan_for(gpt2(vocab_size=250)))
    assert notes == ["vocabulary of 250 rows is not divisible by tensor_parallel_degree=4: shards hold "
                     "63, 63, 63, 61 rows; DTensor pads the short shards in collectives"]


def test_user_plan_split_sizes_are_checked_per_pattern():
    message = problems(mlp(), 4, {"0": "colwise", "2": "rowwise"})
    assert message.splitlines()[1:] == [
        "  tensor_parallel_degree=4: must divide dim 0 of weight in 0 (30); fix: use a tensor_parallel_degree "
        "that divides 30 (1, 2), or resize the model",
        "  tensor_parallel_degree=4: must divide dim 1 of weight in 2 (30); fix: use a tensor_parallel_degree "
        "that divides 30 (1, 2), or resize the model",
    ]


def test_user_plan_local_attrs_are_checked():
    model = mlp(width=32)
    model[0].num_heads = 6
    plan = TensorParallelPlan({"0": "colwise", "2": "rowwise"}, local_attrs={"0": ("num_heads",)})
    assert problems(model, 4, plan) == ("invalid shardwise config: tensor_parallel_degree=4: must divide "
                                        "num_heads of 0 (6); fix: use a tensor_parallel_degree that divides 6 "
                                        "(1, 2), or resize the model")


def test_pattern_matching_nothing_is_named():
    with pytest.raises(ConfigError, match=r"tensor_parallel_plan\['h.\*.attn.c_atn'\]='colwise': matches no "
                                          r"module of GPT2LMHeadModel; fix: "):
        assignments(gpt2(), TensorParallelPlan({"h.*.attn.c_atn": "colwise"}))


def test_unknown_style_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"tensor_parallel_plan\['0'\]='colwsie': unknown style; "
                                          r"fix: did you mean 'colwise'\?"):
        TensorParallelPlan({"0": "colwsie"})


def test_module_matched_twice():
    with pytest.raises(ConfigError, match=r"module '0' already has style 'colwise'; fix: make the patterns "
                                          r"match disjoint modules"):
        assignments(mlp(), TensorParallelPlan({"0": "colwise", "[0]": "rowwise"}))


@pytest.mark.parametrize("style, module", [("colwise", "GELU '1'"), ("colwise_qkv", "Linear '0'")])
def test_style_on_unsupported_module(style, module):
    path = module.split("'")[1]
    assert problems(mlp(), 2, {path: style}) == (
        f"invalid shardwise config: tensor_parallel_plan['{path}']='{style}': this style cannot split "
        f"{module}; fix: give it a style made for its type, or leave it out of the plan")


def test_packed_chunks_are_checked_one_chunk_at_a_time():
    model = gpt2(n_embd=36, n_head=4)  # c_attn: 108 columns, 36 per chunk
    assert problems(model, 8, {"transformer.h.*.attn.c_attn": "colwise_qkv"}) == (
        "invalid shardwise config: tensor_parallel_degree=8: must divide each of the 3 packed chunks of dim 1 of "
        "weight in transformer.h.*.attn.c_attn (36); fix: use a tensor_parallel_degree that divides 36 (1, 2, 4), "
        "or resize the model")


def test_tied_weights_must_be_split_alike():
    message = problems(gpt2(), 2, {"lm_head": "vocab_head"})
    assert message == (
        "invalid shardwise config: tensor_parallel_plan=['transformer.wte.weight', 'lm_head.weight']: tied "
        "parameters must be split alike, got transformer.wte.weight unsplit, lm_head.weight split on dim 0; "
        "fix: give the tied modules matching styles (e.g. 'vocab' and 'vocab_head'), or split neither")


def test_rules_run_on_a_meta_device_model():
    with torch.device("meta"):
        model = gpt2(n_embd=96, n_head=6)
    assert "n_head (6)" in problems(model, 4)
