"""The one config tree, with SageMaker model-parallel (SMP) key names.

Field rules that need no cluster live here; rules that need the cluster shape
live in `validate.py`. Keys whose feature is not built yet are accepted and
validated here and refused by `unavailable_features` when a run starts. SMP's
keys without a counterpart here come from `smp_only.py`; SMP's other spellings
(`partitions`, `pipeline`, 0/1 booleans, ...) are translated by `smp_forms.py`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from .blocks import OPTIMIZER_PARAMS, SCHEDULER_PARAMS, OptimizerBlock, SchedulerBlock  # noqa: F401 (re-exported)
from .smp_only import SmpOnlySettings

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # pipeline schedules that run one stage per rank
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble")  # backward as input, then weight, pass
PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}  # SMP's names for two orders of the letters D, P, T


class DynamicLossArgs(BaseModel):
    """SMP's `dynamic_loss_args` of DistributedOptimizer (unset ones keep its defaults)."""

    model_config = ConfigDict(extra="forbid")
    init_scale: Optional[float] = Field(None, gt=0)
    scale_factor: Optional[float] = Field(None, gt=1)
    scale_window: Optional[int] = Field(None, ge=1)
    min_scale: Optional[float] = Field(None, ge=0)
    delayed_shift: Optional[int] = Field(None, ge=1)
    consecutive_hysteresis: Optional[bool] = None


class ShardwiseConfig(SmpOnlySettings):
    """Validated settings. Defaults give pure data parallelism in fp32."""

    ddp: bool = Field(True, description="Synchronise gradients over data-parallel ranks (SMP: ddp).")
    sharded_data_parallel_degree: int = Field(
        1,
        ge=1,
        description="Partition-group size for sharded data parallelism. Equal to the data-parallel "
        "degree: classic ZeRO; smaller: MiCS / ZeRO-2D (sharded inside groups, replicated across). "
        "1 = off unless zero_stage asks for sharding.",
    )
    zero_stage: Optional[Literal[0, 1, 2, 3]] = Field(
        None,
        description="ZeRO stage: 0 plain DDP, 1 optimizer state, 2 + gradients, 3 + parameters. "
        "Unset: 1 if shard_optimizer_state, 3 if sharded_data_parallel_degree > 1, else 0.",
    )
    cross_group_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="MiCS: the dtype of the gradient all-reduce across partition groups. bf16 halves its "
        "bytes; the reduce-scatter inside a group, the master weights and the optimizer stay fp32.")
    cross_group_overlap: Literal["backward", "forward"] = Field(
        "backward", description="MiCS: what the gradient all-reduce across partition groups overlaps. 'backward': "
        "the backward pass, which waits for it at its end. 'forward': also optimizer.step() and the next forward, "
        "which waits for each unit's shard where it reaches the unit; each shard is stepped as it lands, sent in "
        "the order the next forward needs them. Gradients are final in step() (or after optimizer.synchronize(), "
        "which model.parameters() calls), parameters after optimizer.synchronize(), as under ZeRO-1.")
    zero_hpz_partition_size: int = Field(
        1, ge=1, description="ZeRO++ hpZ (DeepSpeed's name), ZeRO-3 only: after a unit's forward its parameters stay "
        "sharded over a secondary group of this many ranks inside a node, so backward all-gathers them there instead "
        "of over the whole sharding group; costs parameters / this size per rank in the compute dtype from forward "
        "to backward. 1 = off; must divide the sharding group and the ranks per node; the whole sharding group or "
        "more is plain ZeRO-3.")
    shard_optimizer_state: bool = Field(False, description="ZeRO-1: shard optimizer states over data-parallel ranks.")
    tensor_parallel_degree: int = Field(1, ge=1, description="Ranks inside a node that split each layer.")
    expert_parallel_degree: int = Field(
        1, ge=1, description="Mixture of experts (SMP v2's name): ranks each MoE layer's experts are split over, "
        "borrowed from the sharding group (dp_shard); tokens reach their experts by all-to-all. Must divide the "
        "sharding group and the model's number of experts. 1 = off.")
    sequence_parallel: bool = Field(False, description="With tensor parallelism, shard the activations between the "
                                    "split layers (norms, dropouts, residual stream) over the sequence.")
    sequence_parallel_regather: bool = Field(
        False, description="With sequence_parallel (Megatron-LM's way): keep only this rank's sequence shard of each "
        "input a column-parallel layer gathers, and gather it again in backward. The norms' outputs then cost 1/tp "
        "of their memory, for one more all-gather per column-parallel input in backward, each started before backward "
        "needs it. Off: torch keeps the gathered inputs whole.")
    context_parallel_degree: int = Field(
        1, ge=1, description="Context parallelism (SMP v2's and torchtitan's name): ranks every sequence is split over "
        "(a mesh axis cp between tp and the data-parallel axes), in load-balanced chunks; attention reaches the "
        "rest of the sequence by context_parallel_mode. Must divide world / (tp x pp), half the sequence length, "
        "and under all_to_all the attention heads. 1 = off.")
    context_parallel_mode: Literal["ring", "all_to_all"] = Field(
        "ring", description="How attention sees the whole sequence under context parallelism: 'ring' passes key/value "
        "blocks around the cp ranks (overlapping each block's attention); 'all_to_all' (Ulysses) trades the sequence "
        "split for a head split around attention (heads must divide by the degree).")
    pipeline_parallel_degree: int = Field(1, ge=1, description="Pipeline stages (across nodes).")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"] = Field(
        "1f1b", description="Pipeline schedule (torch.distributed.pipelining); interleaved and zero-bubble ones "
        "run virtual_stages stages per rank.")
    virtual_stages: Optional[int] = Field(None, ge=1, description="Pipeline stages per rank: 1 for gpipe/1f1b, "
                                          "1 or more for interleaved schedules, 2 for zbv_zero_bubble. Unset: 1 for "
                                          "gpipe/1f1b, else 2.")
    pipeline_balance: Literal["parameters", "compute"] = Field(
        "parameters", description="What the automatic stage split balances: parameter count, or matmul compute "
        "(embedding lookups count as free).")
    pipeline_split_points: Optional[list[int]] = Field(
        None, description="Manual stage split: the first block index of every stage but the first.")
    pipeline_cut: Literal["auto", "blocks", "graph"] = Field(
        "auto", description="Where the pipeline cuts: 'blocks' along the model's list of repeated blocks, 'graph' at "
        "module boundaries of the forward torch captures at the first @step, 'auto' blocks when the model has them.")
    microbatches: int = Field(1, ge=1, description="Microbatches each @step batch is split into.")
    active_microbatches: Optional[int] = Field(
        None, ge=1, description="Most microbatches in flight in the pipeline. Unset: pipeline_parallel_degree + 2 "
        "(SMP's default); never more than microbatches.")
    prescaled_batch: bool = Field(False, description="Ranks of a tensor-parallel group share one tp_size-times larger batch.")
    offload_activations: bool = Field(False, description="Keep the inputs of activation-checkpointed regions in "
                                      "host memory between forward and backward (nothing moves on a CPU device).")
    activation_loading_horizon: int = Field(4, ge=0, description="With offload_activations: when backward reaches "
                                            "a region, the regions before it whose inputs are fetched back too.")
    offload_optimizer_state: bool = Field(
        False, description="Keep what the optimizer steps in host memory and step it there: under ZeRO-1 the fp32 "
        "masters and states of each rank's share; under ZeRO-2/3 and MiCS FSDP2's parameter shards, their gradients "
        "and the states (CPUOffloadPolicy). On a CPU device nothing moves.")
    delayed_parameter_initialization: bool = Field(
        False, description="sw.delay_param_initialization() builds the model on the meta device; DistributedModel "
        "materialises only what this rank runs (its pipeline stages).")
    bf16: bool = Field(False, description="bfloat16 compute, fp32 master weights and gradient reduction.")
    bf16_master_weights_and_grads: bool = Field(
        False, description="With bf16: pure bf16 (DeepSpeed's bf16.bf16_master_weights_and_grads, MosaicML's PURE): "
        "parameters, gradients and their reduction in bf16, no fp32 master; the optimizer keeps its states in the "
        "parameters' dtype. Half the bytes of parameters, gradients and reductions, at an accuracy cost "
        "(docs/precision.md).")
    accumulate_gradients_locally: bool = Field(
        False, description="ZeRO-1 in bf16/fp16 (fp32 masters): add each microbatch's gradients into fp32 buffers "
        "of the whole model on every rank (4 bytes a parameter while a step runs) and reduce them to their owners "
        "once a step, during the last microbatch's backward, as Megatron-LM's distributed optimizer and DeepSpeed's "
        "BF16_Optimizer (data_types.grad_accum_dtype: fp32) do. Off: every microbatch's gradients are reduced in "
        "its backward and add up on the owner.")
    fp16: bool = Field(False, description="float16 compute with dynamic loss scaling, fp32 master weights and "
                       "gradient reduction.")
    fp16_params: bool = Field(False, description="SMP's earlier spelling of fp16 (parameters of distributed modules "
                              "in fp16): true turns fp16 on.")
    loss_scale: float = Field(0.0, ge=0, description="fp16: the scale of every DistributedOptimizer not given "
                              "SMP's loss-scale arguments: 0 scales the loss dynamically (by dynamic_loss_args), a "
                              "number > 0 keeps that scale fixed (DeepSpeed's fp16.loss_scale).")
    dynamic_loss_args: Optional[DynamicLossArgs] = Field(
        None, description="fp16 with loss_scale 0: the dynamic_loss_args of those optimizers (init_scale, "
        "scale_factor, scale_window, min_scale, delayed_shift, consecutive_hysteresis).")
    train_batch_size: Optional[int] = Field(
        None, ge=1, description="Samples per optimizer step over all data-parallel ranks (DeepSpeed's) = "
        "train_micro_batch_size_per_gpu x microbatches x data-parallel degree; the one of the three left out is worked "
        "out from the others; sw.configured_batch_size() gives each rank's @step batch.")
    train_micro_batch_size_per_gpu: Optional[int] = Field(
        None, ge=1, description="Samples per microbatch on each data-parallel rank (DeepSpeed's).")
    optimizer: Optional[OptimizerBlock] = Field(
        None, description="{type: Adam|AdamW|Lamb|Adagrad|SGD, params: {...}} with DeepSpeed's names (its own in any "
        "case) and defaults: the optimizer sw.configured_optimizer(model) builds and wraps in a DistributedOptimizer.")
    scheduler: Optional[SchedulerBlock] = Field(
        None, description="{type: WarmupLR|WarmupDecayLR|OneCycle, params: {...}} with DeepSpeed's names and "
        "semantics: the schedule sw.configured_scheduler(optimizer) builds.")
    gradient_clipping: Optional[float] = Field(None, gt=0, description="Global gradient-norm clip applied by optimizer.step().")
    sdp_gradient_clipping: Optional[float] = Field(
        None, ge=0, description="SMP: the gradient-norm clip of sharded data parallelism; with "
        "sharded_data_parallel_degree > 1 it sets gradient_clipping (0: no clipping). Unlike SMP, unset means no "
        "clipping rather than 1.0.")
    replica_check_interval: Optional[int] = Field(
        None, ge=1, description="Every N optimizer steps, compare a fingerprint of every replicated parameter across "
        "the ranks that should hold equal copies, and stop with an error naming the first that differs. Unset: off.")
    non_finite_gradients: Literal["off", "skip", "stop"] = Field(
        "off", description="What optimizer.step() does when a gradient holds inf/nan, in fp32 and bf16 (fp16's loss "
        "scaler always skips such steps and lowers the scale): 'skip' the step, 'stop' with an error naming the step "
        "and the first such parameter, or 'off' (no check). Free when the step clips; else one scalar all-reduce.")
    non_finite_stop_after: int = Field(
        1, ge=1, description="With non_finite_gradients stop: stop at the K-th non-finite step in a row; the ones "
        "before it are skipped.")
    control_flow_check_interval: Optional[int] = Field(
        None, ge=1, description="Every N calls of a @step function, the ranks all-gather its call count, its "
        "microbatches and model forward calls and their optimizer steps, and stop with an error naming the ranks "
        "that differ. Unset: off.")
    collective_timeout_seconds: float = Field(
        300, gt=0, description="How long a rank waits in a collective (of the world and every group shardwise makes) "
        "before it stops with a report naming the collective, its group and sequence number and the ranks that "
        "never joined it.")
    # Observability (observe/): what the runtime records each step and where it writes it.
    metrics_interval: int = Field(
        1, ge=0, description="Record metrics every N optimizer steps (0: off). Cheap ones (loss, step time, "
        "throughput, lr, grad norm, loss scale, skipped steps, memory) always; the costly ones by their own keys.")
    steps_per_print: Optional[int] = Field(
        None, ge=1, description="DeepSpeed's: every N optimizer steps the DeepSpeed engine (shardwise.deepspeed) "
        "prints its console progress line. It throttles that line only; what is recorded, and how often, is "
        "metrics_interval's. Unset: no progress line, as in DeepSpeed 0.19 (earlier releases printed every 10).")
    metrics_sinks: list[Literal["csv", "tensorboard", "wandb"]] = Field(
        [], description="Where rank 0 writes the global metrics besides global.jsonl: "
        "metrics.csv, TensorBoard event files under <metrics dir>/tensorboard, Weights & Biases (when installed).")
    metrics_dir: Optional[str] = Field(
        None, description="Directory of the metrics files. Unset: <run dir>/metrics under shardwise run, else no "
        "files (sw.metrics.latest() still answers).")
    wall_clock_breakdown: bool = Field(
        False, description="Split each recorded step's time into forward, backward, optimizer, data wait, exposed "
        "communication and other; synchronises the device at phase boundaries and watches every op.")
    comms_logger: bool = Field(
        False, description="Log every collective of a recorded step per process group: count, bytes, time, "
        "algorithmic and bus bandwidth (rank<R>.jsonl).")
    flops_profiler: bool = Field(
        False, description="Count the FLOPs of the first recorded step (FlopCounterMode) and report FLOPs, TFLOP/s "
        "and MFU per recorded step.")
    peak_tflops: Optional[float] = Field(
        None, gt=0, description="Peak TFLOP/s of one device, for MFU (with flops_profiler).")
    progress_bar: bool = Field(False, description="A progress bar on rank 0 (rich; plain lines when stdout is not "
                               "a terminal): step, loss, step time, throughput, ETA.")
    wandb_project: Optional[str] = Field(None, description="The Weights & Biases project of the wandb sink.")
    checkpoint_dir: Optional[str] = Field(
        None, description="Where the job's checkpoints go: a preempted job (SIGTERM) saves there at the next step "
        "boundary, and a script resumes from its newest complete checkpoint after a restart (`shardwise run "
        "--checkpoint-dir` sets it). Unset: SIGTERM stops the ranks without saving.")
    preemption_grace_seconds: float = Field(
        30, gt=0, description="After SIGTERM, how long the ranks have to reach a step boundary and save to "
        "checkpoint_dir before they stop without saving; `shardwise run` waits this long (plus a margin) before "
        "it kills them.")
    auto_wrap_min_params: int = Field(
        10_000_000,
        ge=1,
        description="Sharding unit size for models without known transformer blocks (parameters per unit).",
    )
    placement_strategy: Literal["cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TPD", "TDP"] = Field(
        "cluster", description="SMP: the order in which global ranks walk the parallel axes, outermost letter first: "
        "D data parallel, P pipeline, T tensor parallel. 'cluster' is DPT (a replica on neighbouring ranks), "
        "'spread' TPD.")
    optimize: Literal["memory", "speed"] = Field(
        "memory", description="SMP: how its distributed transformer splits layers; here sequence_parallel chooses "
        "(memory) or not (speed).")
    auto_partition: bool = Field(True, description="SMP: cut the pipeline automatically; false places every module "
                                 "not placed by hand on default_partition.")
    default_partition: int = Field(0, ge=0, description="SMP: the pipeline stage of modules not placed by hand when "
                                   "auto_partition is false.")
    memory_weight: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="SMP: weight of memory against compute in the automatic pipeline cut. "
        "Unset: 0.2 with optimize=speed, else 0.8.")
    skip_tracing: bool = Field(False, description="SMP: skip the tracing step; shardwise never traces.")
    deterministic_server: bool = Field(False, description="SMP: run pipeline requests in the same order on every "
                                       "data-parallel rank; shardwise's schedules always do.")

    @property
    def effective_zero_stage(self) -> int:
        if self.zero_stage is not None:
            return self.zero_stage
        if self.shard_optimizer_state:
            return 1
        return 3 if self.sharded_data_parallel_degree > 1 else 0

    @property
    def effective_memory_weight(self) -> float:
        """The module-graph pipeline cut's weight of memory against compute: given, or SMP's by `optimize`."""
        if self.memory_weight is not None:
            return self.memory_weight
        return 0.8 if self.optimize == "memory" else 0.2

    @property
    def stages_per_rank(self) -> int:
        """`virtual_stages`, or its default for the schedule."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 1 if self.pipeline_schedule in SINGLE_STAGE_SCHEDULES else 2

    @property
    def effective_active_microbatches(self) -> int:
        """SMP's active_microbatches: given or pipeline_parallel_degree + 2, capped by the microbatch count."""
        return min(self.active_microbatches or self.pipeline_parallel_degree + 2, self.microbatches)

    @property
    def pipeline_round(self) -> int:
        """Microbatches the pipeline schedule runs at once. `active_microbatches` bounds those in flight; 1f1b
        never has more than pipeline_parallel_degree in flight anyway. Unset, SMP's bound (pp + 2) matters to
        gpipe alone, which holds its whole round: its round is the largest that divides the microbatches; the
        other schedules bound what is in flight themselves and take every microbatch in one round."""
        m, pp, active = self.microbatches, self.pipeline_parallel_degree, self.effective_active_microbatches
        if self.pipeline_schedule == "1f1b" and active >= pp:
            return m
        if self.active_microbatches is not None:
            return active
        if self.pipeline_schedule != "gpipe":
            return m
        return max(r for r in range(1, active + 1) if m % r == 0)

    @property
    def placement(self) -> str:
        """`placement_strategy` as letters, outermost first."""
        return PLACEMENTS.get(self.placement_strategy, self.placement_strategy)

    @property
    def sharded_master_weights(self) -> bool:
        """ZeRO-1 in bf16/fp16: replicas keep parameters and gradients in the compute dtype, and each rank
        fp32 master copies of only its share (parallel/zero1/master_weights.py; the planner models the same). With
        offload_optimizer_state in fp32 too: the masters are what goes to host memory."""
        return self.effective_zero_stage == 1 and (self.dtype_name != "fp32" and not self.pure_bf16
                                                   or self.offload_optimizer_state)

    @property
    def pure_bf16(self) -> bool:
        """bf16 parameters, gradients, reductions and optimizer states: no fp32 master anywhere."""
        return self.bf16 and self.bf16_master_weights_and_grads

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


def field_names() -> list[str]:
    """The keys a config may hold (SMP's internal keys by their `_` names)."""
    return [field.alias or name for name, field in ShardwiseConfig.model_fields.items()]


def unavailable_features(config: ShardwiseConfig) -> list[tuple[str, object]]:
    """(key, value) of settings whose feature this release cannot run yet: none at present."""
    pending: dict[str, bool] = {}
    return [(key, getattr(config, key)) for key, used in pending.items() if used]
