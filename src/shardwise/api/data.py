"""`data_loader`: a DataLoader whose sampler gives each data-parallel rank its own slice.

As in SMP, the ranks of a tensor-parallel group read different batches unless
`prescaled_batch` is on, in which case they read the same (tp_size times larger) one.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .. import torch_internals as pytree
from ..runtime import ranks
from ..runtime.state import current


class ShardedDataLoader:
    """Iterates this rank's batches, already on its device; call `set_epoch` each epoch when shuffling."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, device: torch.device):
        self.loader = loader
        self.sampler = sampler
        self.device = device

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield pytree.tree_map(
                lambda x: x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch)


def data_loader(dataset: Dataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                drop_last: bool = True, **loader_kwargs: Any) -> ShardedDataLoader:
    """`batch_size` is per data-parallel rank (per tensor-parallel group with prescaled_batch)."""
    runtime = current("shardwise.data_loader")
    if runtime.config.prescaled_batch:
        replicas, index = ranks.rdp_size(), ranks.rdp_rank()
    else:
        replicas, index = ranks.dp_size(), ranks.dp_rank()
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=index, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
    return ShardedDataLoader(loader, sampler, runtime.device)
