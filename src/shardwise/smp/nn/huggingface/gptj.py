"""GPT-J: SMP's `DistributedTransformerLMHead` (rotary, parallel attention and MLP) stood in for `GPTJForCausalLM`.

As in SMP, a `GPTJForCausalLM` built under `sw.model_creation(tensor_parallelism=True)`
(or `sw.tensor_parallelism()`) is replaced by one when `DistributedModel` wraps it
(`stand_in`), whatever the tensor-parallel degree, and is called as before:
`model(input_ids=..., attention_mask=..., labels=...)` gives an output with `loss`
and `logits`. Its state dict is in SMP's layout, which these functions translate.

Layouts: `word_embedding` ↔ `transformer.wte`; layer i's `pre_layernorm` ↔ `h.i.ln_1`
(one norm for attention and MLP), `attention.query/key/value/dense` ↔
`attn.q_proj/k_proj/v_proj/out_proj`, `output.dense1/dense2` ↔ `mlp.fc_in/fc_out`;
the last layer's `layernorm` ↔ `transformer.ln_f`; `lm_head` ↔ `lm_head` (untied,
with a bias). Both sides are nn.Linear, so weights keep their storage.
"""

from __future__ import annotations

import re
from typing import Any, Optional


from ....parallel.tensor.registration import Registration
from .causal_lm import causal_lm_stand_in, gpt_arguments
from .layout import StateDict, renamed

_LAYER_PARTS = {  # SMP's name in layer i -> GPT-J's name in block i
    "pre_layernorm": "ln_1",
    "attention.query": "attn.q_proj",
    "attention.key": "attn.k_proj",
    "attention.value": "attn.v_proj",
    "attention.dense": "attn.out_proj",
    "output.dense1": "mlp.fc_in",
    "output.dense2": "mlp.fc_out",
}
_SMP_LAYER = re.compile(r"(?:^|\.)transformer\.seq_layers\.(\d+)\.")
_HF_LAYER = re.compile(r"(?:^|\.)transformer\.h\.(\d+)\.")
_HF_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$")  # causal-mask buffers older transformers saved


def _last_layer(state_dict: StateDict, layer: re.Pattern) -> Optional[int]:
    return max((int(found.group(1)) for found in map(layer.search, state_dict) if found), default=None)


def translate_state_dict_to_hf_gptj(state_dict: StateDict, max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """A `DistributedTransformerLMHead` state dict as `GPTJForCausalLM`'s (see module docstring); keys already
    Hugging Face's pass through. `max_seq_len` sized the causal-mask buffers older transformers kept in the
    state dict; the installed one keeps none."""
    last = _last_layer(state_dict, _SMP_LAYER)
    final_norm = [] if last is None else [(rf"transformer\.seq_layers\.{last}\.layernorm\.", "transformer.ln_f.")]
    return renamed(state_dict, [*final_norm, (r"(?<!\w)word_embedding\.", "transformer.wte."), *(
        (rf"transformer\.seq_layers\.(\d+)\.{re.escape(smp)}\.", rf"transformer.h.\1.{hf}.")
        for smp, hf in _LAYER_PARTS.items())])


def translate_hf_state_dict_to_smdistributed_gptj(state_dict: StateDict) -> dict[str, Any]:
    """A `GPTJForCausalLM` state dict (from Hugging Face or `translate_state_dict_to_hf_gptj`) in SMP's layout,
    to load into the stand-in; keys in neither layout pass through, the old causal-mask buffers are dropped."""
    kept = {key: value for key, value in state_dict.items() if not _HF_BUFFERS.search(key)}
    last = _last_layer(kept, _HF_LAYER)
    final_norm = f"transformer.seq_layers.{0 if last is None else last}.layernorm."
    return renamed(kept, [(r"transformer\.ln_f\.", final_norm),
                          (r"transformer\.wte\.", "word_embedding."), *(
        (rf"transformer\.h\.(\d+)\.{re.escape(hf)}\.", rf"transformer.seq_layers.\1.{smp}.")
        for smp, hf in _LAYER_PARTS.items())])


def translate_hf_gptj_state_dict_to_smdistributed(state_dict: StateDict,
                                                  max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """SMP's older name, which its GPT-J example imports; `max_seq_len` is taken for its signature."""
    return translate_hf_state_dict_to_smdistributed_gptj(state_dict)


# The spelling of SMP's developer guide.
translate_hf_gptj_state_dict_to_smdistributed_gptj = translate_hf_state_dict_to_smdistributed_gptj


def _arguments(config: Any) -> tuple[tuple, dict[str, Any]]:
    """`DistributedTransformerLMHead`'s arguments for a `GPTJConfig`: the same model, its weights drawn anew."""
    if config.tie_word_embeddings:
        raise ValueError("GPT-J with tie_word_embeddings=True has no stand-in (its head has a bias of its own); "
                         "fix: set tie_word_embeddings=False, or build it outside "
                         "sw.model_creation(tensor_parallelism=True) to keep Hugging Face's modules")
    return (), gpt_arguments(config) | dict(
        parallel_attn_output=True, rotary_dim=config.rotary_dim or config.n_embd // config.n_head,
        use_positional_embedding=False, use_qkv_bias=False, use_attn_dense_bias=False,
        tie_input_output_embedding=False, use_lm_head_bias=True)


def stand_in() -> Registration:
    """SMP's stand-in for `GPTJForCausalLM` (see module docstring)."""
    return causal_lm_stand_in("GPT-J", _arguments, "CausalLMOutputWithPast", translate_state_dict_to_hf_gptj)
