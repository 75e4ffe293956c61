"""SMP's Hugging Face integration: distributed stand-ins for Hugging Face models, and state-dict translations.

SMP replaced a Hugging Face model it supports by its `DistributedTransformer*`
modules when the model was built for tensor parallelism, and these functions
translate between the two layouts. shardwise does the same for GPT-2
(`GPT2LMHeadModel`, gpt2.py) and GPT-J (`GPTJForCausalLM`, gptj.py), both by
`DistributedTransformerLMHead`. Hugging Face models without a stand-in here are
split in place, keeping their own names, by their built-in tensor-parallel plans;
for them, translating to shardwise is the identity, and translating to Hugging
Face renames only what is written in SMP's layout, passing Hugging Face names through.
"""

from ....parallel.tensor.registration import register_stand_in
from . import bert, gpt2, gptj, gptneo, roberta

register_stand_in("transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel", gpt2.stand_in)
register_stand_in("transformers.models.gptj.modeling_gptj.GPTJForCausalLM", gptj.stand_in)

__all__ = ["bert", "gpt2", "gptj", "gptneo", "roberta"]
