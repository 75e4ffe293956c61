"""What the runtime builds for a config on a layout, decided once for the runtime and the planner.

Pure (no torch): `parallel/sharding.py` wraps by `wrapping`, `parallel/precision.py`
casts by `precision_mode`, and the planner predicts memory and time from the
same two answers, so a prediction can never describe another wrapping than the
one that runs.
"""

from __future__ import annotations

from enum import Enum

from ..config.schema import ShardwiseConfig
from .layout import Layout


class Wrapping(str, Enum):
    """How a model (or a pipeline stage) is kept in sync over its data-parallel ranks."""

    SINGLE = "single"            # one replica: nothing to synchronise
    DDP = "ddp"                  # torch DistributedDataParallel (ZeRO-0, ZeRO-1 in fp32)
    REPLICATE = "replicate"      # FSDP2's replicate: DDP cannot bucket DTensors nor follow a pipeline schedule
    ZERO1_MASTERS = "zero1-masters"  # ZeRO-1 in bf16/fp16: the optimizer reduces gradients to fp32 masters
    SHARDED = "sharded"          # FSDP2's fully_shard: ZeRO-2/3, MiCS when the layout has several replicas


class PrecisionMode(str, Enum):
    """Where the compute dtype comes from."""

    FULL = "fp32"                # no mixed precision
    AUTOCAST = "autocast"        # fp32 parameters, torch.autocast around forward
    CAST = "cast"                # FSDP2's MixedPrecisionPolicy casts parameters and inputs per module
    STORED = "stored"            # parameters stored in the compute dtype (ZeRO-1's half-precision replicas)


def wrapping(config: ShardwiseConfig, layout: Layout, trains: bool = True) -> Wrapping:
    """`trains`: the part has parameters to train (a frozen teacher has none: nothing to synchronise)."""
    if config.effective_zero_stage >= 2:
        return Wrapping.SHARDED
    if config.sharded_master_weights:
        return Wrapping.ZERO1_MASTERS
    if layout.dp == 1 or not trains:
        return Wrapping.SINGLE
    if layout.tp > 1 or layout.pp > 1:
        return Wrapping.REPLICATE
    return Wrapping.DDP


def precision_mode(config: ShardwiseConfig, layout: Layout, trains: bool = True) -> PrecisionMode:
    if config.dtype_name == "fp32":
        return PrecisionMode.FULL
    return {Wrapping.SHARDED: PrecisionMode.CAST, Wrapping.REPLICATE: PrecisionMode.CAST,
            Wrapping.ZERO1_MASTERS: PrecisionMode.STORED}.get(wrapping(config, layout, trains), PrecisionMode.AUTOCAST)


def shards_optimizer_state(config: ShardwiseConfig, layout: Layout) -> bool:
    """ZeRO-1's optimizer side: states dealt over the replicas (and fp32 masters of the share in bf16/fp16)."""
    return config.effective_zero_stage == 1 and (layout.dp > 1 or config.sharded_master_weights)


def secondary_partition(config: ShardwiseConfig, layout: Layout) -> int:
    """ZeRO++ hpZ: how many ranks a ZeRO-3 unit's parameters stay sharded over between its forward and its backward
    (FSDP2's `reshard_after_forward=<int>`), or 0 where they are re-sharded over the whole sharding group as plain
    ZeRO-3 does. A secondary group as large as the sharding group or larger is that same plain ZeRO-3 (DeepSpeed
    clamps the size to the world)."""
    size = config.zero_hpz_partition_size
    sharded = wrapping(config, layout) is Wrapping.SHARDED and config.effective_zero_stage == 3
    return size if sharded and 1 < size < layout.dp_shard else 0
