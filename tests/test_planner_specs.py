"""Model specs: parameter counts against real models, presets, and every way to name a model."""

import json
import sys

import pytest
import torch
import transformers

from shardwise.planner import MODEL_PRESETS, PlanError, resolve_model, spec_from_hf
from shardwise.planner.families import DEFAULTS

TINY = {
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)),
    "gpt2-untied": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, tie_word_embeddings=False)),
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=160, vocab_size=256, max_position_embeddings=64)),
    "bert": (transformers.BertForMaskedLM, transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=256,
        max_position_embeddings=64)),
    "vit": (transformers.ViTForImageClassification, transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, image_size=32,
        patch_size=8, num_labels=10)),
}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _sizes(module: torch.nn.Module) -> list[int]:
    return sorted(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(TINY))
def test_parameter_tensors_equal_the_built_model(name):
    model_class, hf_config = TINY[name]
    with torch.device("meta"):
        model = model_class(hf_config)
    spec = spec_from_hf(hf_config.to_dict(), name)
    assert spec.parameters == _count(model)
    assert sorted(spec.stage_tensors(1)) == _sizes(model)
    blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    assert sorted(spec.layer_tensors) == _sizes(blocks[0])


@pytest.mark.parametrize("family,config_class", [("gpt2", transformers.GPT2Config), ("llama", transformers.LlamaConfig),
                                                 ("bert", transformers.BertConfig), ("vit", transformers.ViTConfig)])
def test_family_defaults_are_the_transformers_defaults(family, config_class):
    from_transformers = spec_from_hf(config_class().to_dict(), family)
    assert from_transformers == resolve_model(family)


def test_seed_presets_have_the_seeds_shapes():
    sizes = {name: resolve_model(name).parameters / 1e9 for name in ("gpt2-10b", "gpt2-30b", "gpt2-60b")}
    assert sizes == {"gpt2-10b": pytest.approx(10, rel=0.02), "gpt2-30b": pytest.approx(30, rel=0.01),
                     "gpt2-60b": pytest.approx(60, rel=0.02)}
    for name in sizes:
        spec = resolve_model(name)
        assert (spec.seq_len, spec.vocab) == (512, 50000)
    vit = resolve_model("vit-630m")
    assert (vit.hidden, vit.layers, vit.heads, vit.ffn, vit.seq_len) == (1024, 50, 16, 4096, (256 // 16) ** 2 + 1)
    assert vit.parameters == pytest.approx(630e6, rel=0.01)


def test_flops_per_token_is_six_n_plus_attention():
    spec = resolve_model("gpt2-10b")
    n = spec.layers * spec.layer_parameters + spec.vocab * spec.hidden
    assert spec.flops_per_token(512) == 6 * n + 12 * spec.layers * spec.hidden * 512


def test_family_with_overrides_and_config_json(tmp_path):
    spec = resolve_model("llama:hidden_size=512,num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=2")
    assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads) == (512, 4, 8, 2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY["bert"][1].to_dict()))
    assert resolve_model(str(path)).parameters == spec_from_hf(TINY["bert"][1].to_dict(), "bert").parameters
    assert resolve_model(str(tmp_path)).family == "bert"        # a model directory works too


def test_builder_is_counted_on_the_meta_device(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import transformers\n"
        "def build():\n"
        "    return transformers.ViTForImageClassification(transformers.ViTConfig(\n"
        "        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,\n"
        "        image_size=32, patch_size=8, num_labels=10))\n"
        "def not_a_model():\n"
        "    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = resolve_model("my_models:build")
    assert spec.family == "vit" and spec.parameters == spec_from_hf(TINY["vit"][1].to_dict(), "vit").parameters
    with pytest.raises(PlanError, match=r"not_a_model\(\) returned int, not a torch.nn.Module"):
        resolve_model("my_models:not_a_model")
    with pytest.raises(PlanError, match=r"unknown function in module 'my_models': 'biuld' \(did you mean 'build'\?\)"):
        resolve_model("my_models:biuld")
    sys.modules.pop("my_models", None)


@pytest.mark.parametrize("text,message", [
    ("gpt2-10", r"unknown model 'gpt2-10' \(did you mean 'gpt2-10b'\?\); give a preset"),
    ("gpt2:n_lyer=3", r"'n_lyer' \(did you mean 'n_layer'\?\)"),
    ("gpt2:n_layer", r"'n_layer' is not key=value"),
    ("no_such_module_xyz:build", r"cannot import module 'no_such_module_xyz'"),
    ("missing/config.json", r"cannot read model config 'missing/config.json'"),
])
def test_bad_model_names_get_one_line_errors(text, message):
    with pytest.raises(PlanError, match=message) as err:
        resolve_model(text)
    assert "\n" not in str(err.value)


def test_unsupported_family_in_config_json(tmp_path):
    path = tmp_path / "t5.json"
    path.write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(PlanError, match=r"'t5' is not a supported family"):
        resolve_model(str(path))


def test_every_preset_resolves():
    assert all(resolve_model(name).parameters > 0 for name in [*MODEL_PRESETS, *DEFAULTS])


def test_one_registry_of_families_serves_the_planner_and_tensor_parallelism():
    """An alias such as Mistral reads as the same family in both, from shardwise/families.py."""
    from shardwise.families import ALIASES, FAMILIES
    from shardwise.parallel.tensor.registry import _BUILDERS
    from shardwise.planner.families import BUILDERS

    assert set(BUILDERS) == set(_BUILDERS) == set(FAMILIES)
    assert ALIASES == {"mistral": "llama"}
