"""What offloading keeps in host memory and moves per step, as the runtime does.

`offload_optimizer_state` (parallel/sharding/optimizer_offload.py): ZeRO-1 keeps the fp32
masters and the optimizer's moments of each rank's share on the host; once per
step the share's fp32 gradients cross to the host and its updated parameters
(stored dtype) back. ZeRO-2/3 and MiCS run FSDP2's `CPUOffloadPolicy`: parameter
shards, their gradients and the moments stay on the host, every gather copies a
unit's fp32 shards to the device (each microbatch's forward; ZeRO-3's backward
again, the root's included, as shardwise reshards every unit after forward) and
every microbatch's reduce-scatter its fp32 gradient shards back.

`offload_activations` (parallel/recompute/offload.py): each checkpointed region's
kept input goes to the host in forward and back in backward.

A device whose memory is the host's (a CPU) moves nothing: the runtime keeps
everything where it is.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ..config.schema import ShardwiseConfig
from ..topology import Layout
from .activations import region_blocks
from .hardware import DeviceSpec
from .spec import ModelSpec
from .wrapping import FP32_BYTES, compute_bytes, fully_sharded, optimizer_share, sharding_ranks, stored_bytes


class Transfers(NamedTuple):
    """Bytes per rank and step between host and device memory."""

    to_device: float
    to_host: float

    @property
    def total(self) -> float:
        return self.to_device + self.to_host


def moves_to_host(device: Optional[DeviceSpec]) -> bool:
    """Offloading moves anything: the device has memory of its own (no device given: an accelerator)."""
    return device is None or not device.memory_is_host


def host_states(config: ShardwiseConfig, device: Optional[DeviceSpec]) -> tuple[str, ...]:
    """The model-state categories (`model_state_bytes`' keys) kept in host memory: none without sharding."""
    if not (config.offload_optimizer_state and config.effective_zero_stage and moves_to_host(device)):
        return ()
    return ("parameters", "gradients", "optimizer") if fully_sharded(config) else ("optimizer",)


def state_transfers(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, device: Optional[DeviceSpec]) -> Transfers:
    """Bytes the busiest rank moves per step for offloaded optimizer states (none where nothing is offloaded)."""
    if not host_states(config, device):
        return Transfers(0.0, 0.0)
    rank_params = spec.stage_parameters(layout.pp) / layout.tp
    if fully_sharded(config):
        shard = FP32_BYTES * config.microbatches * rank_params / sharding_ranks(layout)
        gathers = 2 if config.effective_zero_stage == 3 else 1
        return Transfers(to_device=gathers * shard, to_host=shard)
    share = rank_params * optimizer_share(spec, config, layout)
    return Transfers(to_device=stored_bytes(config) * share, to_host=FP32_BYTES * share)


def activation_transfers(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int,
                         checkpointing: str, device: Optional[DeviceSpec]) -> Transfers:
    """Bytes the busiest stage moves per step for offloaded activations: every region's kept input (the block
    input of `micro_batch` × `seq` tokens, the rank's 1/cp of them under context parallelism) out in forward and
    back in backward, every microbatch."""
    group = region_blocks(checkpointing, spec.stage_layers(layout.pp))
    if not (config.offload_activations and group and moves_to_host(device)):
        return Transfers(0.0, 0.0)
    regions = config.microbatches * -(-spec.stage_layers(layout.pp) // group)
    kept = regions * micro_batch * seq / layout.cp * spec.hidden * compute_bytes(config)
    return Transfers(to_device=kept, to_host=kept)
