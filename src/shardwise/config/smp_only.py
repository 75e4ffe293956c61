"""SMP v1's config keys that have no counterpart here, with SMP's types and defaults.

A script ported from SMP passes them (SageMaker's notebooks and example scripts
set most of them, the internal `_`-prefixed ones too), so they are validated as
SMP validated them and never refused as unknown. Set away from SMP's default,
each is named at `init` with what shardwise does instead (`config/effects.py`);
keys whose SMP behaviour shardwise always has (`skip_tracing: true`: it never
traces) are not named.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

_DATA_PARALLEL = "gradients are synchronised with torch.distributed, as ddp does"
_OWN_CUT = "TensorFlow-only; shardwise cuts the pipeline by pipeline_balance or pipeline_split_points"

# What shardwise does instead of each key, named when the key is set away from its default.
INSTEAD = {
    "horovod": _DATA_PARALLEL,
    "herring": _DATA_PARALLEL,
    "contiguous": "pipeline stages are always contiguous runs of blocks",
    "load_partition": _OWN_CUT,
    "partition_file": _OWN_CUT,
    "ddp_port": "ranks meet on the launcher's port: shardwise run --master-port, or MASTER_PORT",
    "ddp_dist_backend": "the backend follows the device: NCCL on CUDA, gloo on CPU",
    "tensor_parallel_seed": "tensor-parallel modules draw from torch's generator, seeded by torch.manual_seed",
    "checkpoint_attentions": "checkpoint modules with sw.set_activation_checkpointing",
    "fp32_grad_accumulation": "fp16 keeps fp32 master weights and reduces gradients in fp32",
    "sharded_data_parallelism_config": "sharding follows sharded_data_parallel_degree and zero_stage; "
                                       "DeepSpeed configs are not read",
    "overlapping_allreduce": "gradients are always reduced while backward runs; they come out the same",
}

# Keys of sharded data parallelism and what FSDP2, which shards here, does instead.
SHARDING_INSTEAD = {
    "sdp_reduce_bucket_size": "FSDP2 reduce-scatters each sharding unit's gradients at once",
    "sdp_param_persistence_threshold": "FSDP2 shards every parameter of a sharding unit",
    "sdp_max_live_parameters": "FSDP2 gathers one sharding unit ahead of the one running",
    "sdp_hierarchical_allgather": "torch's collectives choose how an all-gather crosses nodes",
}

# Keys that pace SMP's activation offloading, and what shardwise's offloading does instead.
OFFLOAD_PACING = {
    "shard_offloaded_activations": "every tensor-parallel rank offloads the inputs its own checkpointed regions keep",
    "task_level_activation_loading_horizon": "activation_loading_horizon paces the prefetch",
}


class SmpOnlySettings(BaseModel):
    """The SMP v1 keys above; SMP's internal keys keep their leading `_` as aliases."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, serialize_by_alias=True)

    horovod: bool = Field(False, description="SMP (TensorFlow): Horovod synchronises gradients.")
    herring: bool = Field(False, description="SMP (internal): another data-parallel backend.")
    contiguous: bool = Field(True, description="SMP (TensorFlow): partitions are connected subgraphs.")
    load_partition: bool = Field(False, description="SMP (TensorFlow, internal): load a saved partition.")
    partition_file: Optional[str] = Field(None, description="SMP (TensorFlow, internal): the saved partition.")
    ddp_port: Optional[int] = Field(None, ge=0, description="SMP: the port DDP's process group meets on.")
    ddp_dist_backend: Literal["auto", "nccl"] = Field("auto", description="SMP: DDP's backend.")
    tensor_parallel_seed: int = Field(0, ge=0, description="SMP: seed of the random ops of tensor-parallel modules.")
    fast_mode: bool = Field(False, description="SMP (internal): stage-to-stage sends; shardwise's schedules do.")
    static_mode: bool = Field(False, description="SMP (internal): a fixed pipeline order; shardwise's schedules are.")
    checkpoint_attentions: bool = Field(False, description="SMP (internal): recompute attention scores.")
    match_weights: bool = Field(False, alias="_match_weights", description="SMP (internal): copy the original "
                                "weights into distributed modules; shardwise's always start from them.")
    fp32_grad_accumulation: bool = Field(False, alias="_fp32_grad_accumulation",
                                         description="SMP (internal): accumulate fp16 gradients in fp32.")
    sharded_data_parallelism_config: Optional[str] = Field(
        None, alias="_sharded_data_parallelism_config", description="SMP (internal): a DeepSpeed ZeRO config file.")
    shard_offloaded_activations: bool = Field(True, alias="_shard_offloaded_activations",
                                              description="SMP (internal): one tp rank offloads shared activations.")
    task_level_activation_loading_horizon: int = Field(4, ge=1, description="SMP (internal): offload loading tasks "
                                                       "queued ahead.")
    overlapping_allreduce: bool = Field(True, description="SMP: overlap the gradient all-reduce with backward "
                                        "(documented as a DistributedModel argument; SMP's BERT notebook passes it in "
                                        "the config).")
    sdp_reduce_bucket_size: int = Field(500_000_000, ge=1, description="SMP: elements per gradient reduction "
                                        "bucket under sharded data parallelism.")
    sdp_param_persistence_threshold: int = Field(1_000_000, ge=0, description="SMP: parameters up to this size "
                                                 "stay unsharded.")
    sdp_max_live_parameters: int = Field(1_000_000_000, ge=1, description="SMP: most gathered parameters alive at "
                                         "once.")
    sdp_hierarchical_allgather: bool = Field(True, description="SMP: gather parameters inside nodes first.")
