"""Context parallelism trains Hugging Face GPT-2, Llama, Mistral and Qwen2, and a user's module through the
documented hook, as one process does.

On 4 gloo ranks, CP 2 (two data-parallel replicas of 2) and CP 4, ring and all-to-all, causal, with and without
packed documents: each rank feeds its load-balanced share of its replica's rows (`shard_batch`), trains on
`sequence_loss` over the whole world with gradients averaged over it, and after 3 SGD steps every loss and
parameter equals a one-process model trained on the whole batch with transformers' own loss. The packed reference
is itself checked: transformers keeps documents apart when position ids restart.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.context import (
    apply_context_parallel,
    attention,
    context_parallel_attention,
    sequence_loss,
    shard_batch,
)
from shardwise.testing import run_distributed

SEQ, VOCAB, STEPS, LR = 16, 128, 3, 0.5
TOLERANCE = 2e-5
POSITIONS = {False: torch.arange(SEQ).expand(2, -1),
             True: torch.tensor([list(range(5)) + list(range(7)) + list(range(4)), list(range(9)) + list(range(7))])}


@context_parallel_attention
class UserAttention(nn.Module):
    """A user's own causal attention, through the documented hook."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return self.out(attention(self, q, k, v, documents=document_ids).transpose(1, 2).reshape(batch, seq, hidden))


class UserModel(nn.Module):
    """Embeddings (tokens and positions), two attention blocks, a head, and transformers' loss convention."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.blocks, self.head = nn.ModuleList(UserAttention(hidden) for _ in range(2)), nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, position_ids, labels=None, document_ids=None, use_cache=None):
        x = self.tokens(input_ids) + self.positions(position_ids)
        for block in self.blocks:
            x = x + block(x, document_ids)
        logits = self.head(x)
        if labels is None:
            return type("Output", (), {"logits": logits, "loss": None})
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Output", (), {"logits": logits, "loss": loss})


def tiny(kind: str) -> nn.Module:
    import transformers as hf

    if kind == "user":
        return UserModel()

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "gpt2":
        config = hf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0, **common)
        return hf.GPT2LMHeadModel(config)
    llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=SEQ, **common)
    config, model = {"llama": (hf.LlamaConfig, hf.LlamaForCausalLM),
                     "mistral": (hf.MistralConfig, hf.MistralForCausalLM),
                     "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM)}[kind]
    return model(config(**llama_like))


def batches(packed: bool) -> list[dict]:
    """Two rows per step; the second row's last 3 tokens are padding (label -100)."""
    generator = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (2, SEQ), generator=generator)
        labels = ids.clone()
        labels[1, -3:] = -100
        steps.append({"input_ids": ids, "labels": labels, "position_ids": POSITIONS[packed]})
    return steps


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def reference(kind: str, packed: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = tiny(kind)
    losses = []
    for batch in batches(packed):
        loss = model(**batch, use_cache=False).loss  # a cache hides packing from transformers
        loss.backward()
        _sgd(model)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(kind: str, cp: int, mode: str, packed: bool) -> tuple[list[float], dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, world, cp)]
    replica, cp_rank = divmod(rank, cp)
    replicas = world // cp
    torch.manual_seed(0)
    model = apply_context_parallel(tiny(kind), groups[replica], mode)
    losses = []
    for batch in batches(packed):
        rows = {key: value.chunk(replicas)[replica] for key, value in batch.items()}
        inputs, labels = shard_batch(rows["input_ids"], cp_rank, cp, labels=rows["labels"],
                                     position_ids=rows["position_ids"])
        loss = sequence_loss(model(**inputs, use_cache=False).logits, labels, dist.group.WORLD)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        _sgd(model)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worst(got: tuple, want: tuple) -> float:
    (losses, params), (want_losses, want_params) = got, want
    errors = [abs(a - b) for a, b in zip(losses, want_losses)]
    errors += [((params[n] - p).norm() / p.norm().clamp(min=1e-3)).item() for n, p in want_params.items()]
    return max(errors)


CASES = [(kind, cp, mode, packed) for kind in ("gpt2", "llama") for cp in (2, 4) for mode in ("ring", "all_to_all")
         for packed in (False, True)] + [("mistral", 4, "ring", True), ("qwen2", 2, "all_to_all", True),
                                         ("mistral", 2, "all_to_all", False), ("qwen2", 4, "ring", False),
                                         ("user", 2, "ring", False), ("user", 4, "all_to_all", False)]


def same_math(cases: list) -> dict:
    references = {(kind, packed): reference(kind, packed) for kind, _, _, packed in cases}
    return {case: _worst(train(*case), references[case[0], case[3]]) for case in cases}


def test_cp_2_and_4_ring_and_all_to_all_train_as_one_process():
    for errors in run_distributed(same_math, 4, CASES, timeout=600):
        assert max(errors.values()) < TOLERANCE, {case: e for case, e in errors.items() if e >= TOLERANCE}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_packed_reference_keeps_documents_apart(kind):
    """transformers' one process: the last document of a packed row gives the logits it gives alone."""
    torch.manual_seed(0)
    model = tiny(kind).eval()
    ids = torch.randint(1, VOCAB, (1, SEQ))
    packed = model(ids, position_ids=POSITIONS[True][:1], use_cache=False).logits[0, 12:]
    alone = model(ids[:, 12:], position_ids=torch.arange(4).unsqueeze(0)).logits[0]
    assert torch.allclose(packed, alone, atol=1e-5)
