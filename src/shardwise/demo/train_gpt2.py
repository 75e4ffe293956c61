"""Train a small GPT-2 with shardwise: the seed script's shape, a model that fits anywhere.

The model is a randomly initialised 4-layer GPT-2 (no downloads). The data follow a fixed
random successor rule — every token has one fixed next token — so a model that learns the
rule predicts every next token, and the loss falls from ln(256) ≈ 5.5 towards 0.
Parallelism comes from the config alone:

    shardwise demo                                   # 4 ranks, MiCS: 2 partition groups of 2
    shardwise run --nproc-per-node 2 train_gpt2.py   # the same script, plain DDP
    torchrun --nproc-per-node 4 train_gpt2.py        # or torchrun; or `python train_gpt2.py`
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import shardwise as sw
from shardwise.observe import metrics
from shardwise.observe.recorder import progress

VOCAB = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (at most 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--log-every", type=int, default=5, help="without a terminal, a progress line every N steps")
    args = p.parse_args()
    if not 2 <= args.seq_len <= 64:
        p.error(f"--seq-len {args.seq_len} must be in 2..64 (the model has 64 positions)")
    return args


def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the class name does not say so; silences transformers' guess
    return model


def successor_dataset(sequences: int, seq_len: int, seed: int = 0) -> TensorDataset:
    """Random first tokens, then a fixed random successor per token (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(VOCAB, generator=gen)
    ids = torch.empty(sequences, seq_len, dtype=torch.long)
    ids[:, 0] = torch.randint(VOCAB, (sequences,), generator=gen)
    for t in range(1, seq_len):
        ids[:, t] = successor[ids[:, t - 1]]
    return TensorDataset(ids, ids.clone())  # GPT2LMHeadModel shifts the labels itself


def main() -> None:
    args = parse_args()
    sw.init()  # the config `shardwise run` / `shardwise demo` validated; defaults without a launcher
    model = sw.DistributedModel(build_model())
    for block in model.get_module().transformer.h:
        sw.set_activation_checkpointing(block)
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95)))

    @sw.step
    def train_step(model, input_ids, labels):
        out = model(input_ids=input_ids, labels=labels)
        model.backward(out.loss)
        return out.loss

    dataset = successor_dataset(args.steps * args.batch_size * sw.dp_size(), args.seq_len)
    progress(args.steps, every=args.log_every)  # rank 0: step, loss, step time, throughput, ETA
    losses, records = [], []
    for input_ids, labels in sw.data_loader(dataset, batch_size=args.batch_size):
        optimizer.zero_grad()
        losses.append(train_step(model, input_ids, labels).reduce_mean().item())  # this rank's, as progress shows
        optimizer.step()
        if (record := metrics.latest()) is not None and record not in records[-1:]:  # none with metrics_interval 0
            records.append(record)

    if sw.rank() == 0:
        summary = f"done: {len(losses)} steps on {sw.size()} ranks (dp {sw.dp_size()}); loss {losses[0]:.3f} → " \
                  f"{losses[-1]:.3f} (ln {VOCAB} = {math.log(VOCAB):.2f})"
        steady = records[1:] or records  # the first step pays for warm-up
        if steady:
            mean = sum(r["step_time_s"] for r in steady) / len(steady)
            tokens = sum(r["tokens_per_s"] for r in steady) / len(steady)
            summary += f"; mean step {mean * 1e3:.0f} ms; {tokens:,.0f} tokens/s"
        print(summary, flush=True)
    sw.shutdown()


if __name__ == "__main__":
    main()
