"""CUDA tier: optimizer-state and activation offload with pinned host memory and side streams.

On a CPU device nothing moves (test_offload_optimizer.py, test_activation_offload.py).
Here the accelerator's paths run: ZeRO-1's fp32 masters and ZeRO-3's FSDP2 shards
with their optimizer states live in pinned host memory while the parameters the
model computes with are on the device; activation offload's `ToHost` mover copies
each checkpointed region's kept input into a pinned buffer on a stream of its own
and back. Bytes are counted and the overlap is checked by what the mover exposes
(its copies queued on a side stream that waits on the compute stream through
events, never by the host), not timed. Each offloaded run trains as the same
layout without offload on the same device.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.api.recompute import runtime_offload
from shardwise.parallel.recompute.offload import ToHost
from shardwise.runtime import state
from shardwise.runtime.state import current
from shardwise.testing import run_distributed
from tiny_models import blocks, build, dataset, make_optimizer, relative_error, seed_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tier: torch sees no CUDA device")]

ROWS, STEPS = 4, 3
TOLERANCE = 1e-5


class CountingToHost(ToHost):
    """The accelerator's mover, counting bytes each way and noting where each copy ran."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.bytes = {"stored": 0, "fetched": 0}
        self.pinned, self.side_streams, self.compute_streams = [], set(), set()

    def store(self, tensor):
        stored = super().store(tensor)
        if stored is not tensor:
            self.bytes["stored"] += tensor.numel() * tensor.element_size()
            self.pinned.append(stored.host.is_pinned())
            self.compute_streams.add(torch.accelerator.current_stream(self.device).stream_id)
            self.side_streams.add(self.side.stream_id)
        return stored

    def fetch(self, stored):
        fetched = super().fetch(stored)
        if fetched is not stored:
            self.bytes["fetched"] += fetched.tensor.numel() * fetched.tensor.element_size()
            self.pinned.append(stored.host.is_pinned())
        return fetched


def _train(model, optimizer) -> list[float]:
    train_step = seed_step("gpt2")
    losses = []
    for inputs, targets in sw.data_loader(dataset("gpt2", STEPS * ROWS), batch_size=ROWS, shuffle=False):
        optimizer.zero_grad()
        losses.append(train_step(model, inputs, targets).reduce_mean().item())
        optimizer.step()
    return losses


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train_with_optimizer_offload(config: dict) -> dict:
    """Losses and parameters, and where the optimizer's tensors (masters and states) lived after the steps."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    losses = _train(model, optimizer)
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}  # never stepped: they stay where they are
    stepped = [_local(p) for group in optimizer.param_groups for p in group["params"] if id(p) not in frozen]
    states = [_local(v) for s in optimizer.optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"losses": losses, "state": {k: v.detach().cpu() for k, v in model.full_state_dict().items()},
            "trainable_bytes": sum(_local(p).numel() * 4 for p in model.parameters() if p.requires_grad),
            "stepped": sorted({(t.device.type, t.is_pinned()) for t in stepped}),
            "states": sorted({(t.device.type, t.is_pinned()) for t in states}),
            "host_bytes": sum(t.numel() * t.element_size() for t in stepped + states if t.device.type == "cpu")}


def _same_training(got: dict, want: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=TOLERANCE, atol=0)
    worst = max(relative_error(got["state"][k], v) for k, v in want["state"].items())
    assert worst <= TOLERANCE


@pytest.mark.parametrize("config", [{"shard_optimizer_state": True}, {"zero_stage": 3}],
                         ids=["zero1", "zero3"])
def test_optimizer_states_live_in_pinned_host_memory_and_train_the_same(config):
    [(offloaded, plain)] = run_distributed(offloaded_and_plain, 1, config, timeout=300)
    assert offloaded["stepped"] == [("cpu", True)], offloaded["stepped"]  # pinned: copies to the device are fast
    assert {device for device, _ in offloaded["states"]} == {"cpu"}, offloaded["states"]
    assert {device for device, _ in plain["states"]} == {"cuda"}, plain["states"]
    # the stepped fp32 values and AdamW's two states: at least three fp32 copies of the trainable parameters
    assert offloaded["host_bytes"] >= 3 * offloaded["trainable_bytes"], offloaded["host_bytes"]
    _same_training(offloaded, plain)


def offloaded_and_plain(config: dict) -> tuple[dict, dict]:
    """The layout with offload, then without, in one process (the runtime starts afresh between them)."""
    offloaded = train_with_optimizer_offload({**config, "offload_optimizer_state": True})
    state.set_current(None)
    return offloaded, train_with_optimizer_offload(config)


def train_with_activation_offload(offload: bool) -> dict:
    """Every GPT-2 block checkpointed, its kept inputs offloaded through the counting mover (or kept)."""
    sw.init({"offload_activations": offload, "activation_loading_horizon": 1})
    mover = None
    if offload:
        schedule = runtime_offload(current())
        assert isinstance(schedule.mover, ToHost), type(schedule.mover)
        mover = schedule.mover = CountingToHost(current().device)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    for block in blocks(model.get_module()):
        sw.set_activation_checkpointing(block)
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    losses = _train(model, optimizer)
    result = {"losses": losses, "state": {k: v.detach().cpu() for k, v in model.full_state_dict().items()}}
    if mover is not None:
        result.update(bytes=mover.bytes, pinned=sorted(set(mover.pinned)), side=sorted(mover.side_streams),
                      compute=sorted(mover.compute_streams), blocks=len(blocks(model.get_module())))
    return result


def activation_offload_pair() -> tuple[dict, dict]:
    offloaded = train_with_activation_offload(True)
    state.set_current(None)
    return offloaded, train_with_activation_offload(False)


def test_activation_offload_copies_each_kept_input_to_pinned_memory_on_a_side_stream():
    [(offloaded, plain)] = run_distributed(activation_offload_pair, 1, timeout=300)
    # one kept input per block and step (the hidden states: rows × tokens × hidden fp32), each fetched back once
    hidden = build("gpt2").config.n_embd
    per_step = offloaded["blocks"] * ROWS * dataset("gpt2", 1)[0][0].numel() * hidden * 4
    assert offloaded["bytes"]["stored"] == STEPS * per_step, offloaded["bytes"]
    assert offloaded["bytes"]["fetched"] == offloaded["bytes"]["stored"]
    assert offloaded["pinned"] == [True]
    assert offloaded["side"] and not set(offloaded["side"]) & set(offloaded["compute"]), \
        "the copies must run on a stream of their own to overlap compute"
    _same_training(offloaded, plain)
