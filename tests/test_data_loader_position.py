"""`sw.data_loader` saves and restores its position: a resumed run neither repeats nor skips samples.

The samples are the indices of a TensorDataset of `arange`, so what each rank saw is what it was
handed. The epoch's global order comes from torch's own DistributedSampler with one replica; the
sampler that starts part-way is held to torch's DistributedSampler dealing the rest. Worlds of
several replicas are simulated in one process (one loader per rank, advanced in lockstep) and
also run for real on gloo ranks through `sw.data_loader`.
"""

from __future__ import annotations

import gc
import io
import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardwise as sw
from shardwise.api.data import ResumableSampler, ShardedDataLoader
from shardwise.runtime.state import current
from shardwise.testing import run_distributed

SEED = 11
EPOCH = 2


def indices(length: int) -> TensorDataset:
    return TensorDataset(torch.arange(length))


def global_order(length: int, epoch: int = EPOCH, shuffle: bool = True, seed: int = SEED) -> list[int]:
    """The epoch's order before it is dealt: torch's sampler with a single replica."""
    sampler = DistributedSampler(indices(length), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def local_loader(length: int, batch_size: int, replicas: int, rank: int, shuffle: bool = True,
                 drop_last: bool = True, seed: int = SEED) -> ShardedDataLoader:
    """A loader for one rank of a simulated world: no process group."""
    sampler = ResumableSampler(indices(length), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    loader = DataLoader(indices(length), batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    return ShardedDataLoader(loader, sampler, torch.device("cpu"))


def samples(batches) -> list[int]:
    return [int(i) for (x,) in batches for i in x]


def take(loader: ShardedDataLoader, k: int) -> list[int]:
    """The samples of the next k batches; the loop is then left, as a run stopped by a checkpoint."""
    batches = iter(loader)
    return samples(next(batches) for _ in range(k))


# The sampler


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("length", [1, 3, 10, 13])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_from_the_start_it_is_torchs_distributed_sampler(length, replicas, drop_last, shuffle):
    for epoch in (0, 5):
        for rank in range(replicas):
            ours = ResumableSampler(indices(length), replicas, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            theirs = DistributedSampler(indices(length), replicas, rank, shuffle=shuffle, seed=SEED,
                                        drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (epoch, rank)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("start", [0, 1, 5, 12, 13])
def test_from_a_start_it_deals_the_rest_of_the_order_as_torch_does(start, replicas, drop_last):
    length = 13
    rest = global_order(length)[start:]
    for rank in range(replicas):
        sampler = ResumableSampler(indices(length), replicas, rank, seed=SEED, drop_last=drop_last, start=start)
        sampler.set_epoch(EPOCH)
        dealt = DistributedSampler(range(len(rest)), replicas, rank, shuffle=False, drop_last=drop_last)
        assert list(sampler) == [rest[i] for i in dealt]
        assert len(sampler) == len(dealt)


def test_a_start_outside_the_epoch_is_refused():
    with pytest.raises(ValueError, match="outside the epoch's 13 samples"):
        ResumableSampler(indices(13), 2, 0, start=14)


# The loader's position, in one process


def test_position_counts_every_replica_and_resets_at_the_end_of_an_epoch():
    length, batch = 20, 2
    order = global_order(length)
    loader = local_loader(length, batch, replicas=1, rank=0)
    loader.set_epoch(EPOCH)
    first = take(loader, 3)
    assert loader.consumed == 6 and len(loader) == 10
    loader.set_epoch(EPOCH)  # the same epoch, as a script does after a resume: the position stays
    rest = samples(loader)
    assert first + rest == order
    assert loader.consumed == 0
    assert samples(loader) == order  # run to its end, the next loop starts the epoch over

    take(loader, 4)
    loader.set_epoch(EPOCH + 1)  # another epoch starts at its beginning
    assert loader.consumed == 0 and loader.epoch == EPOCH + 1
    assert samples(loader) == global_order(length, EPOCH + 1)

    two = [local_loader(length, batch, replicas=2, rank=r) for r in range(2)]
    for rank_loader in two:
        take(rank_loader, 3)
    assert [rank_loader.consumed for rank_loader in two] == [12, 12]  # 3 batches × 2 samples × 2 replicas


def test_a_padded_epoch_saved_in_its_last_batch_continues_with_nothing():
    """Without drop_last the last batches are padded: the position stops at the epoch's end."""
    loader = local_loader(13, 2, replicas=4, rank=0, drop_last=False)
    take(loader, len(loader))  # 4 samples per replica, padded from 13 to 16
    assert loader.consumed == 13
    resumed = local_loader(13, 2, replicas=4, rank=0, drop_last=False)
    resumed.load_state_dict(loader.state_dict())
    assert len(resumed) == 0 and samples(resumed) == []


def test_state_is_plain_values_that_load_with_weights_only():
    loader = local_loader(20, 2, replicas=2, rank=1, shuffle=True, seed=SEED)
    loader.set_epoch(EPOCH)
    take(loader, 2)
    state = loader.state_dict()
    assert state == {"epoch": EPOCH, "consumed": 8, "seed": SEED, "shuffle": True, "dataset_length": 20,
                     "batch_size": 2, "replicas": 2, "drop_last": True}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


@pytest.mark.parametrize("change, named", [({"length": 21}, "dataset_length 20 saved, 21 here"),
                                           ({"seed": SEED + 1}, f"seed {SEED} saved, {SEED + 1} here"),
                                           ({"shuffle": False}, "shuffle True saved, False here")])
def test_a_position_in_another_order_is_refused_naming_what_differs(change, named):
    saver = local_loader(20, 2, replicas=2, rank=0)
    take(saver, 1)
    options = {"length": 20, "seed": SEED, "shuffle": True, **change}
    loader = local_loader(options["length"], 2, replicas=2, rank=0, shuffle=options["shuffle"],
                          seed=options["seed"])
    with pytest.raises(ValueError) as raised:
        loader.load_state_dict(saver.state_dict())
    assert named in str(raised.value) and "\n" not in str(raised.value)
    assert loader.consumed == 0


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("replicas, batch", [(1, 3), (2, 3), (3, 5), (4, 2)])
@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_a_position_saved_by_two_replicas_continues_with_any_number(k, replicas, batch, drop_last):
    """Saved by 2 replicas with batches of 3 after k steps; continued by `replicas` with batches of `batch`."""
    length = 29
    order = global_order(length)
    savers = [local_loader(length, 3, replicas=2, rank=r, drop_last=drop_last) for r in range(2)]
    before = []
    for saver in savers:
        saver.set_epoch(EPOCH)
        before += take(saver, k)
    states = [saver.state_dict() for saver in savers]
    assert states[0] == states[1]
    start = states[0]["consumed"]
    assert start == k * 3 * 2 and sorted(before) == sorted(order[:start])

    after = []
    for rank in range(replicas):
        loader = local_loader(length, batch, replicas=replicas, rank=rank, drop_last=drop_last)
        loader.load_state_dict(states[0])
        loader.set_epoch(EPOCH)
        after += samples(loader)
    assert not set(before) & set(after)
    if drop_last:
        # Each replica drops its incomplete last batch: the last (left mod batch·replicas) of the order go unseen.
        seen = length - (length - start) % (batch * replicas)
        assert len(before) + len(after) == len(set(before + after)) == seen
        assert set(before + after) == set(order[:seen])
    else:
        # Every sample is seen; the replicas' last batches are padded with fewer than `replicas` repeats.
        assert set(before + after) == set(order)
        assert len(after) == math.ceil((length - start) / replicas) * replicas


# Through sw.data_loader on real ranks

LENGTH, BATCH, STEPS_BEFORE = 43, 3, 4


def epoch_in_two_parts(length: int, batch: int, k: int) -> dict:
    """k batches, a fresh loader continuing from the first's state, and one uninterrupted epoch."""
    sw.init({})
    interrupted = sw.data_loader(indices(length), batch_size=batch, seed=SEED)
    interrupted.set_epoch(EPOCH)
    before = take(interrupted, k)
    state = interrupted.state_dict()
    resumed = sw.data_loader(indices(length), batch_size=batch, seed=SEED)
    resumed.load_state_dict(state)
    resumed.set_epoch(EPOCH)
    after = samples(resumed)
    whole = sw.data_loader(indices(length), batch_size=batch, seed=SEED)
    whole.set_epoch(EPOCH)
    return {"before": before, "after": after, "whole": samples(whole), "state": state}


def continue_epoch(state: dict, length: int, batch: int) -> list[int]:
    sw.init({})
    loader = sw.data_loader(indices(length), batch_size=batch, seed=SEED)
    loader.load_state_dict(state)
    loader.set_epoch(state["epoch"])
    return samples(loader)


def test_a_resumed_epoch_on_two_ranks_is_the_uninterrupted_one():
    ranks = run_distributed(epoch_in_two_parts, 2, LENGTH, BATCH, STEPS_BEFORE, timeout=120)
    for rank in ranks:
        assert rank["state"]["consumed"] == STEPS_BEFORE * BATCH * 2
        assert rank["before"] + rank["after"] == rank["whole"]  # each rank, batch for batch
    seen = [i for rank in ranks for i in rank["before"] + rank["after"]]
    assert len(seen) == len(set(seen))
    assert sorted(seen) == sorted(i for rank in ranks for i in rank["whole"])
    # drop_last: the 43 samples give 21 to each rank, 7 batches of 3; one sample goes unseen.
    assert sorted(seen) == sorted(global_order(LENGTH)[:42])


@pytest.mark.parametrize("world", [1, 4])
def test_a_position_saved_on_two_ranks_continues_on_another_world(world):
    saved = run_distributed(epoch_in_two_parts, 2, LENGTH, BATCH, STEPS_BEFORE, timeout=120)
    before = [i for rank in saved for i in rank["before"]]
    start = saved[0]["state"]["consumed"]
    after = [i for rank in run_distributed(continue_epoch, world, saved[0]["state"], LENGTH, BATCH, timeout=120)
             for i in rank]
    # drop_last: the last (43 - 24) mod (3 · world) samples of the order go unseen.
    seen = LENGTH - (LENGTH - start) % (BATCH * world)
    assert len(before) + len(after) == len(set(before + after)) == seen
    assert set(before + after) == set(global_order(LENGTH)[:seen])


def registry(saved: list) -> dict:
    """One rank: positions restored before the loaders exist, then into live and collected ones."""
    sw.init({})
    runtime = current()
    runtime.restore_loader_states(saved)
    first, second, third = (sw.data_loader(indices(LENGTH), batch_size=BATCH, seed=SEED) for _ in range(3))
    created = [loader.state_dict() for loader in (first, second, third)]
    first.set_epoch(saved[0]["epoch"])
    first_samples = samples(first)

    take(third, 2)
    del second
    gc.collect()
    states = runtime.loader_states()
    runtime.restore_loader_states([None, saved[0], saved[0]])  # first: skipped; second: gone; third: loads
    return {"created": created, "first": first_samples, "states": states, "first_now": first.state_dict(),
            "third_now": third.state_dict(), "resumed": runtime.resumed_loader_states}


def test_loaders_created_after_a_resume_continue_the_saved_positions():
    savers = [local_loader(LENGTH, 2, replicas=2, rank=r) for r in range(2)]
    for saver in savers:
        saver.set_epoch(EPOCH)
        take(saver, 5)
    saved = [savers[0].state_dict(), None]
    got = run_distributed(registry, 1, saved, timeout=120)[0]

    assert [state["consumed"] for state in got["created"]] == [20, 0, 0]
    assert [state["epoch"] for state in got["created"]] == [EPOCH, 0, 0]
    assert got["first"] == global_order(LENGTH)[20:41]  # one rank: the rest in order, 23 → 7 batches of 3
    assert [None if s is None else (s["epoch"], s["consumed"]) for s in got["states"]] == [(EPOCH, 0), None, (0, 6)]
    assert (got["first_now"]["epoch"], got["first_now"]["consumed"]) == (EPOCH, 0)
    assert (got["third_now"]["epoch"], got["third_now"]["consumed"]) == (EPOCH, 20)
    assert got["resumed"] == [None, saved[0], saved[0]]
