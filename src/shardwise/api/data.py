"""`data_loader`: a DataLoader whose sampler gives each data-parallel rank its own slice.

As in SMP, the ranks of a tensor-parallel group read different batches unless
`prescaled_batch` is on, in which case they read the same (tp_size times larger) one.

A loader keeps its position in the epoch so that checkpoints can save it and a resumed run
continues it, with any number of replicas: the runtime lists the loaders in creation order,
and its `loader_states` / `restore_loader_states` are what the checkpoint module calls.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .. import torch_internals as pytree
from ..observe.recorder import Recorder, recorder_for
from ..runtime import ranks
from ..runtime.state import current


_END = object()  # what a loop's iterator gives after its last batch


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can begin an epoch part-way through.

    `start` counts the entries of the epoch's global order (the permutation, before it is dealt
    to the replicas) already consumed; the rest is dealt as DistributedSampler deals a whole
    epoch, padding (without drop_last) by repeating the rest from its beginning. With start=0 it
    yields exactly what DistributedSampler yields. Because the dealing is interleaved, k batches of
    b on each of n replicas consume exactly the first k*b*n entries, which is why a position saved
    by one number of replicas can be continued by another.
    """

    def __init__(self, dataset: Dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, start: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start = start

    @property
    def start(self) -> int:
        return self._start

    @start.setter
    def start(self, start: int) -> None:
        length = len(self.dataset)
        if not 0 <= start <= length:
            raise ValueError(f"start {start} is outside the epoch's {length} samples")
        self._start = start
        # DistributedSampler's sizes, for the entries left.
        left = length - start
        self.num_samples = left // self.num_replicas if self.drop_last else math.ceil(left / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        rest = order[self.start:]
        if rest:  # truncated (drop_last) or padded cyclically to total_size
            rest = (rest * math.ceil(self.total_size / len(rest)))[:self.total_size]
        return iter(rest[self.rank::self.num_replicas])


class ShardedDataLoader:
    """Iterates this rank's batches, already on its device; call `set_epoch` each epoch when shuffling.

    Its position is `epoch` and `consumed`: the entries of the epoch's global order taken by the
    batches every replica has been handed so far. A loop left early (`break`) is continued by the
    next loop; a loop run to its end leaves the next one to start the epoch over, as
    DistributedSampler does without `set_epoch`.
    """

    def __init__(self, loader: DataLoader, sampler: ResumableSampler, device: torch.device,
                 recorder: Optional[Recorder] = None):
        self.loader = loader
        self.sampler = sampler
        self.device = device
        self.recorder = recorder  # times each batch's fetch: the step's data wait (none without a runtime)
        self.consumed = sampler.start
        self.worker_seeds: Optional[torch.Generator] = None  # data_loader's own generator, reseeded every loop

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Another epoch starts at its beginning; the current one keeps its position (scripts call this
        at the top of every epoch, also the one a resume continues)."""
        if epoch != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
            self._seek(0)

    def state_dict(self) -> dict:
        """The position, in plain values (checkpoints are loaded with weights_only), and what it depends on."""
        sampler = self.sampler
        return {"epoch": int(sampler.epoch), "consumed": self.consumed, "seed": int(sampler.seed),
                "shuffle": bool(sampler.shuffle), "dataset_length": len(sampler.dataset),
                "batch_size": self.loader.batch_size, "replicas": sampler.num_replicas,
                "drop_last": bool(sampler.drop_last)}

    def load_state_dict(self, state: dict) -> None:
        """Make the next loop continue a saved position. The batch size and the number of replicas may differ
        from the saver's; the epoch's order (dataset length, seed, shuffle) may not."""
        ours = self.state_dict()
        differs = [f"{key} {state[key]!r} saved, {ours[key]!r} here"
                   for key in ("dataset_length", "seed", "shuffle") if state[key] != ours[key]]
        if differs:
            raise ValueError("this data loader cannot continue the saved position, its epochs are in another "
                             "order: " + "; ".join(differs))
        self.sampler.set_epoch(int(state["epoch"]))
        self._seek(int(state["consumed"]))

    def _seek(self, consumed: int) -> None:
        self.sampler.start = consumed
        self.consumed = consumed

    def __len__(self) -> int:
        """Batches of the loop under way, or of the next one: fewer when it continues a position."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self._seek(self.consumed)
        if self.worker_seeds is not None:
            # A loop draws its workers' base seed from this generator; torch's global RNG (dropout's) would
            # otherwise be consumed by every loop, so a resumed run, which starts one loop more, would differ.
            self.worker_seeds.manual_seed(self.sampler.seed + self.sampler.epoch)
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        step = self.loader.batch_size * self.sampler.num_replicas
        length = len(self.sampler.dataset)
        batches = iter(self.loader)
        while True:
            fetching = time.perf_counter()
            batch = next(batches, _END)
            if batch is _END:
                break
            # Counted before the batch is handed over: a checkpoint taken while it trains must not give it again.
            # Padding (without drop_last) can make the last step overshoot the epoch.
            self.consumed = min(self.consumed + step, length)
            batch = pytree.tree_map(
                lambda x: x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch)
            if self.recorder is not None:
                self.recorder.batch_fetched(fetching, time.perf_counter())
            yield batch
        self._seek(0)


def data_loader(dataset: Dataset, batch_size: int, shuffle: bool = True, seed: int = 0,
                drop_last: bool = True, **loader_kwargs: Any) -> ShardedDataLoader:
    """`batch_size` is per data-parallel rank (per tensor-parallel group with prescaled_batch).

    A loader created after `resume_from_checkpoint` continues the position saved for the loader
    created in the same order."""
    runtime = current("shardwise.data_loader")
    if runtime.config.prescaled_batch:
        replicas, index = ranks.rdp_size(), ranks.rdp_rank()
    else:
        replicas, index = ranks.dp_size(), ranks.dp_rank()
    sampler = ResumableSampler(dataset, num_replicas=replicas, rank=index, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    own_generator = "generator" not in loader_kwargs
    if own_generator:
        loader_kwargs["generator"] = torch.Generator()
    loader = ShardedDataLoader(
        DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs),
        sampler, runtime.device, recorder_for(runtime))
    loader.worker_seeds = loader_kwargs["generator"] if own_generator else None
    number = len(runtime.loaders)
    runtime.loaders.append(weakref.ref(loader))
    if number < len(runtime.resumed_loader_states) and runtime.resumed_loader_states[number] is not None:
        loader.load_state_dict(runtime.resumed_loader_states[number])
    return loader
