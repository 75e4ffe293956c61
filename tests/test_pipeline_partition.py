"""Where the pipeline cuts a model, and every bad pipeline setting as one clear ConfigError.

Pure: no process group. The partition works on models built on the meta
device; config rules are checked by `parse_config` (what `init`, `check-config`
and `shardwise run` all call) before anything starts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError, parse_config
from shardwise.config.effects import ineffective_settings
from shardwise.parallel.pipeline import find_blocks, partition
from tiny_models import tiny_gpt2, tiny_llama


class _Stack(nn.Module):
    """Not a Hugging Face model: a large embedding table, a list of residual blocks, a small head."""

    def __init__(self, layers: int = 8, hidden: int = 16, vocab: int = 4096):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 4)
        self.scale = nn.Identity()  # no parameters: runs on every stage


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("build, path, before, after", [
    (tiny_gpt2, "transformer.h", ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "lm_head")),
    (tiny_llama, "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head")),
    (_Stack, "blocks", ("embed",), ("head",)),
])
def test_blocks_embeddings_first_head_last(build, path, before, after):
    """The repeated blocks are cut; what comes before them goes with the first stage, what comes after
    (innermost first, in forward order) with the last. Works on the meta device."""
    with torch.device("meta"):
        blocks = find_blocks(build(layers=4))
    assert (blocks.path, blocks.before, blocks.after) == (path, before, after)


def test_balance_by_parameters_or_by_compute():
    """A 64k-parameter embedding outweighs the 272-parameter blocks: balanced by parameters the first stage
    keeps one block; by compute (an embedding lookup costs no matmul) the blocks split evenly."""
    model = _Stack()
    assert partition(model, 2, "parameters").bounds == ((0, 1), (1, 8))
    assert partition(model, 2, "compute").bounds == ((0, 4), (4, 8))
    assert partition(model, 4, "compute").bounds == ((0, 2), (2, 4), (4, 6), (6, 8))


def test_stages_the_ends_do_not_bound_share_the_blocks_evenly():
    """A 64k-parameter embedding and head set the costliest stages whatever the rest get: among the splits that
    keep to them, the middle stages share the blocks evenly (the first split found gave them 1 and 5)."""
    model = _Stack(layers=8)
    model.head = nn.Linear(16, 4096)
    part = partition(model, 4, "parameters")
    assert [b - a for a, b in part.bounds] == [1, 3, 3, 1]
    assert max(part.costs) == part.costs[-1]


def test_printed_partition_names_every_stage():
    part = partition(tiny_gpt2(layers=4), 3, split_points=[1, 3])
    assert part.describe([0, 1, 2]).splitlines() == [
        "pipeline partition of transformer.h (4 blocks) into 3 stages, at the configured split points:",
        "  stage 0 (pp rank 0): transformer.wte, transformer.wpe, transformer.h.0 — 0.0171M params",
        "  stage 1 (pp rank 1): transformer.h.1-2 — 0.0254M params",
        "  stage 2 (pp rank 2): transformer.h.3, transformer.ln_f, lm_head — 0.0169M params",
    ]


def test_more_stages_than_blocks():
    model = tiny_gpt2(layers=2)
    assert _message(partition, model, 4) == (
        "invalid shardwise config: pipeline_parallel_degree=4: cuts transformer.h into 4 stages of at least one "
        "block each, but it has 2 blocks; fix: use a pipeline_parallel_degree of at most 2")
    assert "pipeline_parallel_degree=2: × virtual_stages 2 cuts transformer.h into 4 stages of at least one block " \
           "each, but it has 2 blocks; fix: make pipeline_parallel_degree × virtual_stages at most 2" in _message(
               partition, model, 4, virtual_stages=2)


def test_split_point_past_the_last_block():
    assert _message(partition, tiny_gpt2(layers=4), 2, split_points=[4]) == (
        "invalid shardwise config: pipeline_split_points=[4]: must be 1 increasing block indices between 1 and 3 "
        "(transformer.h has 4 blocks, cut into 2 stages); fix: give the index of the first block of every stage "
        "but the first")


def test_model_without_repeated_blocks():
    with pytest.raises(ValueError, match="needs a sequence of repeated blocks .* and Linear has none"):
        find_blocks(nn.Linear(2, 2))


PP = {"pipeline_parallel_degree": 2}
CONFIG_CASES = {
    "virtual stages with a one-stage schedule": (
        {**PP, "pipeline_schedule": "1f1b", "virtual_stages": 2},
        "virtual_stages=2: pipeline_schedule 1f1b runs one stage per rank; fix: use pipeline_schedule "
        "interleaved_1f1b (or interleaved_zero_bubble), or drop virtual_stages"),
    "zbv with three stages per rank": (
        {**PP, "pipeline_schedule": "zbv_zero_bubble", "virtual_stages": 3},
        "virtual_stages=3: zbv_zero_bubble runs exactly two stages per rank (a V shape); fix: set virtual_stages "
        "to 2, or drop it"),
    "split points for the wrong number of stages": (
        {**PP, "pipeline_schedule": "interleaved_1f1b", "pipeline_split_points": [2]},
        "pipeline_split_points=[2]: must be 3 increasing block indices ≥ 1, one per stage but the first (4 stages "
        "= pipeline_parallel_degree 2 × 2 per rank); fix: give the index of the first block of every stage but "
        "the first"),
    "active microbatches not dividing microbatches": (
        {**PP, "pipeline_schedule": "gpipe", "microbatches": 6, "active_microbatches": 4},
        "active_microbatches=4: must divide microbatches (6): the pipeline runs them in rounds of "
        "active_microbatches; fix: use a divisor of 6: 1, 2, 3, 6"),
    "interleaved round torch cannot run": (
        {**PP, "pipeline_schedule": "interleaved_1f1b", "microbatches": 5},
        "microbatches=5: interleaved_1f1b runs microbatches in rounds of pipeline_parallel_degree (2): 5 is "
        "neither below 4 nor a multiple of 2; fix: use a multiple of 2"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_pipeline_config_rule(case):
    config, expected = CONFIG_CASES[case]
    assert _message(parse_config, config) == f"invalid shardwise config: {expected}"


@pytest.mark.parametrize("config, schedule, pipeline_round, stages_per_rank, inert", [
    # 1f1b below pp: rounds of active_microbatches, run as GPipe
    ({**PP, "microbatches": 4, "active_microbatches": 1}, "1f1b", 1, 1, []),
    ({**PP, "pipeline_schedule": "zbv_zero_bubble", "sharded_data_parallel_degree": 2, "microbatches": 3},
     "zbv_zero_bubble", 3, 2, []),
    ({**PP, "pipeline_schedule": "interleaved_zero_bubble", "microbatches": 6, "active_microbatches": 3, "fp16": True},
     "interleaved_zero_bubble", 3, 2, []),
    # pipeline keys are inert without pipeline stages: accepted, and named as doing nothing
    ({"pipeline_split_points": [5], "virtual_stages": 1}, "1f1b", 1, 1, ["virtual_stages", "pipeline_split_points"]),
])
def test_supported_combinations_pass(config, schedule, pipeline_round, stages_per_rank, inert):
    """Accepted as given, and read as the pipeline runs them: the schedule, its round of microbatches, the stages
    on each rank, and the keys that do nothing in this layout."""
    parsed = parse_config(config)
    assert {key: getattr(parsed, key) for key in config} == config
    assert (parsed.pipeline_schedule, parsed.pipeline_round, parsed.stages_per_rank) == (
        schedule, pipeline_round, stages_per_rank)
    assert [key for key, _ in ineffective_settings(parsed)] == inert


def _heavy_ends(family: str):
    """A Hugging Face model of 12 narrow blocks whose embedding (and head, or patch projection) outweighs several."""
    import transformers as hf

    small = dict(hidden_size=16, num_hidden_layers=12, num_attention_heads=2, intermediate_size=32)
    configs = {
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=12, n_embd=16, n_head=2, vocab_size=4096,
                                                         n_positions=8)),
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**small, num_key_value_heads=1, vocab_size=4096)),
        "bert": lambda: hf.BertForMaskedLM(hf.BertConfig(**small, vocab_size=4096)),
        "vit": lambda: hf.ViTForImageClassification(hf.ViTConfig(**small, image_size=32, patch_size=16,
                                                                  num_channels=3, num_labels=4)),
    }
    return configs[family]()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "vit"])
@pytest.mark.parametrize("balance", ["parameters", "compute"])
def test_the_planner_predicts_the_cut_the_runtime_makes(family, balance):
    """The planner deals a spec's blocks to stages as the runtime deals a real model's: the same sizes for
    every stage count and schedule (the embedding and head weigh differently in every family)."""
    from shardwise.planner.bubbles import stage_sizes
    from shardwise.planner.families import spec_from_hf

    with torch.device("meta"):
        model = _heavy_ends(family)
    spec = spec_from_hf(model.config.to_dict(), family)
    for pp, virtual in [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2)]:
        config = parse_config({"pipeline_parallel_degree": pp, "pipeline_balance": balance,
                               **({"pipeline_schedule": "interleaved_1f1b", "virtual_stages": virtual}
                                  if virtual > 1 else {})})
        runtime = partition(model, pp * virtual, balance, virtual_stages=virtual)
        assert stage_sizes(spec, pp * virtual, config) == [b - a for a, b in runtime.bounds], (pp, virtual)
