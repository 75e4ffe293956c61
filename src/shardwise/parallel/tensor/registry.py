"""Built-in plans for Hugging Face models, chosen by `config.model_type`.

Each transformer block is split Megatron-style: the projections into attention
heads / MLP hidden units are column-parallel, the projections back are
row-parallel, so a block costs one all-reduce forward and one backward per
attention and per MLP, and each rank runs num_heads / tp whole heads. The token
embedding and the output head are split over the vocabulary. Norms, position
embeddings and small classifier heads stay replicated; with sequence parallelism
the norms inside the blocks run on sequence shards (`SequencePlan`).

Patterns are written against the base model (`model.base_model`), so one plan
serves the bare model and every head class (…ForCausalLM, …ForMaskedLM, …).
Module names follow the installed transformers (≥ 5); for other models, or names
a version spells differently, pass a `TensorParallelPlan` / dict to
`apply_tensor_parallel(..., plan=...)`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from torch import nn

from ...families import MODEL_TYPES, family_of
from .plan import SequencePlan, TensorParallelPlan


def _base_prefix(model: nn.Module) -> str:
    """'transformer.' for GPT2LMHeadModel, '' for GPT2Model itself."""
    base = getattr(model, "base_model", model)
    path = next(name for name, module in model.named_modules() if module is base)
    return f"{path}." if path else ""


def _head(model: nn.Module, path: str) -> dict[str, str]:
    """The vocabulary output head, when this head class has one."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return {}
    return {path: "vocab_head"} if isinstance(module, nn.Linear) else {}


def _gpt2(model: nn.Module, c) -> TensorParallelPlan:
    p = _base_prefix(model)
    styles = {
        f"{p}wte": "vocab",
        f"{p}h.*.attn.c_attn": "colwise_qkv",  # Q, K, V packed side by side in one Conv1D
        f"{p}h.*.attn.c_proj": "rowwise",
        f"{p}h.*.mlp.c_fc": "colwise",
        f"{p}h.*.mlp.c_proj": "rowwise",
        **_head(model, "lm_head"),
    }
    return TensorParallelPlan(
        styles, local_attrs={f"{p}h.*.attn": ("split_size", "num_heads")},
        dims={"n_head": c.n_head, "n_embd": c.n_embd, "n_inner": c.n_inner or 4 * c.n_embd},
        name="gpt2", sequence=SequencePlan(f"{p}h.*", (f"{p}h.*.ln_1", f"{p}h.*.ln_2")))


def _llama(model: nn.Module, c) -> TensorParallelPlan:
    p = _base_prefix(model)
    attn, mlp = f"{p}layers.*.self_attn", f"{p}layers.*.mlp"
    styles = {
        f"{p}embed_tokens": "vocab",
        attn: "fan_out", mlp: "fan_out",
        f"{attn}.q_proj": "colwise", f"{attn}.k_proj": "colwise", f"{attn}.v_proj": "colwise",
        f"{attn}.o_proj": "rowwise",
        f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise",
        f"{mlp}.down_proj": "rowwise",
        **_head(model, "lm_head"),
    }
    return TensorParallelPlan(
        styles, local_attrs={attn: ("num_heads", "num_key_value_heads", "hidden_size")},
        dims={"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size},
        name=c.model_type,
        sequence=SequencePlan(f"{p}layers.*", (f"{p}layers.*.input_layernorm",
                                               f"{p}layers.*.post_attention_layernorm")))


def _bert(model: nn.Module, c) -> TensorParallelPlan:
    p = _base_prefix(model)
    layer = f"{p}encoder.layer.*"
    styles = {
        f"{p}embeddings.word_embeddings": "vocab",
        f"{layer}.attention.self": "fan_out",
        f"{layer}.attention.self.query": "colwise", f"{layer}.attention.self.key": "colwise",
        f"{layer}.attention.self.value": "colwise",
        f"{layer}.attention.output.dense": "rowwise",
        f"{layer}.intermediate.dense": "colwise",
        f"{layer}.output.dense": "rowwise",
        **_head(model, "cls.predictions.decoder"),
    }
    return TensorParallelPlan(
        styles, local_attrs={f"{layer}.attention.self": ("num_attention_heads", "all_head_size")},
        dims={"num_attention_heads": c.num_attention_heads, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size},
        name="bert",
        sequence=SequencePlan(layer, (f"{layer}.attention.output.LayerNorm", f"{layer}.output.LayerNorm")))


def _vit(model: nn.Module, c) -> TensorParallelPlan:
    p = _base_prefix(model)
    attn, mlp = f"{p}layers.*.attention", f"{p}layers.*.mlp"
    styles = {
        attn: "fan_out",
        f"{attn}.q_proj": "colwise", f"{attn}.k_proj": "colwise", f"{attn}.v_proj": "colwise",
        f"{attn}.o_proj": "rowwise",
        f"{mlp}.fc1": "colwise",
        f"{mlp}.fc2": "rowwise",
    }
    return TensorParallelPlan(
        styles, local_attrs={attn: ("num_attention_heads",)},
        dims={"num_attention_heads": c.num_attention_heads, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size},
        name="vit",
        sequence=SequencePlan(f"{p}layers.*", (f"{p}layers.*.layernorm_before", f"{p}layers.*.layernorm_after")))


def _mixtral(model: nn.Module, c) -> TensorParallelPlan:
    """Attention, embedding and head split as Llama's; each mixture-of-experts block stays whole on every
    tensor-parallel rank (expert parallelism splits its experts, parallel/experts/). No sequence parallelism:
    the block's router and experts would then see a slice of the tokens on each rank."""
    plan = _llama(model, c)
    mlp = f"{_base_prefix(model)}layers.*.mlp"
    return dataclasses.replace(plan, styles={k: v for k, v in plan.styles.items() if not k.startswith(mlp)},
                               dims={k: v for k, v in plan.dims.items() if k != "intermediate_size"},
                               name=c.model_type, sequence=None)


_BUILDERS: dict[str, Callable[[nn.Module, object], TensorParallelPlan]] = {  # by family (shardwise/families.py)
    "gpt2": _gpt2,
    "llama": _llama,
    "bert": _bert,
    "vit": _vit,
    "mixtral": _mixtral,
}

BUILTIN_MODEL_TYPES = MODEL_TYPES


def builtin_plan(model: nn.Module) -> Optional[TensorParallelPlan]:
    """The built-in plan for a supported Hugging Face model, else None."""
    config = getattr(model, "config", None)
    builder = _BUILDERS.get(family_of(getattr(config, "model_type", None)))
    return builder(model, config) if builder else None
