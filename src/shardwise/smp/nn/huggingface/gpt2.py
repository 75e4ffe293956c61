"""GPT-2: SMP's `DistributedTransformerLMHead` (pre- and post-layer-norm, causal) stood in for `GPT2LMHeadModel`.

As in SMP, a `GPT2LMHeadModel` built under `sw.model_creation(tensor_parallelism=True)`
(or `sw.tensor_parallelism()`) is replaced by one when `DistributedModel` wraps it
(`stand_in`), whatever the tensor-parallel degree, and is called as before:
`model(input_ids=..., attention_mask=..., labels=...)` gives an output with `loss`
and `logits`. Its state dict is in SMP's layout, which these functions translate.

Layouts: `word_embedding`/`position_embedding` ↔ `transformer.wte`/`wpe`; layer i's
`attention.pre_layernorm` ↔ `h.i.ln_1`, `attention.query/key/value` ↔ `h.i.attn.c_attn`
(Q, K and V side by side in one Conv1D), `attention.dense` ↔ `attn.c_proj`,
`output.pre_layernorm` ↔ `ln_2`, `output.dense1/dense2` ↔ `mlp.c_fc/c_proj`; the last
layer's `output.layernorm` ↔ `transformer.ln_f`; `lm_head` ↔ `lm_head`. Conv1D stores
its weight in × out, nn.Linear out × in, so weights are transposed on the way.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Optional

import torch

from ....parallel.tensor.registration import Registration
from .causal_lm import causal_lm_stand_in, gpt_arguments
from .layout import StateDict

_EMBEDDINGS = {"word_embedding": "transformer.wte", "position_embedding": "transformer.wpe"}
_LAYER_PARTS = {  # SMP's name in layer i -> (GPT-2's name in block i, stored transposed)
    "attention.pre_layernorm": ("ln_1", False),
    "attention.dense": ("attn.c_proj", True),
    "output.pre_layernorm": ("ln_2", False),
    "output.dense1": ("mlp.c_fc", True),
    "output.dense2": ("mlp.c_proj", True),
}
_QKV = ("query", "key", "value")
_SMP_KEY = re.compile(r"^(?P<prefix>.*?)(?:(?P<embedding>word_embedding|position_embedding)|"
                      r"transformer\.seq_layers\.(?P<layer>\d+)\.(?P<part>[\w.]+?))\.(?P<leaf>weight|bias)$")
_HF_KEY = re.compile(r"^(?P<prefix>.*?)transformer\.(?:(?P<embedding>wte|wpe)|ln_f|h\.(?P<layer>\d+)\."
                     r"(?P<part>[\w.]+?))\.(?P<leaf>weight|bias)$")
_HF_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$")  # causal-mask buffers older transformers saved


def _t(value: torch.Tensor, transpose: bool) -> torch.Tensor:
    """A linear weight between nn.Linear's (out × in) and HF Conv1D's (in × out) storage."""
    return value.t().contiguous() if transpose else value


def translate_state_dict_to_hf_gpt2(state_dict: StateDict, max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """A `DistributedTransformerLMHead` state dict as `GPT2LMHeadModel`'s (see module docstring); keys already
    Hugging Face's pass through. `max_seq_len` sized the causal-mask buffers older transformers kept in the
    state dict; the installed one keeps none."""
    layers = [int(m.group("layer")) for m in map(_SMP_KEY.match, state_dict) if m and m.group("layer")]
    last = max(layers, default=None)
    qkv: dict[tuple[str, str, str], dict[str, torch.Tensor]] = defaultdict(dict)  # (prefix, layer, leaf) -> parts
    result = {}
    for key, value in state_dict.items():
        found = _SMP_KEY.match(key)
        if found is None:
            result[key] = value
            continue
        prefix, layer, part, leaf = found.group("prefix", "layer", "part", "leaf")
        if found.group("embedding"):
            result[f"{prefix}{_EMBEDDINGS[found.group('embedding')]}.{leaf}"] = value
        elif part.startswith("attention.") and part.split(".", 1)[1] in _QKV:
            qkv[prefix, layer, leaf][part.split(".", 1)[1]] = value
        elif part == "output.layernorm" and int(layer) == last:
            result[f"{prefix}transformer.ln_f.{leaf}"] = value
        elif part in _LAYER_PARTS:
            name, transpose = _LAYER_PARTS[part]
            result[f"{prefix}transformer.h.{layer}.{name}.{leaf}"] = _t(value, transpose and leaf == "weight")
        else:
            result[key] = value
    for (prefix, layer, leaf), parts in qkv.items():
        ordered = [_t(parts[name], leaf == "weight") for name in _QKV]
        result[f"{prefix}transformer.h.{layer}.attn.c_attn.{leaf}"] = torch.cat(ordered, dim=-1)
    return result


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: StateDict,
                                                  max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """A `GPT2LMHeadModel` state dict (from Hugging Face or `translate_state_dict_to_hf_gpt2`) in SMP's layout,
    to load into the stand-in; keys in neither layout pass through, the old causal-mask buffers are dropped."""
    layers = [int(m.group("layer")) for m in map(_HF_KEY.match, state_dict) if m and m.group("layer")]
    last = max(layers, default=0)
    to_smp = {hf: (smp, transpose) for smp, (hf, transpose) in _LAYER_PARTS.items()}
    embeddings = {hf.split(".")[1]: smp for smp, hf in _EMBEDDINGS.items()}
    result = {}
    for key, value in state_dict.items():
        if _HF_BUFFERS.search(key):
            continue
        found = _HF_KEY.match(key)
        if found is None or found.group("part") not in (None, "attn.c_attn", *to_smp):
            result[key] = value
            continue
        prefix, layer, part, leaf = found.group("prefix", "layer", "part", "leaf")
        if found.group("embedding"):
            result[f"{prefix}{embeddings[found.group('embedding')]}.{leaf}"] = value
        elif layer is None:  # ln_f
            result[f"{prefix}transformer.seq_layers.{last}.output.layernorm.{leaf}"] = value
        elif part == "attn.c_attn":
            for name, piece in zip(_QKV, value.chunk(3, dim=-1)):
                result[f"{prefix}transformer.seq_layers.{layer}.attention.{name}.{leaf}"] = _t(piece, leaf == "weight")
        else:
            name, transpose = to_smp[part]
            result[f"{prefix}transformer.seq_layers.{layer}.{name}.{leaf}"] = _t(value, transpose and leaf == "weight")
    return result


def _arguments(config: Any) -> tuple[tuple, dict[str, Any]]:
    """`DistributedTransformerLMHead`'s arguments for a `GPT2Config`: the same model, its weights drawn anew."""
    unsupported = [name for name in ("add_cross_attention", "scale_attn_by_inverse_layer_idx",
                                     "reorder_and_upcast_attn") if getattr(config, name, False)]
    if unsupported or not getattr(config, "scale_attn_weights", True):
        raise ValueError(f"GPT-2 with {', '.join(unsupported) or 'scale_attn_weights=False'} has no stand-in; "
                         "fix: build it outside sw.model_creation(tensor_parallelism=True) to keep Hugging Face's "
                         "modules, split by the built-in GPT-2 plan")
    return (), gpt_arguments(config)


def stand_in() -> Registration:
    """SMP's stand-in for `GPT2LMHeadModel` (see module docstring)."""
    return causal_lm_stand_in("GPT-2", _arguments, "CausalLMOutputWithCrossAttentions", translate_state_dict_to_hf_gpt2)
