"""CUDA tier: the main layouts at world size 1 on a real device, against one plain CPU process.

One rank on the accelerator (the harness gives it the device and its backend,
NCCL on CUDA) runs the seed's loop through shardwise, so FSDP2's device code,
its mixed-precision casts and fp16's loss scaler on the device all execute. fp32
runs match a plain CPU process to 1e-4 (another device's summation order; TF32 is
off by default); bf16 and fp16 to their rounding. fp16's scaler, on the device, skips
a step whose gradients overflowed and backs off. On one rank ZeRO-2 and ZeRO-3 are
asked for by `zero_stage` (`sharded_data_parallel_degree: 1` means no sharding, as in
SMP). Skipped, saying so, where torch sees no CUDA device.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import blocks, build, dataset, make_optimizer, relative_error, seed_step, train_reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tier: torch sees no CUDA device")]

ROWS, STEPS = 4, 3
FP32_TOLERANCE = 1e-4
# Parameters: AdamW's first steps move each element by about its learning rate whatever the gradient's size, so an
# element whose gradient is near zero can step the other way under bf16's rounding; on a bias that starts at zero
# that is a few per cent of the tensor (3.4e-2 measured on an H200 for GPT-2's ln_2.bias under bf16 autocast;
# test_same_math.py's SGD runs on the CPU stay under 1e-2).
HALF_TOLERANCE = {"losses": 1e-2, "parameters": 5e-2}
# ZeRO-1 in bf16 steps bf16 replicas: a small bias drifts most (8e-2 relative measured on one CPU process).
ZERO1_BF16_PARAMETERS = 0.15

LAYOUTS = {
    "ddp": {},
    "zero1": {"shard_optimizer_state": True},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "ddp-microbatches": {"microbatches": 2},
    "zero3-clipping": {"zero_stage": 3, "gradient_clipping": 0.5},
    "zero3-checkpointing": {"zero_stage": 3},
}
HALF = {
    "ddp-bf16": {"bf16": True},
    "zero1-bf16": {"shard_optimizer_state": True, "bf16": True},
    # the microbatches' gradients added up in fp32 buffers on the device, reduced once a step
    "zero1-bf16-local": {"shard_optimizer_state": True, "bf16": True, "microbatches": 2,
                         "accumulate_gradients_locally": True},
    "zero3-bf16": {"zero_stage": 3, "bf16": True},
    "ddp-fp16": {"fp16": True},
    "zero3-fp16": {"zero_stage": 3, "fp16": True},
}


def train_on_device(kind: str, config: dict, checkpointing: bool) -> dict:
    """The seed's loop on this rank's accelerator: losses, whole parameters (on the CPU), where things lived."""
    sw.init(config)
    model = sw.DistributedModel(build(kind, freeze_key_bias=True))
    if checkpointing:
        for block in blocks(model.get_module()):
            sw.set_activation_checkpointing(block)
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    train_step = seed_step(kind)
    losses = []
    for inputs, targets in sw.data_loader(dataset(kind, STEPS * ROWS), batch_size=ROWS, shuffle=False):
        optimizer.zero_grad()
        losses.append(train_step(model, inputs, targets).reduce_mean().item())
        optimizer.step()
    scaler = optimizer.loss_scaler
    return {"losses": losses,
            "state": {k: v.detach().cpu() for k, v in model.full_state_dict().items()},
            "parameter_devices": sorted({p.device.type for p in model.parameters()}),
            "sharded": isinstance(next(model.parameters()), DTensor),
            "scaler_device": None if scaler is None else scaler._scale.device.type,
            "loss_scale": None if scaler is None else optimizer.loss_scale}


@functools.cache
def reference(kind: str, clip: float | None) -> dict:
    return train_reference(kind, "adamw", STEPS, ROWS, clip)


def _worst(got: dict, want: dict) -> tuple[str, float]:
    errors = {name: relative_error(got[name], value) for name, value in want.items()}
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fp32_on_the_device_trains_as_one_cpu_process(kind, layout):
    config = LAYOUTS[layout]
    [got] = run_distributed(train_on_device, 1, kind, config, layout.endswith("checkpointing"), timeout=300)
    want = reference(kind, config.get("gradient_clipping"))
    assert got["parameter_devices"] == ["cuda"]
    assert got["sharded"] == ("zero_stage" in config)  # FSDP2's device code ran for ZeRO-2/3
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=FP32_TOLERANCE,
                               atol=0)
    name, error = _worst(got["state"], want["state"])
    assert error <= FP32_TOLERANCE, f"{name} differs by {error:.2e} (relative)"


@pytest.mark.parametrize("layout", HALF)
def test_half_precision_on_the_device_stays_within_its_rounding(layout):
    """FSDP2's MixedPrecisionPolicy (ZeRO-3), autocast (DDP) and ZeRO-1's half replicas on the device; fp16 with
    its loss scaler's state on the device, the scale still finite and positive after the steps."""
    config = LAYOUTS["ddp"] | HALF[layout]
    [got] = run_distributed(train_on_device, 1, "gpt2", config, False, timeout=300)
    want = reference("gpt2", None)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=HALF_TOLERANCE["losses"], atol=0)
    name, error = _worst(got["state"], want["state"])
    tolerance = ZERO1_BF16_PARAMETERS if layout.startswith("zero1-bf16") else HALF_TOLERANCE["parameters"]
    assert error <= tolerance, f"{name} differs by {error:.2e} (relative)"
    if config.get("fp16"):
        assert got["scaler_device"] == "cuda"
        assert 0 < got["loss_scale"] < float("inf")
    else:
        assert got["scaler_device"] is None


def overflow_on_device(config: dict) -> dict:
    """Two fp16 steps, the second with an inf put into one gradient on the device: the scaler must skip it."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    train_step = seed_step("gpt2")
    device = next(model.parameters()).device  # the seed's scripts move each batch to the rank's device
    inputs, targets = (t.to(device) for t in dataset("gpt2", ROWS)[:ROWS])
    seen = []
    for poisoned in (False, True):
        optimizer.zero_grad()
        scale = optimizer.loss_scale
        before = {k: v.detach().to("cpu", copy=True) for k, v in model.full_state_dict().items()}
        train_step(model, inputs, targets)
        if poisoned:  # after backward: FSDP2 writes its sharded parameters' gradients without running their hooks
            first = next(p for p in model.parameters() if p.grad is not None)
            first.grad.fill_(float("inf"))
        optimizer.step()
        after = {k: v.detach().cpu() for k, v in model.full_state_dict().items()}
        seen.append({"overflow": optimizer.overflow, "scale": (scale, optimizer.loss_scale),
                     "unchanged": all(torch.equal(before[k], after[k]) for k in before)})
    return {"steps": seen, "scaler_device": optimizer.loss_scaler._scale.device.type}


@pytest.mark.parametrize("layout", ["ddp-fp16", "zero3-fp16"])
def test_fp16_overflow_on_the_device_skips_the_step_and_backs_off(layout):
    [got] = run_distributed(overflow_on_device, 1, HALF[layout], timeout=300)
    clean, poisoned = got["steps"]
    assert got["scaler_device"] == "cuda"
    assert not clean["overflow"] and not clean["unchanged"]
    assert poisoned["overflow"] and poisoned["unchanged"], poisoned
    assert poisoned["scale"][1] < poisoned["scale"][0]
