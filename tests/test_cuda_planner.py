"""CUDA tier: the memory planner against the CUDA caching allocator, for GPT-2 and Llama at several layouts.

The second AdamW step of a GPT-2 and a Llama (hidden 512, 4 layers: large enough
that the allocator's 512-byte rounding is noise) trained through shardwise on one
rank of the device, measured as test_planner_measured.py measures CPU ranks:
MemTracker's categories (on the device's memory) within ±10 % for the model
states and ±25 % for the activations, and the step's peak — here
`torch.cuda.max_memory_allocated` — at most the predicted tensor total and within
25 % of it, less what the allocator holds for no tensor when the step ends (cuBLAS's
workspaces, which the planner counts in its runtime reserve). `max_memory_reserved` (what the allocator holds, fragmentation and
workspaces included) must stay under the predicted total.
The kernel facts are a GPU's (the H100 preset's: flash attention, bool dropout masks).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import test_planner_measured as cpu_check
from shardwise.config import parse_config
from shardwise.config.layout import layout_for
from shardwise.planner import predict_memory, spec_from_hf
from shardwise.planner.hardware import DEVICES
from shardwise.testing import run_distributed, shutdown_pools
from shardwise.topology import Cluster

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tier: torch sees no CUDA device")]

BATCH, SEQ, VOCAB = 4, 256, 8192
GPU = DEVICES["H100-SXM5-80GB"]
MODELS = {
    "gpt2": (transformers.GPT2LMHeadModel,
             transformers.GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=VOCAB, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)),
    "llama": (transformers.LlamaForCausalLM,
              transformers.LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                       num_key_value_heads=4, intermediate_size=1408, vocab_size=VOCAB,
                                       max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
}
LAYOUTS = {
    "DDP": {},
    "ZeRO-1": {"shard_optimizer_state": True},
    "ZeRO-3": {"zero_stage": 3},
    "DDP bf16": {"bf16": True},
    "ZeRO-3 bf16": {"zero_stage": 3, "bf16": True},
}


def _device_categories(tracker, kind: str) -> dict:
    """MemTracker's categories on this rank's accelerator (test_planner_measured reads the CPU's)."""
    device = torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    snapshot = tracker.get_tracker_snapshot(kind).get(device, {})
    return {getattr(k, "name", k): v for k, v in snapshot.items()}


def measure_on_device(family: str, config: dict) -> dict:
    """This rank's memory in the second step, by MemTracker's categories and by the caching allocator."""
    import shardwise as sw
    from shardwise.runtime import state

    cpu_check._categories = _device_categories  # the same StepMemory, reading the device's memory
    sw.init(config)
    torch.manual_seed(0)
    model_class, hf_config = MODELS[family]
    model = sw.DistributedModel(model_class(hf_config))
    cpu_check.StepMemory.watch(model.parameters())
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(next(model.parameters()).device)
    batch = {"input_ids": ids, "labels": ids}
    allocator = {}

    @sw.step
    def train_step(model, batch, memory):
        loss = model(**batch).loss
        if memory:
            memory.forward_done()
        model.backward(loss)
        if memory:
            memory.backward_done()
        return loss

    def train(memory):
        if memory:
            torch.accelerator.synchronize()
            torch.cuda.reset_peak_memory_stats()
        optimizer.zero_grad()
        train_step(model, batch, memory)
        optimizer.step()
        if memory:
            torch.accelerator.synchronize()
            tracked = _device_categories(memory.tracker, "current")["Total"]
            allocator.update(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved(),
                             untracked=torch.cuda.memory_allocated() - tracked)

    parameters = {id(p) for p in model.parameters()}
    masters = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in parameters]
    measured = cpu_check.StepMemory.of_second_step(train, model, optimizer.optimizer, *masters)
    state.set_current(None)
    return {**measured, **allocator}


CASES = [(family, name) for family in MODELS for name in LAYOUTS]


@pytest.fixture(scope="module")
def device_runs() -> dict:
    """Each case in a process of its own: one run after another in a process held a few hundred MiB more on the
    device each time (measured on an H200), which the allocator's peak counts."""
    runs = {}
    for family, name in CASES:
        [runs[f"{family} {name}"]] = run_distributed(measure_on_device, 1, family, LAYOUTS[name], timeout=120)
        shutdown_pools()
    return runs


# The planner's known misses, on an H200 (tests/test_planner_h200.py keeps that run). −1 %: CUDA's autocast keeps
# 48 MiB more of GPT-2's activations than the CPU's (235 against 187 MiB), which the planner's autocast model was
# measured against (202 MiB predicted).
MISSED = {"gpt2 DDP bf16"}


@pytest.mark.parametrize("family, name", [
    pytest.param(f, n, id=f"{f}-{n}", marks=[pytest.mark.xfail(strict=True, reason="the planner's known miss")]
                 if f"{f} {n}" in MISSED else [])
    for f, n in CASES])
def test_predicted_memory_matches_the_caching_allocator(family, name, device_runs):
    config = parse_config(LAYOUTS[name])
    predicted = predict_memory(spec_from_hf(MODELS[family][1].to_dict(), family), config,
                               layout_for(config, Cluster(1, 1)), BATCH, SEQ, device=GPU)
    measured = device_runs[f"{family} {name}"]
    summary = {**predicted.detail(), "peak": predicted.tensors}
    report = ", ".join(f"{k} {summary[k] / 2**20:,.1f}/{measured[k] / 2**20:,.1f} MiB "
                       f"({summary[k] / max(measured[k], 1) - 1:+.1%})"
                       for k in (*cpu_check.STATES, "activations", "peak"))
    tensors = measured["allocated"] - measured["untracked"]
    print(f"\n{family} {name}: {report}; allocator peak {measured['allocated'] / 2**20:,.1f} MiB, of which "
          f"{measured['untracked'] / 2**20:,.1f} MiB no tensor's: tensors {predicted.tensors / 2**20:,.1f}/"
          f"{tensors / 2**20:,.1f} MiB ({predicted.tensors / tensors - 1:+.1%}); reserved "
          f"{measured['reserved'] / 2**20:,.1f} MiB, predicted total {predicted.total / 2**20:,.1f} MiB")
    for category in cpu_check.STATES:
        assert summary[category] == pytest.approx(measured[category], rel=0.10), f"{category}: {report}"
    assert summary["activations"] == pytest.approx(measured["activations"], rel=0.25), report
    assert tensors <= predicted.tensors <= 1.25 * tensors, report
    assert measured["reserved"] <= predicted.total, report
