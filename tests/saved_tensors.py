"""Bytes autograd keeps for backward inside a model's blocks, counted by a saved-tensors hook: each storage once (a
DTensor's local one), from when an op saves it until backward frees it, parameters left out; the peak of the count."""

from __future__ import annotations

from typing import Callable

import torch

from tiny_models import blocks


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding the storage: a DTensor's (or another wrapper subclass's) local tensor."""
    while hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, names[0])
    return tensor


class SavedInBlocks:
    def __init__(self, model: torch.nn.Module) -> None:
        self.inside, self.live, self.held, self.peak = 0, {}, 0, 0
        self.weights = {local(p).untyped_storage().data_ptr() for p in model.parameters()}   # not activations
        for block in blocks(model):
            block.register_forward_pre_hook(lambda *_: self._enter(1))
            block.register_forward_hook(lambda *_: self._enter(-1))

    def _enter(self, step: int) -> None:
        self.inside += step

    def pack(self, tensor: torch.Tensor):
        storage = local(tensor).untyped_storage()
        key = storage.data_ptr()
        if not self.inside or key in self.weights:
            return tensor
        nbytes, count = self.live.get(key, (storage.nbytes(), 0))
        if not count:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        self.live[key] = (nbytes, count + 1)
        return _Kept(self, key, tensor)

    def unpack(self, packed):
        return packed.tensor if isinstance(packed, _Kept) else packed

    def release(self, key: int) -> None:
        nbytes, count = self.live[key]
        if count == 1:
            del self.live[key]
            self.held -= nbytes
        else:
            self.live[key] = (nbytes, count - 1)


class _Kept:
    def __init__(self, counter: SavedInBlocks, key: int, tensor: torch.Tensor) -> None:
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self.counter.release(self.key)


def peak_saved_in_blocks(model: torch.nn.Module, run: Callable[[], object]) -> int:
    """The most bytes `model`'s blocks kept for backward at once while `run()` ran."""
    counter = SavedInBlocks(model)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        run()
    return counter.peak
