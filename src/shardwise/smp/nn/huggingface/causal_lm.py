"""What SMP's stand-ins for Hugging Face causal language models share: the call translated both ways.

The stand-in (`DistributedTransformerLMHead`) takes one tuple; the script keeps
calling `model(input_ids=..., attention_mask=..., labels=...)` and reading
`output["loss"]` / `output.logits`, as from the Hugging Face model.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ....parallel.tensor.registration import Registration
from ..lm_head import DistributedTransformerLMHead

# Switches of Hugging Face's forward that do not change a training step's loss and logits.
_IGNORED = ("use_cache", "return_dict", "output_attentions", "output_hidden_states", "logits_to_keep")


def _inputs_of(family: str) -> Callable[..., tuple[tuple, dict]]:
    def inputs(input_ids: Optional[torch.Tensor] = None, *args: Any, attention_mask: Optional[torch.Tensor] = None,
               position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
               **others: Any) -> tuple[tuple, dict]:
        """The Hugging Face model's forward arguments as the stand-in's one tuple; what it cannot take is refused."""
        given = [name for name, value in others.items() if value is not None and name not in _IGNORED] + (
            ["positional arguments after input_ids"] if args else [])
        if given:
            raise ValueError(f"the {family} stand-in takes input_ids, attention_mask, position_ids and labels, not "
                             f"{', '.join(given)}; fix: pass those by name, or build the model outside "
                             "sw.model_creation(tensor_parallelism=True)")
        return ((input_ids, attention_mask, None, position_ids, labels),), {}

    return inputs


def _output_as(output_class: str) -> Callable[[Any], Any]:
    def output(result: Any) -> Any:
        from transformers import modeling_outputs

        loss, logits = result if isinstance(result, tuple) else (None, result)
        return getattr(modeling_outputs, output_class)(loss=loss, logits=logits)

    return output


def gpt_arguments(config: Any) -> dict[str, Any]:
    """`DistributedTransformerLMHead`'s arguments from what GPT-2's and GPT-J's configs share (their fields have the
    same names): a pre- and post-layer-norm causal stack, its weights drawn anew as SMP's stand-ins drew them."""
    heads, width = config.n_head, config.n_embd
    return dict(num_layers=config.n_layer, num_attention_heads=heads, attention_head_size=width // heads,
                hidden_size=width, intermediate_size=config.n_inner or 4 * width, vocab_size=config.vocab_size,
                num_positions=config.n_positions, attention_dropout_prob=config.attn_pdrop,
                hidden_dropout_prob=config.resid_pdrop, embedding_dropout_prob=config.embd_pdrop,
                activation=config.activation_function, layernorm_epsilon=config.layer_norm_epsilon,
                causal_mask_size=config.n_positions, initializer_range=config.initializer_range,
                use_normal_initialization=True, pre_layernorm=True, post_layernorm=True)


def causal_lm_stand_in(family: str, arguments: Callable[[Any], tuple[tuple, dict]], output_class: str,
                       to_original: Callable[[dict], dict]) -> Registration:
    """The registration of a stand-in for the `family` model: `arguments(config)` builds it, its outputs come
    back as `transformers.modeling_outputs.<output_class>`, `to_original` translates its state dict back."""
    return Registration(DistributedTransformerLMHead, arguments, _inputs_of(family), _output_as(output_class),
                        arguments=lambda model: ((model.config,), {}), to_original=to_original)
