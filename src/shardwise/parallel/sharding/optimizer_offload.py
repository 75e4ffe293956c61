"""Optimizer-state offload (`offload_optimizer_state`): what the optimizer keeps and updates lives in host memory.

- ZeRO-1: each rank's share is stepped as fp32 master copies in host memory, beside the
  optimizer's states (zero1/master_weights.py). Gradients still reach their owner on the
  device during backward; at the step they cross to the host, and the updated masters
  cross back into the device's parameters before the broadcasts.
- ZeRO-2/3 and MiCS: FSDP2's `CPUOffloadPolicy` (apply.py). FSDP2's fp32 parameter
  shards are the values the optimizer updates, so they and their gradients live in host
  memory with the states: a unit's shards are copied to the device when it is gathered,
  its reduced gradient shards back to the host, and the optimizer steps on the host.

On a CPU device host and device memory are one. The same code runs (masters apart
from the parameters, FSDP2's offload path), nothing is saved, and rank 0 says so
at `init`. Pinned host memory needs an accelerator, so only an accelerator pins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy


@dataclass(frozen=True)
class HostOffload:
    """Optimizer states live in host memory; `pin`: page-locked, so copies to an accelerator are fast (a CPU
    device has no separate host memory: nothing to pin, and `runtime/init.py` says nothing is saved)."""

    pin: bool

    @classmethod
    def for_device(cls, device: torch.device) -> "HostOffload":
        return cls(pin=device.type != "cpu")


def sharded_offload_policy(offload: Optional[HostOffload]) -> OffloadPolicy:
    """FSDP2's offload policy for a sharding unit: host memory when optimizer states are offloaded."""
    return OffloadPolicy() if offload is None else CPUOffloadPolicy(pin_memory=offload.pin)


def master_copy(tensor: torch.Tensor, offload: Optional[HostOffload]) -> torch.Tensor:
    """An fp32 copy of `tensor` for the optimizer to step: in host memory (pinned on an accelerator, so the
    copies back to the device are fast) when optimizer states are offloaded, else beside `tensor`."""
    if offload is None:
        return tensor.detach().to(torch.float32, copy=True)
    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=offload.pin)
    return host.copy_(tensor.detach())


@torch.no_grad()
def hand_gradients_to(masters: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Each master's gradient, where the master lives: copies to host memory are issued together and waited
    for once (a gradient already beside its master is handed over as it is)."""
    copied = False
    for master, grad in zip(masters, grads):
        if grad.device == master.device:
            master.grad = grad
            continue
        master.grad = torch.empty_like(master, pin_memory=master.is_pinned()).copy_(grad, non_blocking=True)
        copied = True
    if copied:
        torch.accelerator.synchronize()
