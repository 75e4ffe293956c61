"""What `offload_optimizer_state` keeps in host memory and moves per step, as parallel/optimizer_offload.py does.

ZeRO-1 keeps the fp32 masters and the optimizer's moments of each rank's share on
the host; once per step the share's fp32 gradients cross to the host and its
updated parameters (stored dtype) back. ZeRO-2/3 and MiCS run FSDP2's
`CPUOffloadPolicy`: parameter shards, their gradients and the moments stay on
the host, every gather copies a unit's fp32 shards to the device (each
microbatch's forward; ZeRO-3's backward again) and every microbatch's
reduce-scatter its fp32 gradient shards back. A device whose memory is the
host's (a CPU) moves nothing, and the runtime keeps everything where it is.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ..config.schema import ShardwiseConfig
from ..topology import Layout
from .hardware import DeviceSpec
from .spec import ModelSpec
from .wrapping import FP32_BYTES, fully_sharded, optimizer_share, stored_bytes


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
        shard, m = FP32_BYTES * rank_params / layout.dp_shard, config.microbatches
        gathers = 2 if config.effective_zero_stage == 3 else 1
        return Transfers(to_device=gathers * m * shard, to_host=m * shard)
    share = rank_params * optimizer_share(spec, config, layout)
    return Transfers(to_device=stored_bytes(config) * share, to_host=FP32_BYTES * share)
