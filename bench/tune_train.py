"""The training script bench/tune.py tunes: a small random-init GPT-2 or Llama (no downloads) on random tokens,
the seed script's loop. `shardwise tune` stops it after its trial's steps; alone it runs --steps steps."""

from __future__ import annotations

import argparse

import torch
import transformers

import shardwise as sw

VOCAB, SEQ = 256, 64
# The same models as bench/tune.py's --model strings for the planner.
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False),
    "llama": lambda: transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=128,
                                              intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                              num_key_value_heads=2, use_cache=False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(CONFIGS), required=True)
    p.add_argument("--global-batch", type=int, default=32,
                   help="sequences per step over all replicas, as the planner plans it: each reads its share")
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    sw.init()
    torch.manual_seed(0)
    model = sw.DistributedModel(transformers.AutoModelForCausalLM.from_config(CONFIGS[args.family]()))
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @sw.step
    def train_step(model, input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        model.backward(loss)
        return loss

    # A replica is the ranks that read the same rows (a pipeline's stages, a tensor-parallel group with the
    # planner's prescaled_batch): the step's rows split over the replicas.
    rows = args.global_batch // sw.rdp_size()
    generator = torch.Generator().manual_seed(sw.rdp_rank())
    for _ in range(args.steps):
        optimizer.zero_grad()
        train_step(model, torch.randint(VOCAB, (rows, SEQ), generator=generator)).reduce_mean()
        optimizer.step()
    sw.shutdown()


if __name__ == "__main__":
    main()
