"""The Trainer's data and evaluation gathers over model replicas, where a replica spans several ranks.

Under tensor parallelism the ranks of a tensor-parallel group run one model on one batch (transformers' own
tensor parallelism has them share the batch too; shardwise's `prescaled_batch`), and under pipeline parallelism
the stages do, so the Trainer's batches are dealt to the replicas, not the ranks, and an evaluation gathers one
copy of each replica's results. Where every rank is a replica (DDP, ZeRO, MiCS) accelerate's own dealing and
gathers are kept as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..runtime import ranks


def replica_count() -> int:
    return ranks.rdp_size()


def install(accelerator: Any) -> None:
    """Make `accelerator` deal DataLoaders to the replicas and gather evaluation results from one rank of each
    (its `prepare_data_loader` and `gather_for_metrics`, which the Trainer calls through the accelerator)."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import recursively_apply

    replicas, index = ranks.rdp_size(), ranks.rdp_rank()
    world = dist.get_world_size()
    # One rank per replica (its first tensor-parallel rank on pipeline rank 0, which receives a pipeline's
    # results), in replica order: whose results an evaluation keeps.
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (index, ranks.tp_rank() == 0 and ranks.pp_rank() == 0))
    keep = [rank for _, rank in sorted((replica, rank) for rank, (replica, first) in enumerate(every) if first)]

    def prepare(data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None) -> Any:
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        placement = accelerator.device_placement if device_placement is None else device_placement
        prepared = prepare_data_loader(
            data_loader, accelerator.device, num_processes=replicas, process_index=index,
            split_batches=accelerator.split_batches, put_on_device=placement, rng_types=accelerator.rng_types.copy(),
            dispatch_batches=accelerator.dispatch_batches, even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader)
        accelerator._dataloaders.append(prepared)
        return prepared

    def gather_for_metrics(input_data: Any, use_gather_object: bool = False) -> Any:
        if use_gather_object:
            raise ValueError("eval_use_gather_object=True: under tensor or pipeline parallelism shardwise.hf gathers "
                             "tensors only; set it to False")
        gathered = accelerator.gather(input_data)
        data = recursively_apply(lambda t: torch.cat([t.chunk(world)[rank] for rank in keep]), gathered)
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the last batch padded with repeated samples
            return recursively_apply(lambda t: t[:state.remainder], data)
        return data

    accelerator.prepare_data_loader = prepare
    accelerator.gather_for_metrics = gather_for_metrics
