"""What the planner says a transformer block keeps for backward, against what autograd keeps, measured.

A saved-tensors hook (saved_tensors.py) counts the bytes Hugging Face's GPT-2 and Llama blocks keep during one
forward, in fp32 and in bf16 (parameters in bf16, no autocast: FSDP2's mixed precision, or pure bf16), and
`block_activations` must give them within 2 %: the count is per tensor PyTorch saves, so a dtype path the planner
did not know (an eager RMSNorm keeping its input upcast to fp32 under bf16) shows here, not only in a peak.
"""

from __future__ import annotations

import pytest
import torch

from saved_tensors import peak_saved_in_blocks
from shardwise.planner.activations import Numerics, block_activations
from shardwise.planner.families import spec_from_hf
from shardwise.planner.hardware import local_node

ROWS, SEQ = 2, 64


def _config(family: str):
    import transformers as hf

    if family == "llama":
        return hf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=512, max_position_embeddings=SEQ,
                              attn_implementation="sdpa")
    return hf.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=512, n_positions=SEQ, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_blocks_kept_bytes_are_what_autograd_keeps(family, dtype):
    import transformers as hf

    torch.manual_seed(0)
    config = _config(family)
    model = (hf.LlamaForCausalLM if family == "llama" else hf.GPT2LMHeadModel)(config).to(dtype)
    tokens = torch.randint(0, config.vocab_size, (ROWS, SEQ))
    kept = peak_saved_in_blocks(model, lambda: model(input_ids=tokens, use_cache=False))
    spec = spec_from_hf(config.to_dict(), family)
    per_token = block_activations(spec, SEQ, Numerics(dtype.itemsize), local_node(2)["device"].kernels).per_rank(1)
    assert kept == pytest.approx(per_token * ROWS * SEQ * config.num_hidden_layers, rel=0.02)
