"""Bytes an eager transformer block's memory-bound ops move, beside what the planner's step time charges for them.

    python bench/eager_bytes.py [--seq 256] [--rows 2]

The planner times a block's memory-bound work (norms, activations, rotary, residual adds, dropout) as the tensors
the block keeps for backward, written and read forward and read, written and read again backward (efficiency.py,
five passes). Eager PyTorch runs every aten op as its own kernel, each reading its inputs and writing its outputs,
including the intermediates no one keeps (an eager RMSNorm's fp32 upcast, square and product; rotary's halves).
This counts them: a dispatch mode sums the bytes of the inputs and outputs of every aten op of one Hugging Face
block's forward and backward in bf16 on this CPU, leaving out the matmuls, the attention kernel and the ops that
only make views, and prints them per token beside the planner's charge for the same block.
"""

from __future__ import annotations

import argparse

import torch
import transformers as hf

from shardwise.planner.activations import Numerics, block_activations
from shardwise.planner.families import spec_from_hf
from shardwise.planner.hardware import H100_80GB
from shardwise.torch_internals import TorchDispatchMode, tree_flatten

# The matmuls and the attention kernel, which the planner times apart; ops that only make views move nothing.
_TIMED_APART = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention_for_cpu_backward"}
_VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "unsqueeze", "squeeze", "permute", "slice", "select",
          "as_strided", "detach", "alias", "split", "unbind", "_reshape_alias", "split_with_sizes", "lift_fresh"}
_PASSES = 2 + 3   # efficiency.py's _KEPT_PASSES_FORWARD + _KEPT_PASSES_BACKWARD


class OpBytes(TorchDispatchMode):
    """Bytes read and written by each aten op that is neither timed apart nor a view, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._opname not in _TIMED_APART | _VIEWS:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.by_op[func._opname] = self.by_op.get(func._opname, 0) + sum(
                t.numel() * t.element_size() for t in tensors)
        return out


def _block(kind: str, seq: int):
    """(the block, a call of it on `hidden`, its HF config) for a one-block bf16 model of `kind`."""
    if kind == "llama":
        config = hf.LlamaConfig(hidden_size=256, intermediate_size=896, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=1, vocab_size=512, max_position_embeddings=seq,
                                attn_implementation="sdpa")
        model = hf.LlamaForCausalLM(config).to(torch.bfloat16)
        block = model.model.layers[0]
        return block, lambda x: block(x, position_embeddings=model.model.rotary_emb(x, torch.arange(seq)[None])), config
    config = hf.GPT2Config(n_embd=256, n_layer=1, n_head=4, vocab_size=512, n_positions=seq, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    block = hf.GPT2LMHeadModel(config).to(torch.bfloat16).transformer.h[0]
    return block, block, config


def measure(kind: str, seq: int, rows: int) -> dict:
    block, call, config = _block(kind, seq)
    hidden = torch.randn(rows, seq, config.hidden_size if kind == "llama" else config.n_embd, dtype=torch.bfloat16,
                         requires_grad=True)
    forward, backward = OpBytes(), OpBytes()
    with forward:
        out = call(hidden)
        out = out[0] if isinstance(out, tuple) else out
    incoming = torch.ones_like(out)
    with backward:
        out.backward(incoming)
    tokens = rows * seq
    kept = block_activations(spec_from_hf(config.to_dict(), kind), seq, Numerics(2), H100_80GB.kernels).per_rank(1)
    return {"forward": sum(forward.by_op.values()) / tokens, "backward": sum(backward.by_op.values()) / tokens,
            "charged": _PASSES * kept, "ops": {**forward.by_op, **{f"{k} (backward)": v for k, v in
                                                                  backward.by_op.items()}}, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2)
    args = parser.parse_args()
    print("| block (bf16, eager) | forward B/token | backward B/token | eager in all | planner charges | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in ("llama", "gpt2"):
        m = measure(kind, args.seq, args.rows)
        total = m["forward"] + m["backward"]
        print(f"| {kind} | {m['forward']:,.0f} | {m['backward']:,.0f} | {total:,.0f} | {m['charged']:,.0f} | "
              f"{total / m['charged']:.2f} |")
    for kind in ("llama", "gpt2"):
        m = measure(kind, args.seq, args.rows)
        top = sorted(m["ops"].items(), key=lambda kv: -kv[1])[:8]
        print(f"\n{kind}, largest ops (B/token): " + ", ".join(f"{k} {v / m['tokens']:,.0f}" for k, v in top))


if __name__ == "__main__":
    main()
