"""Per-rank memory by category for one configuration: what must fit in device memory.

Model states follow the ZeRO paper's accounting and reproduce seed 003 exactly for
a = parameters on the rank and n = the sharding degree:
fp32 DDP 4a + 4a + 8a (+ 4a gradient buckets = 20a); mixed precision 2a + 2a + 8a
+ 4a fp32 master (+ 2a buckets = 18a); ZeRO-1 shards optimizer states and master
copies, ZeRO-2 also gradients, ZeRO-3 also parameters (16a/n). With MiCS, n is the
partition-group size; ZeRO-1 shards over every data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from ..config.schema import ShardwiseConfig
from ..topology import Layout
from . import assumptions as A
from .activations import rank_activations
from .hardware import DeviceSpec, Kernels
from .spec import ModelSpec

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def dtype_bytes(config: ShardwiseConfig) -> int:
    """Bytes per element of parameters, gradients and activations in compute precision."""
    return _DTYPE_BYTES[config.dtype_name]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank. `offloaded` lives in host memory and is not part of `total`."""

    parameters: float
    gradients: float
    optimizer: float
    master_params: float
    activations: float
    comm_buffers: float
    runtime: float
    fragmentation: float
    offloaded: float = 0.0

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.master_params

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "offloaded")

    def summary(self) -> dict[str, float]:
        """The categories reports use: optimizer includes fp32 master copies; other is buffers,
        runtime reserve and the fragmentation margin."""
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer": self.optimizer + self.master_params, "activations": self.activations,
                "other": self.comm_buffers + self.runtime + self.fragmentation, "total": self.total}

    def detail(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def shard_degrees(config: ShardwiseConfig, layout: Layout) -> tuple[int, int, int]:
    """How many ways (parameters, gradients, optimizer states) are split across data-parallel ranks."""
    stage = config.effective_zero_stage
    optimizer = layout.dp if stage == 1 else layout.dp_shard if stage >= 2 else 1
    return (layout.dp_shard if stage == 3 else 1, layout.dp_shard if stage >= 2 else 1, optimizer)


def model_state_bytes(parameters: float, config: ShardwiseConfig, layout: Layout) -> dict[str, float]:
    """Parameters, gradients, optimizer states and master copies for `parameters` on one rank."""
    low = dtype_bytes(config)
    mixed = config.dtype_name != "fp32"
    params_n, grads_n, optim_n = shard_degrees(config, layout)
    return {"parameters": low * parameters / params_n, "gradients": low * parameters / grads_n,
            "optimizer": A.OPTIMIZER_STATE_BYTES * parameters / optim_n,
            "master_params": A.MASTER_COPY_BYTES * parameters / optim_n if mixed else 0.0}


def comm_buffer_bytes(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int) -> float:
    """Buffers collectives need: DDP's bucket copy of every gradient; ZeRO's per-block
    reduce-scatter buffer and (stage 3) two gathered blocks; pipeline send/receive buffers."""
    low = dtype_bytes(config)
    rank_params = spec.stage_parameters(layout.pp) / layout.tp
    block = spec.layer_parameters / layout.tp * low
    stage = config.effective_zero_stage
    if stage == 0:
        buffers = low * rank_params if layout.dp > 1 else 0.0
    else:
        buffers = block + (2 * block if stage == 3 else 0.0)
    if layout.pp > 1:
        buffers += 2 * micro_batch * seq * spec.hidden * low
    return buffers


def in_flight_microbatches(config: ShardwiseConfig, layout: Layout) -> int:
    """Microbatches whose activations stage 0 holds at once: 1F1B keeps pp, capped by active_microbatches."""
    if layout.pp == 1:
        return 1
    return min(config.active_microbatches or layout.pp, config.microbatches)


def predict_memory(spec: ModelSpec, config: ShardwiseConfig, layout: Layout, micro_batch: int, seq: int,
                   checkpointing: str = "none", device: Optional[DeviceSpec] = None) -> MemoryBreakdown:
    """Peak bytes per rank by category, for the busiest pipeline stage.

    `micro_batch` is sequences per microbatch on one rank (tensor-parallel ranks share them).
    `device` supplies kernel facts and the runtime reserve; without it, GPU kernels and no reserve.
    """
    kernels = device.kernels if device else Kernels()
    states = model_state_bytes(spec.stage_parameters(layout.pp) / layout.tp, config, layout)
    acts = rank_activations(spec, seq=seq, micro_batch=micro_batch, dtype_bytes=dtype_bytes(config),
                            tp=layout.tp, pp=layout.pp, in_flight=in_flight_microbatches(config, layout),
                            checkpointing=checkpointing, offload=config.offload_activations,
                            loading_horizon=config.activation_loading_horizon, kernels=kernels)
    buffers = comm_buffer_bytes(spec, config, layout, micro_batch, seq)
    accounted = sum(states.values()) + acts.device + buffers
    return MemoryBreakdown(**states, activations=acts.device, comm_buffers=buffers,
                           runtime=device.runtime_reserve_bytes if device else 0.0,
                           fragmentation=A.FRAGMENTATION_MARGIN * accounted, offloaded=acts.host)
