"""What the planner says an eager Llama block's memory-bound ops move (planner/eager_ops.py), against the bytes of
every aten op Hugging Face's block dispatches on this CPU that is neither a matmul, the attention kernel nor a
view: each op's inputs read and its outputs written, forward and backward, per token."""

from __future__ import annotations

import pytest
import torch

from shardwise.planner.activations import Numerics
from shardwise.planner.eager_ops import eager_llama_bytes
from shardwise.planner.families import spec_from_hf
from shardwise.planner.hardware import Kernels
from shardwise.torch_internals import TorchDispatchMode, tree_flatten

# Timed apart (matmuls, the attention kernel), or moving nothing (views).
_NOT_MEMORY_BOUND = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention_for_cpu_backward", "view", "_unsafe_view", "t",
                     "transpose", "expand", "unsqueeze", "squeeze", "permute", "slice", "select", "as_strided",
                     "detach", "alias", "split", "unbind", "_reshape_alias", "split_with_sizes", "lift_fresh",
                     "view_as_complex", "view_as_real"}
ROWS, SEQ = 2, 64


class OpBytes(TorchDispatchMode):
    """Bytes read and written by the memory-bound aten ops dispatched under it (an expanded view's storage, which
    is what is read)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._opname not in _NOT_MEMORY_BOUND:
            self.total += sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes())  # an expanded view
                              for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("code", ["hugging face", "torchtitan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_an_eager_llama_blocks_memory_bound_bytes_are_what_it_dispatches(code, dtype, kv_heads):
    """Hugging Face's block, and the same with torchtitan's attention (complex rotary, repeated key/value heads)."""
    import transformers as hf

    torch.manual_seed(0)
    config = hf.LlamaConfig(hidden_size=256, intermediate_size=704, num_attention_heads=4,
                            num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=512,
                            max_position_embeddings=SEQ, attn_implementation="sdpa")
    model = hf.LlamaForCausalLM(config)
    block = model.model.layers[0]
    kernels = Kernels()
    if code == "torchtitan":
        block.self_attn = _TorchtitanAttention(block.self_attn, 4, kv_heads, SEQ)
        kernels = Kernels(complex_rotary=True, repeated_kv_copies=True)
    block.to(dtype)
    hidden = torch.randn(ROWS, SEQ, 256, dtype=dtype, requires_grad=True)
    rotary = model.model.rotary_emb(hidden, torch.arange(SEQ)[None])   # once per model, not per block
    forward, backward = OpBytes(), OpBytes()
    with forward:
        out = block(hidden, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
    incoming = torch.ones_like(out)
    with backward:
        out.backward(incoming)
    spec = spec_from_hf(config.to_dict(), "llama")
    predicted = eager_llama_bytes(spec, Numerics(dtype.itemsize), kernels, 1, False)
    tokens = ROWS * SEQ
    assert predicted[0] * tokens == pytest.approx(forward.total, rel=0.02)
    assert predicted[1] * tokens == pytest.approx(backward.total, rel=0.02)


class _TorchtitanAttention(torch.nn.Module):
    """torchtitan's Llama attention (torchtitan/models/llama/model.py at 9dec370: `apply_rotary_emb`, `repeat_kv`,
    `Attention.forward`) on a Hugging Face block's projections."""

    def __init__(self, hf_attention, heads: int, kv_heads: int, seq: int) -> None:
        super().__init__()
        self.wq, self.wk = hf_attention.q_proj, hf_attention.k_proj
        self.wv, self.wo = hf_attention.v_proj, hf_attention.o_proj
        self.n_rep, self.head_dim = heads // kv_heads, hf_attention.head_dim
        angles = torch.outer(torch.arange(seq).float(),
                             1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.freqs_cis = torch.polar(torch.ones_like(angles), angles)   # complex64 whatever the block's dtype

    def _rotary(self, x: torch.Tensor) -> torch.Tensor:
        complex_x = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        freqs = self.freqs_cis.view(1, x.shape[1], 1, self.head_dim // 2)
        return torch.view_as_real(complex_x * freqs).flatten(3).type_as(x)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, kv_heads, head_dim = x.shape
        if self.n_rep == 1:
            return x
        return x.unsqueeze(3).expand(bs, seq, kv_heads, self.n_rep, head_dim).reshape(
            bs, seq, kv_heads * self.n_rep, head_dim)

    def forward(self, hidden_states: torch.Tensor, **_) -> tuple[torch.Tensor, None]:
        bs, seq, _ = hidden_states.shape
        xq, xk, xv = (proj(hidden_states).view(bs, seq, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv))
        xq, xk = self._rotary(xq), self._rotary(xk)
        keys, values = self._repeat(xk), self._repeat(xv)
        out = torch.nn.functional.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seq, -1)), None
