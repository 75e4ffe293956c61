"""Hugging Face configs of the supported families (GPT-2, Llama, BERT, ViT) → `ModelSpec`.

Pure: a config is a plain dict (a parsed `config.json`, or an architecture name
with overrides), read with the family's Hugging Face defaults, so no `transformers`
import (which loads torch) is needed. Parameter counts follow each family's module
layout in `transformers` (GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM,
ViTForImageClassification); a test compares them with models built on the meta device.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..families import ALIASES
from ..families import family_of as registered_family
from .errors import PlanError, unknown
from .expert_families import MIXTRAL_DEFAULTS, mixtral_spec
from .spec import ModelSpec

# Defaults of the transformers config classes, for the keys the planner reads.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
             "n_positions": 1024, "activation_function": "gelu_new", "attn_pdrop": 0.1,
             "resid_pdrop": 0.1, "tie_word_embeddings": True},
    "llama": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": None, "head_dim": None, "intermediate_size": 11008,
              "vocab_size": 32000, "max_position_embeddings": 2048, "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
              "tie_word_embeddings": False},
    "bert": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 512,
             "type_vocab_size": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
             "attention_probs_dropout_prob": 0.1, "tie_word_embeddings": True},
    "vit": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0, "image_size": 224, "patch_size": 16,
            "num_channels": 3, "qkv_bias": True, "num_labels": 2},
}


def _linear(fan_in: int, fan_out: int, bias: bool = True) -> tuple[int, ...]:
    """A linear layer's tensors: weight, then bias."""
    return (fan_in * fan_out,) + ((fan_out,) if bias else ())


def _norm(h: int, bias: bool = True) -> tuple[int, ...]:
    return (h, h) if bias else (h,)


def _gpt2(c: Mapping[str, Any], name: str) -> ModelSpec:
    h, layers, vocab, positions = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_positions"]
    f = c["n_inner"] or 4 * h
    layer = _norm(h) + _linear(h, 3 * h) + _linear(h, h) + _norm(h) + _linear(h, f) + _linear(f, h)
    tied = bool(c["tie_word_embeddings"])
    embedding = (vocab * h, positions * h)
    head = _norm(h) + (() if tied else (vocab * h,))
    return ModelSpec(name=name, family="gpt2", hidden=h, layers=layers, heads=c["n_head"],
                     kv_heads=c["n_head"], ffn=f, vocab=vocab, seq_len=positions,
                     activation=c["activation_function"], gated_mlp=False, norm="layernorm",
                     attention_dropout=c["attn_pdrop"], hidden_dropout=c["resid_pdrop"],
                     parameters=sum(embedding) + layers * sum(layer) + sum(head), layer_tensors=layer,
                     embedding_tensors=embedding, head_tensors=head, tied_head=tied,
                     head_outputs=vocab, head_saved_elements=2 * h)


def _llama(c: Mapping[str, Any], name: str) -> ModelSpec:
    h, layers, heads, vocab = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["vocab_size"]
    kv = c["num_key_value_heads"] or heads
    d = c["head_dim"] or h // heads
    f, qkv_bias, mlp_bias = c["intermediate_size"], c["attention_bias"], c["mlp_bias"]
    attention = (_linear(h, heads * d, qkv_bias) + 2 * _linear(h, kv * d, qkv_bias)
                 + _linear(heads * d, h, qkv_bias))
    layer = _norm(h, False) + attention + _norm(h, False) + 2 * _linear(h, f, mlp_bias) + _linear(f, h, mlp_bias)
    tied = bool(c["tie_word_embeddings"])
    head = _norm(h, False) + (() if tied else (vocab * h,))
    return ModelSpec(name=name, family="llama", hidden=h, layers=layers, heads=heads, kv_heads=kv,
                     ffn=f, vocab=vocab, seq_len=c["max_position_embeddings"], activation=c["hidden_act"],
                     gated_mlp=True, norm="rmsnorm", attention_dropout=c["attention_dropout"],
                     hidden_dropout=0.0, parameters=vocab * h + layers * sum(layer) + sum(head),
                     layer_tensors=layer, embedding_tensors=(vocab * h,), head_tensors=head,
                     tied_head=tied, head_outputs=vocab, head_saved_elements=3 * h)


def _bert(c: Mapping[str, Any], name: str) -> ModelSpec:
    h, layers, vocab, f = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    positions = c["max_position_embeddings"]
    embedding = (vocab * h, positions * h, c["type_vocab_size"] * h) + _norm(h)
    layer = 4 * _linear(h, h) + _norm(h) + _linear(h, f) + _linear(f, h) + _norm(h)
    tied = bool(c["tie_word_embeddings"])
    # BertForMaskedLM's prediction head: dense + LayerNorm transform, then a decoder with its own bias.
    head = _linear(h, h) + _norm(h) + (vocab,) + (() if tied else (vocab * h,))
    return ModelSpec(name=name, family="bert", hidden=h, layers=layers, heads=c["num_attention_heads"],
                     kv_heads=c["num_attention_heads"], ffn=f, vocab=vocab, seq_len=positions,
                     activation=c["hidden_act"], gated_mlp=False, norm="layernorm",
                     attention_dropout=c["attention_probs_dropout_prob"], hidden_dropout=c["hidden_dropout_prob"],
                     parameters=sum(embedding) + layers * sum(layer) + sum(head), layer_tensors=layer,
                     embedding_tensors=embedding, head_tensors=head, tied_head=tied, head_outputs=vocab,
                     embedding_saved_elements=2 * h, head_saved_elements=4 * h)


def _vit(c: Mapping[str, Any], name: str) -> ModelSpec:
    h, layers, f = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    patch, channels = c["patch_size"], c["num_channels"]
    patches = (c["image_size"] // patch) ** 2
    labels = len(c["id2label"]) if c.get("id2label") else c["num_labels"]
    embedding = (h, (patches + 1) * h) + _linear(channels * patch * patch, h)
    layer = (_norm(h) + 3 * _linear(h, h, c["qkv_bias"]) + _linear(h, h) + _norm(h)
             + _linear(h, f) + _linear(f, h))
    head = _norm(h) + _linear(h, labels)
    pixels = channels * patch * patch * patches / (patches + 1)  # per token, the CLS token carrying none
    return ModelSpec(name=name, family="vit", hidden=h, layers=layers, heads=c["num_attention_heads"],
                     kv_heads=c["num_attention_heads"], ffn=f, vocab=0, seq_len=patches + 1,
                     activation=c["hidden_act"], gated_mlp=False, norm="layernorm",
                     attention_dropout=c["attention_probs_dropout_prob"], hidden_dropout=c["hidden_dropout_prob"],
                     parameters=sum(embedding) + layers * sum(layer) + sum(head), layer_tensors=layer,
                     embedding_tensors=embedding, head_tensors=head, tied_head=False, head_outputs=0,
                     input_elements_per_token=pixels, embedding_saved_elements=pixels, head_saved_elements=2 * h)


DEFAULTS["mixtral"] = MIXTRAL_DEFAULTS
BUILDERS: dict[str, Callable[[Mapping[str, Any], str], ModelSpec]] = {
    "gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit, "mixtral": mixtral_spec}


def family_of(config: Mapping[str, Any], source: str) -> str:
    """The supported family a Hugging Face config belongs to, from its `model_type`."""
    model_type = str(config.get("model_type", ""))
    family = registered_family(model_type)
    if family not in BUILDERS:
        shown = repr(model_type) if model_type else "no model_type"
        raise PlanError(f"{source}: {shown} is not a supported family; the planner reads "
                        f"{', '.join(sorted(BUILDERS))} (and {', '.join(sorted(ALIASES))}) configs")
    return family


def spec_from_hf(config: Mapping[str, Any], name: str, source: str = "config") -> ModelSpec:
    """A `ModelSpec` from a Hugging Face config dict; keys it lacks take the family's defaults."""
    family = family_of(config, source)
    merged = {**DEFAULTS[family], **{k: v for k, v in config.items() if k in DEFAULTS[family] or k == "id2label"}}
    return BUILDERS[family](merged, name)


def with_overrides(family: str, overrides: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A config dict for `family` with user overrides, refusing keys the planner does not read."""
    for key in overrides:
        if key not in DEFAULTS[family]:
            raise unknown(f"{family} config key in {source!r}:", key, DEFAULTS[family])
    return {"model_type": family, **overrides}
