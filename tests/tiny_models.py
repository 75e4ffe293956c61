"""Tiny Hugging Face models, synthetic data and the plain single-process reference trainer.

Shared by the distributed tests. Models are built from small configs (no
downloads) with dropout off, so a step is a pure function of weights and batch.

Attention key biases get a gradient that is exactly zero in exact arithmetic
(softmax ignores a shift shared by all keys); in floating point it is rounding
noise, which Adam normalises into full-size steps that differ between any two
summation orders. `build(..., freeze_key_bias=True)` therefore makes them
non-trainable (for GPT-2 that is the whole fused q/k/v bias), which also checks
that frozen parameters pass through every sharding mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

SEED = 1234
SEQ = 8  # GPT-2 tokens per row
VOCAB = 128
IMAGE, CHANNELS, LABELS = 8, 3, 5  # ViT: 8×8 RGB images, 5 classes


def tiny_gpt2(layers: int = 2, hidden: int = 32, heads: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def tiny_vit(layers: int = 2, hidden: int = 32, heads: int = 2) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=IMAGE, patch_size=4, num_channels=CHANNELS, hidden_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * hidden,
                       num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


def tiny_llama(layers: int = 2, hidden: int = 32, heads: int = 4) -> nn.Module:
    """Llama-style: RMSNorm, rotary positions, grouped-query attention, SwiGLU, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def tiny_bert(layers: int = 2, hidden: int = 32, heads: int = 2) -> nn.Module:
    """BERT with its masked-LM head, whose decoder is tied to the word embeddings."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=2 * hidden, vocab_size=VOCAB, max_position_embeddings=SEQ,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)


class _Residual(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyStack(nn.Module):
    """Not a Hugging Face model: token embedding, a list of residual MLP blocks, final norm and head."""

    def __init__(self, layers: int = 2, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(_Residual(hidden) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> dict:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return {"logits": self.head(self.norm(x))}


class SequentialStack(TinyStack):
    """TinyStack with its blocks in an nn.Sequential, which the forward calls once."""

    def __init__(self, layers: int = 2, hidden: int = 32):
        super().__init__(layers, hidden)
        self.blocks = nn.Sequential(*self.blocks)

    def forward(self, ids: torch.Tensor) -> dict:
        return {"logits": self.head(self.norm(self.blocks(self.embed(ids))))}


class TinyCNN(nn.Module):
    """Two sub-networks and no repeated blocks: convolutions and pooling, then a classifier of linear layers."""

    def __init__(self, layers: int = 2, hidden: int = 32):
        super().__init__()
        convs = [nn.Conv2d(CHANNELS if i == 0 else 8, 8, 3, padding=1) for i in range(layers)]
        self.features = nn.Sequential(*(m for conv in convs for m in (conv, nn.ReLU())), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * (IMAGE // 2) ** 2, hidden), nn.ReLU(),
                                        nn.Linear(hidden, LABELS))

    def forward(self, images: torch.Tensor) -> dict:
        return {"logits": self.classifier(self.features(images))}


def tiny_mixtral(**sizes) -> nn.Module:
    """A mixture of experts (tiny_moe.py): four experts, two per token; its loss here is the next-token one."""
    from tiny_moe import tiny_moe

    return tiny_moe("mixtral", seed=torch.initial_seed(), **sizes)


BUILDERS = {"gpt2": tiny_gpt2, "vit": tiny_vit, "llama": tiny_llama, "bert": tiny_bert, "stack": TinyStack,
            "sequential": SequentialStack, "cnn": TinyCNN,
            "mixtral": tiny_mixtral}
TEXT = ("gpt2", "llama", "bert", "stack", "sequential", "mixtral")  # token models: token data; next-token loss but BERT's, per token


def blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (ViT's are `vit.layers` in transformers 5, `vit.encoder.layer` before)."""
    if hasattr(model, "transformer"):
        return model.transformer.h
    if hasattr(model, "model"):  # Llama
        return model.model.layers
    if hasattr(model, "bert"):
        return model.bert.encoder.layer
    if hasattr(model, "blocks"):  # TinyStack, SequentialStack
        return model.blocks
    if hasattr(model, "features"):  # TinyCNN: its convolutions
        return [m for m in model.features if isinstance(m, nn.Conv2d)]
    vit = model.vit
    return vit.layers if hasattr(vit, "layers") else vit.encoder.layer


def freeze_key_biases(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if name.endswith(("attn.c_attn.bias", "attention.k_proj.bias", "attention.key.bias", "attention.self.key.bias")):
            param.requires_grad_(False)


def build(kind: str, freeze_key_bias: bool = False, seed: int = SEED, **sizes) -> nn.Module:
    """The same weights on every process for the same seed."""
    torch.manual_seed(seed)
    model = BUILDERS[kind](**sizes)
    if freeze_key_bias:
        freeze_key_biases(model)
    return model


def dataset(kind: str, rows: int, seed: int = SEED) -> TensorDataset:
    """Synthetic (inputs, targets): random token rows for GPT-2 and Llama, random images and labels for ViT."""
    g = torch.Generator().manual_seed(seed)
    if kind in TEXT:
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        return TensorDataset(ids, ids.clone())
    images = torch.randn(rows, CHANNELS, IMAGE, IMAGE, generator=g)
    return TensorDataset(images, torch.randint(0, LABELS, (rows,), generator=g))


def loss_fn(kind: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy for GPT-2, Llama and the stacks, per-token for BERT, classification cross-entropy
    for ViT and the CNN."""
    logits = model(inputs)["logits"]
    if kind == "bert":
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if kind in TEXT:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
    return F.cross_entropy(logits, targets)


def seed_step(kind: str):
    """The seed's training step under `@sw.step`: a loss, `model.backward(loss)`, the loss returned."""
    import shardwise as sw

    @sw.step
    def train_step(model, inputs, targets):
        loss = loss_fn(kind, model, inputs, targets)
        model.backward(loss)
        return loss

    return train_step


def train_seed_loop(model, kind: str, steps: int, rows: int) -> dict:
    """One rank of the seed's loop on `model` (a DistributedModel) with SGD, `rows` per data-parallel rank: the
    losses (None where this rank holds none), the data-parallel size, and rank 0's whole parameters."""
    import shardwise as sw

    optimizer = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step(kind)
    losses = []
    for inputs, targets in sw.data_loader(dataset(kind, steps * rows * sw.dp_size()), batch_size=rows, shuffle=False):
        optimizer.zero_grad()
        out = train_step(model, inputs, targets)
        losses.append(out.reduce_mean().item() if out.holds_loss else None)
        optimizer.step()
    state = model.full_state_dict()  # every rank gathers
    return {"losses": losses, "dp_size": sw.dp_size(), "state": state if sw.rank() == 0 else None}


def train_watched(kind: str, config: dict, steps: int, rows: int, watch: Callable[[nn.Module], ContextManager]):
    """`kind` under `config`, the seed's loop with AdamW for `steps` steps of `rows` per data-parallel rank, inside the
    context `watch` gives for the DistributedModel (a collective recorder, a memory tracker); the model."""
    import shardwise as sw

    sw.init(config)
    model = sw.DistributedModel(build(kind))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    train_step = seed_step(kind)
    loader = sw.data_loader(dataset(kind, steps * rows * sw.dp_size()), batch_size=rows)
    with watch(model):
        for inputs, targets in loader:
            optimizer.zero_grad()
            train_step(model, inputs, targets)
            optimizer.step()
    return model


# Adam's step g/(sqrt(v)+eps) turns the rounding noise of tiny gradients into noise in
# the step; eps=1e-6 (not 1e-8) bounds that, so that one process summing its batch in
# two halves instead of one agrees with itself to ~2e-6 on the ViT rather than ~1e-5.
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](params)


def train_reference(kind: str, optimizer: str, steps: int, global_batch: int, clip: float | None = None,
                    model: nn.Module | None = None, skipped: tuple[int, ...] = (),
                    schedule: Callable[[int], float] | None = None, **sizes) -> dict:
    """One plain PyTorch process, no shardwise: `steps` steps on consecutive global batches,
    clipping the gradient norm to `clip` if given, taking no optimizer step at the indices in `skipped`,
    the learning rate scaled by `schedule(step)` (torch's LambdaLR, stepped after each step) if given;
    the model is `build(kind, **sizes)` unless given."""
    model = build(kind, freeze_key_bias=True, **sizes) if model is None else model
    opt = make_optimizer(optimizer, model.parameters())
    scheduler = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data = dataset(kind, steps * global_batch)
    losses = []
    for step in range(steps):
        inputs, targets = data[step * global_batch:(step + 1) * global_batch]
        opt.zero_grad()
        loss = loss_fn(kind, model, inputs, targets)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if step not in skipped:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_trains_as(ranks: list[dict], want: dict, tolerance: float) -> None:
    """The mean loss per step over the ranks that hold it, and rank 0's whole parameters, match `want` (a
    `train_reference`) within `tolerance`."""
    held = [r["losses"] for r in ranks if r["losses"][0] is not None]
    torch.testing.assert_close(torch.tensor(held).mean(0), torch.tensor(want["losses"]), rtol=tolerance, atol=0)
    state = ranks[0]["state"]
    worst = max(want["state"], key=lambda name: relative_error(state[name], want["state"][name]))
    assert relative_error(state[worst], want["state"][worst]) <= tolerance, worst


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-3) -> float:
    """‖actual − expected‖ / max(‖expected‖, floor): tensors near zero are compared absolutely."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(floor)).item()


def assert_checkpoints_intact(root: Path, saved: dict[str, dict[str, torch.Tensor]], scratch: Path) -> None:
    """After a fault: the checkpoints in `root` are exactly those `saved` names (tag: the full state dict it
    was saved from, oldest first), `newest` names the last, no other directory passes for one (a save cut
    short stays hidden), and each, checksums verified, reads back in this one process bit for bit as saved."""
    from shardwise.checkpoint.directory import complete_tags, newest_tag, read_manifest
    from shardwise.checkpoint.export import export_checkpoint

    visible = sorted(entry.name for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    assert complete_tags(root) == list(saved) and visible == sorted(saved), (visible, complete_tags(root))
    assert newest_tag(root) == list(saved)[-1]
    for tag, state in saved.items():
        assert read_manifest(root / tag)["tag"] == tag
        exported = torch.load(export_checkpoint(root / tag, scratch / f"{tag}.pt"), weights_only=True)
        assert sorted(exported) == sorted(state), tag
        for name, value in state.items():
            assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), (tag, name)
