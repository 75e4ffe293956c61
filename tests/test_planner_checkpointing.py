"""SMP's checkpointing strategies: MemTracker's peak activation bytes against the planner's model.

One training step of tiny GPT-2s (GPT2LMHeadModel) in one process, with the blocks
run as an nn.Sequential so `sw.set_activation_checkpointing(blocks, strategy=...)`
can group them. The planner keeps L/k region inputs and, once backward has passed
the head, recomputes k blocks at a time (with the "matmul" policy, each block's
matrix products' outputs are kept too and only the rest is recomputed); its
activation bytes must be within ±25 % of the peak MemTracker sees for every strategy. On the shallow model (12 blocks,
GPT-2 as shipped) `each` needs the least; on the deep narrow one (64 blocks,
torch's GELU, no dropout: a block keeps some 16 times its input) grouping pairs of
blocks needs less than `each`: both measured and predicted (docs/planner.md).
"""

import pytest
import torch
import transformers
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import shardwise as sw
from shardwise.config import parse_config
from shardwise.config.recompute import split_policy
from shardwise.planner import cluster_preset, plan, predict_memory, predict_step_time, spec_from_hf
from shardwise.planner.traced import TRACE_BATCH, spec_from_module
from shardwise.topology import Layout
from tiny_models import SequentialStack, TinyStack

BATCH, SEQ, VOCAB = 2, 32, 256
CPU = cluster_preset("local").device
MODELS = {
    "shallow": (transformers.GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ),
                ("none", "each", "each:matmul", "contiguous", "group_2", "group_4")),
    "deep": (transformers.GPT2Config(n_layer=64, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             ("none", "each", "each:matmul", "contiguous", "group_2", "group_4", "group_8", "group_2:matmul")),
}


class ActivationPeak(MemTracker):
    """MemTracker that keeps the most activation bytes alive at once. Its own peak snapshot is taken where
    the total peaks, which with checkpointing is late in backward (gradients), not where activations do."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def activations(self) -> int:
        return self._curr_mem_snap.get(torch.device("cpu"), {}).get("Activation", 0)

    def _update_peak_stats(self, peak_state) -> None:  # called after every op; per-module peaks are not needed
        self.most = max(self.most, self.activations())


class _Block(nn.Module):
    """A GPT2Block as a layer of an nn.Sequential: hidden states in, hidden states out (causal attention)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block(hidden)


class _Blocks(nn.Module):
    """Stands in GPT2Model's block list, running the blocks as one nn.Sequential."""

    def __init__(self, blocks: nn.Sequential):
        super().__init__()
        self.blocks = blocks

    def forward(self, hidden: torch.Tensor, *_, **__) -> torch.Tensor:
        return self.blocks(hidden)


def _gpt2(config: transformers.GPT2Config, strategy: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    blocks = nn.Sequential(*(_Block(block) for block in model.transformer.h))
    model.transformer.h = nn.ModuleList([_Blocks(blocks)])
    strategy, policy = split_policy(strategy)
    if strategy != "none":
        sw.set_activation_checkpointing(blocks, strategy=strategy, policy=policy)
    return model


def _peak_activations(model: nn.Module) -> int:
    """Most activation bytes alive during one forward and backward, above what was alive before."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    tracker = ActivationPeak()
    tracker.track_external(model)
    with tracker:
        before = tracker.activations()
        model(input_ids=ids, labels=ids).loss.backward()
    return tracker.most - before


def _predicted(config: transformers.GPT2Config, strategy: str) -> float:
    spec = spec_from_hf(config.to_dict(), "gpt2")
    return predict_memory(spec, parse_config({}), Layout(), BATCH, SEQ, strategy, CPU).activations


@pytest.fixture(scope="module")
def runs() -> dict:
    """{model: {strategy: (measured, predicted)}}, one thread (the tiny ops only wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: {s: (_peak_activations(_gpt2(config, s)), _predicted(config, s)) for s in strategies}
                for name, (config, strategies) in MODELS.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name, strategy", [(n, s) for n, (_, strategies) in MODELS.items() for s in strategies])
def test_predicted_activations_match_memtracker(runs, name, strategy):
    measured, predicted = runs[name][strategy]
    print(f"\n{name} {strategy}: measured {measured / 1e3:,.0f} kB, predicted {predicted / 1e3:,.0f} kB "
          f"({predicted / measured - 1:+.1%})")
    assert predicted == pytest.approx(measured, rel=0.25)


@pytest.mark.parametrize("side", [0, 1], ids=["measured", "predicted"])
def test_each_needs_least_on_the_shallow_model(runs, side):
    bytes_of = {strategy: both[side] for strategy, both in runs["shallow"].items()}
    assert min(bytes_of, key=bytes_of.get) == "each"


@pytest.mark.parametrize("side", [0, 1], ids=["measured", "predicted"])
def test_grouping_needs_less_than_each_on_the_deep_model(runs, side):
    bytes_of = {strategy: both[side] for strategy, both in runs["deep"].items()}
    assert min(bytes_of, key=bytes_of.get) == "group_2"
    assert bytes_of["group_2"] < 0.9 * bytes_of["each"]


@pytest.mark.parametrize("side", [0, 1], ids=["measured", "predicted"])
def test_keeping_matmuls_costs_memory_between_each_and_none(runs, side):
    for name in MODELS:
        bytes_of = {strategy: both[side] for strategy, both in runs[name].items()}
        assert bytes_of["each"] < bytes_of["each:matmul"] < bytes_of["none"]


@pytest.mark.parametrize("stack, strategies", [(TinyStack, {"none", "each"}),
                                               (SequentialStack, {"none", "each", "contiguous", "group_2", "group_4"})])
def test_the_search_proposes_groups_only_for_blocks_in_an_nn_sequential(stack, strategies):
    """set_activation_checkpointing groups an nn.Sequential's layers; a ModuleList's blocks (Hugging Face's) only
    one by one, so a plan for them never names a group."""
    ids = torch.zeros(TRACE_BATCH, 16, dtype=torch.long)
    spec = spec_from_module(stack(layers=8), stack.__name__, {"ids": ids}, 16)
    assert {e.checkpointing for e in plan(spec, cluster_preset("p4d.24xlarge")).considered} == strategies


def test_keeping_matmuls_recomputes_only_memory_bound_ops():
    """Its recomputation costs time between none's (nothing) and each's (every block's forward FLOPs)."""
    spec = spec_from_hf(transformers.GPT2Config().to_dict(), "gpt2")  # GPT-2 small, 1024 tokens
    cluster = cluster_preset("p4d.24xlarge")
    seconds = {s: predict_step_time(spec, parse_config({}), Layout(), cluster, 4, 1024, s).recompute
               for s in ("none", "each:matmul", "each")}
    assert 0 == seconds["none"] < seconds["each:matmul"] < 0.2 * seconds["each"]


def test_alternate_matmul_keeps_every_other_projection_of_a_llama_block():
    """torchtitan's op policy ("each:alternate_matmul") keeps the 1st, 3rd, 5th and 7th aten.mm of a block in
    forward order (q, v, gate, down) and the attention kernel's outputs: for Llama 3 8B in bf16 with flash
    attention, (4096 + 1024 + 14336 + 4096) x 2 bytes + the output (4096 x 2) and its log-sum-exp (32 x 4) per
    token, against all seven products' (q, k, v, o, gate, up, down) under "matmul"; it recomputes k, o and up."""
    from shardwise.planner.activations import Numerics, kept_matmul_bytes, recomputed_matmul_share
    from shardwise.planner.errors import PlanError
    llama = spec_from_hf({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                          "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                          "vocab_size": 128256, "max_position_embeddings": 8192}, "llama-3-8b")
    bf16, gpu = Numerics(2, logits=4), cluster_preset("p4d.24xlarge").device.kernels
    attention = 4096 * 2 + 32 * 4
    assert kept_matmul_bytes(llama, 8192, bf16, gpu, 1, False, "alternate_matmul") == \
        (4096 + 1024 + 14336 + 4096) * 2 + attention
    assert kept_matmul_bytes(llama, 8192, bf16, gpu, 1, False) == \
        (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096) * 2 + attention
    dropped = 4096 * 1024 + 4096 * 4096 + 4096 * 14336
    every = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert recomputed_matmul_share(llama, "each:alternate_matmul") == pytest.approx(dropped / every)
    assert recomputed_matmul_share(llama, "each:matmul") == 0 and recomputed_matmul_share(llama, "each") == 1
    layout, config = Layout(), parse_config({"bf16": True})
    memory = {s: predict_memory(llama, config, layout, 1, 2048, s).activations
              for s in ("each", "each:alternate_matmul", "each:matmul")}
    assert memory["each"] < memory["each:alternate_matmul"] < memory["each:matmul"]
    cluster = cluster_preset("p4d.24xlarge")
    seconds = {s: predict_step_time(llama, config, layout, cluster, 1, 2048, s).recompute
               for s in ("each:matmul", "each:alternate_matmul", "each")}
    assert seconds["each:matmul"] < seconds["each:alternate_matmul"] < seconds["each"]
    with pytest.raises(PlanError, match="alternate_matmul"):
        predict_memory(spec_from_hf(transformers.GPT2Config().to_dict(), "gpt2"), config, layout, 1, 1024,
                       "each:alternate_matmul")
