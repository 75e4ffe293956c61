"""Every top-level key DeepSpeed reads, and how shardwise takes the ones it does not translate into its own.

Built from DeepSpeed 0.19.8's config (runtime/config.py, runtime/constants.py and
the sections it hands to sub-configs: zero, activation_checkpointing, monitor,
comm, profiling, autotuning, compile, data_pipeline, swap_tensor (aio),
model_checkpointing, tensor_parallel, datastates, utils (timers), inference
(weight_quantization), module_inject (expert_parallel)), and the keys of earlier
releases that 0.19 removed and now refuses. A key found nowhere here, nor among
shardwise's own keys, is an unknown key (an error with the closest name).
Pure: no torch.
"""

from __future__ import annotations

# Translated into shardwise keys (sections.py, zero.py).
TRANSLATED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
              "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "gradient_clipping", "steps_per_print",
              "wall_clock_breakdown", "flops_profiler", "comms_logger", "tensorboard", "csv_monitor", "wandb",
              "activation_checkpointing", "tensor_parallel", "autotuning", "data_types")

_REDUCED = "gradients are averaged over the data-parallel ranks by one reduction per bucket or sharding unit, in fp32"

# Honoured because shardwise always does what this value asks: (the value, what shardwise does). Another value is
# listed as not honoured.
ALWAYS = {
    "zero_allow_untested_optimizer": (True, "any torch optimizer works under every ZeRO stage"),
    "prescale_gradients": (False, _REDUCED),
    "gradient_predivide_factor": (1.0, _REDUCED),
    "gradient_allreduce_op": ("mean", _REDUCED),
    "communication_data_type": ("fp32", "gradients are reduced in fp32 (MiCS's all-reduce across partition groups "
                                "can be bf16: cross_group_reduce_dtype)"),
    "disable_allgather": (False, "each ZeRO stage gathers parameters with the collectives shardwise chooses for it"),
    "managed_gradient_accumulation": (True, "@step splits each batch into gradient_accumulation_steps microbatches "
                                            "and the optimizer steps once after them"),
}

# Honoured, in another way than DeepSpeed's: how.
DIFFERENTLY = {
    "dataloader_drop_last": "read by the DeepSpeed engine's loader (deepspeed_io), which drops the last partial "
                            "batch when true, as DeepSpeed's; scripts on sw.data_loader pass drop_last themselves",
    "zero_force_ds_cpu_optimizer": "there is no DeepSpeed CPU Adam: under offload_optimizer_state the host steps "
                                   "the torch optimizer the config or the script builds, with the same update",
}

_RECORDED = "shardwise records step time and throughput in its metrics (metrics_interval)"
_NO_ULYSSES = ("DeepSpeed-Ulysses sequence parallelism (attention heads exchanged all-to-all) is not built; "
               "sequence_parallel shards activations between tensor-parallel layers instead")
_CHECKPOINTS = ("shardwise writes its own sharded checkpoints (checkpoint_dir, sw.save_checkpoint) with "
                "torch.distributed.checkpoint, resharded on load to any layout")

# Not honoured: why, and what shardwise does instead.
NOT_HONOURED = {
    "amp": "NVIDIA apex AMP is not used; set bf16 or fp16 instead (DeepSpeed 0.19 refuses the key too)",
    "pipeline": "pipelines come from pipeline_parallel_degree with sw.DistributedModel; checkpoint stages with "
                "sw.set_activation_checkpointing",
    "memory_breakdown": "`shardwise plan` predicts memory by category, and the metrics record it per step",
    "dump_state": "the validated config is written to the run directory's config.json",
    "checkpoint": _CHECKPOINTS,
    "datastates_ckpt": _CHECKPOINTS,
    "torch_autocast": "DeepSpeed's autocast mode is not built; set bf16 or fp16 (fp32 master weights, the model "
                      "computing in the half dtype)",
    "compile": "DeepCompile's passes are not built; compile the model with torch.compile in the script",
    "timers": _RECORDED,
    "aio": "NVMe offload is not built: offload goes to host memory",
    "data_efficiency": "curriculum learning and random-LTD are not built; order and sample the data in the script",
    "hybrid_engine": "DeepSpeed-Chat's switch between generation and training is not built",
    "weight_quantization": "quantized weights are not built; parameters keep the training dtype",
    "expert_parallel": "DeepSpeed's AutoEP is not built",
    "use_data_before_expert_parallelism": "DeepSpeed's expert-parallel rank order is not built",
    "seq_parallel_communication_data_type": _NO_ULYSSES,
    "sequence_parallel_size": _NO_ULYSSES,
    "disable_python_gc": "Python's garbage collector is left as it is",
    "vocabulary_size": "DeepSpeed only warns when it is not a multiple of 8 (tensor-core alignment)",
    "log_level": "DeepSpeed's logger level; shardwise logs through Python's logging and warnings",
    "comet": "there is no Comet sink; metrics_sinks are csv, tensorboard and wandb",
}

_REMOVED = "removed from DeepSpeed (0.19 refuses the key)"
# Keys of earlier DeepSpeed releases that 0.19 refuses: what they did, and what shardwise does.
REMOVED = {
    "sparse_gradients": f"{_REMOVED}; gradients are reduced dense",
    "sparse_attention": f"{_REMOVED}; attention runs as the model computes it",
    "elasticity": f"{_REMOVED}; shardwise restarts failed ranks with `shardwise run --max-restarts` and resumes "
                  "from checkpoint_dir at any world size",
    "nebula": f"{_REMOVED}; {_CHECKPOINTS}",
    "compression_training": f"{_REMOVED}; the model trains unquantized",
    "quantize_training": f"{_REMOVED}; the model trains unquantized",
    "eigenvalue": f"{_REMOVED}; the model trains unquantized",
    "graph_harvesting": f"{_REMOVED}; no CUDA-graph capture",
    "curriculum_learning": f"{_REMOVED}; order the data in the script",
    "progressive_layer_drop": f"{_REMOVED}; every layer runs every step",
}

TOP_LEVEL = (*TRANSLATED, *ALWAYS, *DIFFERENTLY, *NOT_HONOURED, *REMOVED)

# The values DeepSpeed accepts for some of these (in any case); it refuses others.
CHOICES = {"communication_data_type": ("fp16", "bf16", "fp32"),
           "seq_parallel_communication_data_type": ("fp16", "bf16", "fp32"),
           "gradient_allreduce_op": ("mean", "sum")}
# Values that would train another model than DeepSpeed's if listed and run: refused, with the fix.
REFUSED_VALUES = {("gradient_allreduce_op", "sum"): (
    "sums gradients over the data-parallel ranks, and shardwise averages them (a different update)",
    "use mean, and scale the learning rate by the data-parallel degree if the summed update is wanted")}

# Keys of the sections DeepSpeed validates strictly (its pydantic models forbid others).
FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "check_overflow",
             "bf16_master_weights_and_grads", "bf16_optimizer_states")
MONITOR_KEYS = {"tensorboard": ("enabled", "output_path", "job_name"),
                "csv_monitor": ("enabled", "output_path", "job_name"),
                "wandb": ("enabled", "group", "team", "project"),
                "comet": ("enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
                          "experiment_key", "online", "mode")}
COMMS_LOGGER_KEYS = ("enabled", "prof_all", "prof_ops", "verbose", "debug")
