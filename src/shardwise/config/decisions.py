"""What the runtime builds for a config on a layout, decided once for the runtime, the planner and the checks.

Pure (no torch). `Decisions(config, layout)` answers every "is X on / which
mode" question: `parallel/compose.py` builds by it, the planner predicts memory
and time from it, `config/effects.py` and the checks name what it turns off. They
call the same object, so a prediction can never describe another wrapping, another
reduction or another precision than the one that runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Literal, Optional

from ..topology import Layout
from .schema import ShardwiseConfig


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
    STORED = "stored"            # parameters stored in the compute dtype (ZeRO-1's half-precision replicas, and
                                 # every wrapping in pure bf16)


@dataclass(frozen=True)
class CrossGroupSettings:
    """MiCS's gradient all-reduce across partition groups, run by shardwise (parallel/sharding/mics.py)."""

    dtype: Literal["fp32", "bf16"]          # on the link; the reduce-scatter and the optimizer stay fp32
    overlap: Literal["backward", "forward"]  # "forward": it may go on through the step and the next forward

    @property
    def deferred(self) -> bool:
        return self.overlap == "forward"


class Decisions:
    """Every layout-dependent choice for one (config, layout)."""

    def __init__(self, config: ShardwiseConfig, layout: Layout):
        self.config, self.layout = config, layout

    @property
    def pipelining(self) -> bool:
        return self.layout.pp > 1

    @property
    def tensor_parallel(self) -> bool:
        return self.layout.tp > 1

    @property
    def sequence_parallel(self) -> bool:
        """Tensor-parallel ranks hold a slice of the sequence between split layers (never without tp)."""
        return self.config.sequence_parallel and self.tensor_parallel

    @property
    def sequence_parallel_regather(self) -> bool:
        """Blocks keep each column-parallel input they gathered as its sequence shard and gather it again in
        backward (Megatron-LM's way): the norms' outputs at 1/tp, one more all-gather per input in backward."""
        return self.sequence_parallel and self.config.sequence_parallel_regather

    def sequence_fits(self, seq: int) -> bool:
        """Sequence parallelism splits every sequence evenly over the tp ranks (checked at the first block)."""
        return not self.sequence_parallel or splits_evenly(seq, self.layout.tp)

    @property
    def zero_stage(self) -> int:
        return self.config.effective_zero_stage

    def graph_cut(self, has_block_list: bool) -> bool:
        """The pipeline is cut from the module graph at the first @step, not at a list of blocks."""
        cut = self.config.pipeline_cut
        return self.pipelining and (cut == "graph" or (cut == "auto" and not has_block_list))

    def materialises_per_unit(self, meta_built: bool) -> bool:
        """A meta-built model is materialised one sharding unit at a time, right before FSDP2 shards it
        (ZeRO-2/3 and MiCS without tensor parallelism, which needs the whole layer placed to split it)."""
        return (meta_built and self.zero_stage >= 2 and not self.tensor_parallel and not self.pipelining
                and not self.expert_parallel)  # experts are split before sharding, from the placed model

    def wrapping(self, trains: bool = True) -> Wrapping:
        """`trains`: the part has parameters to train (a frozen teacher has none: nothing to synchronise)."""
        if self.zero_stage >= 2:
            return Wrapping.SHARDED
        if self.config.sharded_master_weights:
            return Wrapping.ZERO1_MASTERS
        if self.layout.dp * self.layout.cp == 1 or not trains:  # cp ranks reduce gradients as replicas do
            return Wrapping.SINGLE
        if self.tensor_parallel or self.pipelining:
            return Wrapping.REPLICATE
        return Wrapping.DDP

    def precision_mode(self, trains: bool = True) -> PrecisionMode:
        if self.config.dtype_name == "fp32":
            return PrecisionMode.FULL
        if self.pure_bf16:
            return PrecisionMode.STORED
        return {Wrapping.SHARDED: PrecisionMode.CAST, Wrapping.REPLICATE: PrecisionMode.CAST,
                Wrapping.ZERO1_MASTERS: PrecisionMode.STORED}.get(self.wrapping(trains), PrecisionMode.AUTOCAST)

    @property
    def pure_bf16(self) -> bool:
        """Parameters stored in bf16 under every wrapping, gradients reduced in bf16, no fp32 master: the optimizer
        steps the bf16 parameters (bf16_master_weights_and_grads)."""
        return self.config.pure_bf16

    @property
    def reduce_dtype(self) -> Literal["fp32", "bf16"]:
        """The dtype gradients are reduced in over the data-parallel ranks (MiCS's cross-group link aside)."""
        return "bf16" if self.pure_bf16 else "fp32"

    @property
    def shards_optimizer_state(self) -> bool:
        """ZeRO-1's optimizer side: states dealt over the replicas (and fp32 masters of the share in bf16/fp16)."""
        return self.zero_stage == 1 and (self.layout.dp * self.layout.cp > 1 or self.config.sharded_master_weights)

    @cached_property
    def secondary_partition(self) -> int:
        """ZeRO++ hpZ: how many ranks a ZeRO-3 unit's parameters stay sharded over between its forward and its
        backward (FSDP2's `reshard_after_forward=<int>`), or 0 where they are re-sharded over the whole sharding
        group as plain ZeRO-3 does. A secondary group as large as the sharding group (dp_shard × cp) or larger is
        that same plain ZeRO-3 (DeepSpeed clamps the size to the world)."""
        size = self.config.zero_hpz_partition_size
        sharded = self.wrapping() is Wrapping.SHARDED and self.zero_stage == 3
        return size if sharded and 1 < size < self.layout.dp_shard * self.layout.cp else 0

    def reshard_after_forward(self, split_backward: bool = False) -> bool | int:
        """FSDP2's `reshard_after_forward` for a unit: ZeRO-3 re-shards after forward (under hpZ only down to its
        secondary group, an int), ZeRO-2 keeps gathered parameters until backward, and so does a schedule that
        splits backward (`split_backward`)."""
        if self.zero_stage != 3 or split_backward:
            return False
        return self.secondary_partition or True

    @cached_property
    def cross_group(self) -> Optional[CrossGroupSettings]:
        """MiCS's cross-group reduction when shardwise runs it: sharded over partition groups of several replicas,
        without a pipeline (whose stages reduce after the schedule, where FSDP2's hybrid sharding does it)."""
        if self.wrapping() is not Wrapping.SHARDED or self.layout.dp_replicate == 1 or self.pipelining:
            return None
        dtype = "bf16" if self.pure_bf16 else self.config.cross_group_reduce_dtype
        return CrossGroupSettings(dtype, self.config.cross_group_overlap)

    @property
    def hybrid_sharding(self) -> bool:
        """Several partition groups reduced by FSDP2's own 2-D hybrid sharding (under a pipeline)."""
        return self.wrapping() is Wrapping.SHARDED and self.layout.dp_replicate > 1 and self.cross_group is None

    @property
    def expert_parallel_degree(self) -> int:
        """Ranks each MoE layer's experts are split over, borrowed from the sharding group (config/experts.py)."""
        return self.config.expert_parallel_degree

    @property
    def expert_parallel(self) -> bool:
        return self.expert_parallel_degree > 1

    @property
    def expert_shards(self) -> int:
        """Ranks ZeRO shards each expert share over: what the sharding group (its cp ranks included) has left
        beside `ep`."""
        return self.layout.dp_shard * self.layout.cp // self.expert_parallel_degree

    @property
    def context_parallel_degree(self) -> int:
        """Ranks every sequence is split over: the layout's cp axis (config/context.py)."""
        return self.layout.cp

    @property
    def context_parallel(self) -> bool:
        return self.layout.cp > 1

    @property
    def context_parallel_mode(self) -> str:
        """'ring' or 'all_to_all' (parallel/context/)."""
        return self.config.context_parallel_mode

    @property
    def offload_optimizer_state(self) -> bool:
        return self.config.offload_optimizer_state and self.zero_stage >= 1

    @property
    def offload_activations(self) -> bool:
        return self.config.offload_activations


def splits_evenly(length: int, ranks: int) -> bool:
    """A sequence of `length` positions is cut into `ranks` equal slices (sequence parallelism's rule, checked by
    the runtime on each input and by the planner on the planned length)."""
    return length % ranks == 0


def cross_group_possible(config: ShardwiseConfig) -> bool:
    """Before the world size is known (checking a config alone): whether any world could run MiCS's own
    cross-group reduction with it (several partition groups need sharded_data_parallel_degree > 1)."""
    return config.sharded_data_parallel_degree > 1 and config.pipeline_parallel_degree == 1
