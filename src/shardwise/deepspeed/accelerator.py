"""`deepspeed.accelerator.get_accelerator()`: the device this rank trains on, through torch's own device APIs.

Scripts ask it for the device name, the current device, counts, seeds, synchronisation and memory; the
answers come from `torch.accelerator` (CUDA, XPU, ... or none, then the CPU), never a hard-coded device.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from ..runtime.devices import backend_for, local_device


class Accelerator:
    """DeepSpeed's accelerator interface, for the accelerator torch finds (the CPU when there is none)."""

    def _type(self) -> str:
        found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return found.type if found is not None else "cpu"

    def _module(self) -> Any:
        return getattr(torch, self._type(), None)

    def device_name(self, device_index: Optional[int] = None) -> str:
        return self._type() if device_index is None else f"{self._type()}:{device_index}"

    def current_device_name(self) -> str:
        return str(local_device(int(os.environ.get("LOCAL_RANK", 0))))

    def current_device(self) -> int:
        return torch.accelerator.current_device_index() if self._type() != "cpu" else 0

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._type() != "cpu":
            torch.accelerator.set_device_index(device_index)

    def device_count(self) -> int:
        return torch.accelerator.device_count() if self._type() != "cpu" else 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._type() != "cpu":
            torch.accelerator.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return backend_for(torch.device(self._type()))

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return self._type() != "cpu"

    def empty_cache(self) -> None:
        if self._type() != "cpu":
            torch.accelerator.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.accelerator.memory_allocated(device_index) if self._type() != "cpu" else 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.accelerator.max_memory_allocated(device_index) if self._type() != "cpu" else 0

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._type() != "cpu" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._type()


_ACCELERATOR = Accelerator()


def get_accelerator() -> Accelerator:
    return _ACCELERATOR
