"""`Trainer`: Hugging Face's Trainer on shardwise's core, every layout with the same math as one process.

The Trainer keeps its loop, its data, its logging, callbacks, evaluation and checkpoint folders; what shardwise
does instead of accelerate is the model's parallelism, the optimizer's step, clipping and the checkpoint's
model and optimizer state:

- the runtime starts when the Trainer makes its accelerator (runtime.py), from the config `shardwise run` was
  given or `TrainingArguments(deepspeed=...)`, and accelerate is told the world it runs in;
- the model becomes a `DistributedModel` the first time the Trainer needs it wrapped (its optimizer is built
  over the wrapped model's parameters: ZeRO-3's shards); `trainer.model` stays the user's module and
  `trainer.model_wrapped` is the `DistributedModel`;
- each accumulation micro-step runs inside the model's `microbatch_context`, reducing gradients only at the
  Trainer's accumulation boundary (a pipeline runs it through its schedule, pipeline.py); the loss and its
  normalisation (`num_items_in_batch`) are the Trainer's own;
- where a model replica spans several ranks (tensor or pipeline parallelism) the batches are dealt to the
  replicas and evaluation keeps one copy of each replica's results (replicas.py);
- clipping is the optimizer step's, by the global norm of every shard and stage (`gradient_clipping`, which
  the runtime holds as `max_grad_norm`), and the norm the Trainer logs is that one;
- a checkpoint folder holds the Trainer's files (weights `from_pretrained` loads, trainer state, RNG states)
  and a shardwise checkpoint (`shardwise/`: model, optimizer, loss scale and schedule, any layout resumes it).

The private Trainer methods overridden here are listed, with why, in internals.py.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from ..api.configured import _torch_optimizer, build_scheduler
from ..api.model import DistributedModel
from ..api.optimizer import DistributedOptimizer
from ..checkpoint.directory import complete_tags
from ..checkpoint.resume import resume_from_checkpoint
from ..checkpoint.save import save_checkpoint
from ..observe.recorder import recorder_for
from ..runtime import state
from ..runtime.init import warn_ineffective
from ..torch_internals import tree_map_only
from . import pipeline, replicas
from .runtime import DeepSpeedPlan, adopt_world, start_runtime

CHECKPOINT_TAG = "shardwise"  # the shardwise checkpoint inside a Trainer's checkpoint folder
TRAINER_STATE = "trainer_state.json"  # written last into a checkpoint folder: a folder holding it is complete


class _TrainerOptimizer(DistributedOptimizer):
    """The Trainer's optimizer: a DistributedOptimizer that says, as accelerate's do, whether its last step was
    skipped (an fp16 overflow: the Trainer then leaves the schedule), and hands the norm it clipped by to the
    tensor the Trainer logs."""

    _norm_out: Optional[torch.Tensor] = None

    @property
    def step_was_skipped(self) -> bool:
        return self.overflow

    def norm_to_log(self) -> torch.Tensor:
        """A tensor the coming step fills with the global gradient norm (the Trainer reads it after the step)."""
        if state.current().config.gradient_clipping is None:
            self.clip_master_grads(float("inf"))  # no clip: the step still measures the norm (scaling by 1 is exact)
        self._norm_out = torch.full((), float("nan"))
        return self._norm_out

    def step(self, closure: Any = None) -> Any:
        result = super().step(closure)
        if self._norm_out is not None and self.grad_norm is not None:
            self._norm_out.fill_(float(self.grad_norm))
        self._norm_out = None
        return result


class _ScaledBackward:
    """Stands in for accelerate's fp16 GradScaler in `accelerator.backward`: shardwise's loss scale, the one
    its optimizer step unscales by."""

    def __init__(self, model: DistributedModel):
        self.model = model

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.model.scaled_loss(loss)


def _refused(args: transformers.TrainingArguments) -> list[str]:
    refused = []
    if args.fsdp:
        refused.append("TrainingArguments(fsdp=...) asks accelerate to shard the model, and shardwise shards it by "
                       "its config; drop fsdp and set the sharding in the shardwise config (zero_stage, "
                       "sharded_data_parallel_degree) or the DeepSpeed config")
    if args.auto_find_batch_size:
        refused.append("TrainingArguments(auto_find_batch_size=True) rebuilds the model after an out-of-memory "
                       "error, and a shardwise model is placed once; run `shardwise plan` to choose the batch size")
    if getattr(args, "parallelism_config", None) is not None:
        refused.append("TrainingArguments(parallelism_config=...) is accelerate's layout; set the layout in the "
                       "shardwise config instead")
    return refused


def _hidden_size(model: nn.Module) -> Optional[int]:
    """The model's hidden size as transformers reads it for ZeRO's bucket sizes (the largest of hidden_sizes)."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        if getattr(source, "hidden_size", None) is not None:
            return source.hidden_size
        if getattr(source, "hidden_sizes", None):
            return max(source.hidden_sizes)
    return None


def has_shardwise_checkpoint(folder: str) -> bool:
    return os.path.isdir(folder) and CHECKPOINT_TAG in complete_tags(Path(folder))


def last_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The newest `checkpoint-N` folder of `output_dir` that was written whole (its trainer state written last)."""
    found = []
    for entry in Path(output_dir).glob(f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-*"):
        step = entry.name.rsplit("-", 1)[-1]
        if step.isdigit() and (entry / TRAINER_STATE).is_file():
            found.append((int(step), str(entry)))
    return max(found)[1] if found else None


class ShardwiseTrainerMixin:
    """Put before a `transformers.Trainer` (sub)class: `class MyTrainer(ShardwiseTrainerMixin, SFTTrainer)`, or
    `shardwise_trainer(SFTTrainer)`. It hooks the methods every Trainer subclass inherits, not `__init__`."""

    _shardwise_model: Optional[DistributedModel] = None
    _deepspeed: Optional[DeepSpeedPlan] = None
    _recorded_step: Optional[int] = None  # the optimizer step whose loss shardwise's metrics are told (_record_loss)
    _step_loss: Optional[torch.Tensor] = None

    # ----- the runtime and the accelerator -----

    def create_accelerator_and_postprocess(self) -> None:
        refused = _refused(self.args)
        if refused:
            raise ValueError(refused[0])
        self._deepspeed = start_runtime(self.args)
        adopt_world(self.args)
        super().create_accelerator_and_postprocess()
        self.is_deepspeed_enabled = False  # the DeepSpeed config runs on shardwise, not through accelerate
        self.is_fsdp_enabled = False
        self.accelerator.scaler = None  # shardwise scales fp16 losses (set with the model, _ScaledBackward)
        if replicas.replica_count() < dist.get_world_size():  # tensor or pipeline parallel: replicas span ranks
            replicas.install(self.accelerator)
            self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                     use_gather_object=self.args.eval_use_gather_object)
        if self.args.torch_compile:
            warn_ineffective([("TrainingArguments(torch_compile=True)", "shardwise.hf does not compile the model; "
                               "compile it in the script before the Trainer wraps it")])

    def get_tp_size(self) -> int:
        """The ranks sharing one batch (tensor-parallel peers and pipeline stages): the Trainer divides its token
        counts and batch sizes by this, as for transformers' own tensor parallelism."""
        return dist.get_world_size() // replicas.replica_count()

    # ----- the model -----

    @property
    def shardwise_model(self) -> DistributedModel:
        """The model as shardwise runs it, wrapped on first use (after `train` has prepared the model for training:
        activation checkpointing, resized embeddings)."""
        wrapped = self._shardwise_model
        if wrapped is not None and self.model is not wrapped.get_module() and self.model is not wrapped:
            self._shardwise_model = None  # a new model (model_init builds one per train()): wrapped afresh
        if self._shardwise_model is None:
            if any(hasattr(p, "ds_id") for p in self.model.parameters()):
                raise ValueError("the model's parameters were partitioned by DeepSpeed's zero.Init (transformers' "
                                 "TrainingArguments(deepspeed=...) made before from_pretrained does that); import "
                                 "TrainingArguments from shardwise.hf")
            model = DistributedModel(self.model)
            self._shardwise_model = model
            self.model = model.get_module()
            self.model_wrapped = model
            if model.loss_scaler is not None:
                self.accelerator.scaler = _ScaledBackward(model)
            if isinstance(self.model, FSDPModule) and hasattr(self.model, "generate"):
                # generate() calls the encoder and the forward of submodules itself: gather the root's shards
                # (the shared embedding) around it, as the Trainer does under accelerate's FSDP2
                register_fsdp_forward_method(self.model, "generate")
        return self._shardwise_model

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return self.shardwise_model

    # ----- optimizer and schedule -----

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        distributed = self.shardwise_model
        if isinstance(self.optimizer, _TrainerOptimizer):
            return self.optimizer
        if isinstance(self.optimizer, DistributedOptimizer):
            raise ValueError("Trainer(optimizers=(optimizer, ...)): pass the torch optimizer; the Trainer wraps it in "
                             "a DistributedOptimizer itself")
        block = state.current().config.optimizer if self._deepspeed is not None else None
        if self.optimizer is not None and block is not None:
            raise ValueError("Trainer(optimizers=(optimizer, ...)) and the DeepSpeed config's optimizer block both "
                             "name the optimizer; drop the block, or pass optimizers=(None, None)")
        if block is not None:
            # The DeepSpeed config's optimizer, over the trainable parameters in one group, as DeepSpeed builds it.
            params = [p for p in distributed.parameters() if p.requires_grad]
            self.optimizer = _torch_optimizer(block, params)
        else:
            super().create_optimizer()
        self.optimizer = _TrainerOptimizer(self.optimizer)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        block = self._deepspeed.scheduler() if self._deepspeed is not None else None
        if self.lr_scheduler is None and block is not None:
            self.lr_scheduler = build_scheduler(block, optimizer if optimizer is not None else self.optimizer)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    # ----- training -----

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, ignore_keys_for_eval: Any = None,
              **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:  # the newest folder written whole, not merely the newest
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> tuple:
        if self._created_lr_scheduler:  # a later train() builds its schedule again, as the Trainer's does
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        if self._deepspeed is not None:
            self._deepspeed.finish(_hidden_size(self.model), max_steps, self.args.get_warmup_steps(max_steps))
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        # accelerate's optimizer_step_was_skipped asks each of its optimizers (step_was_skipped).
        self.accelerator._optimizers.append(self.optimizer)
        if resume_from_checkpoint is not None:
            self._resume(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.shardwise_model, train_dataloader

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self.shardwise_model.runs_whole_step:  # a pipeline: the micro-step through its schedule (a @sw.step)
            loss = pipeline.training_step(self, self.shardwise_model, inputs, num_items_in_batch)
        else:
            # The Trainer marks its accumulation boundary (sync_gradients) before each micro-step: gradients reduce
            # there.
            with self.shardwise_model.microbatch_context(last=self.accelerator.sync_gradients):
                loss = super().training_step(model, inputs, num_items_in_batch)
            recorder_for(state.current()).batch_trained((), inputs)  # a @sw.step counts its own batch
        self._record_loss(loss)
        return loss

    def _record_loss(self, loss: torch.Tensor) -> None:
        """shardwise's metrics (`sw.metrics`, their sinks and report) get the optimizer step's loss on this rank:
        the sum of its micro-steps' losses, as the Trainer adds them (the Trainer logs their mean over ranks)."""
        if self._recorded_step != self.state.global_step:  # the first micro-step of an optimizer step
            self._recorded_step, self._step_loss = self.state.global_step, loss.detach().clone()
            recorder_for(state.current()).loss_returned(self._step_loss)  # read when the step is recorded
        else:
            self._step_loss += loss.detach()

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss; a tensor-parallel model's vocabulary-parallel loss and logits come back as whole
        tensors (the Trainer adds, logs and gathers plain ones)."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        return tree_map_only(DTensor, lambda t: t.full_tensor(), result)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Optional[list[str]] = None) -> tuple:
        if self.shardwise_model.runs_whole_step:  # the batch through the schedule, its outputs on every stage
            return super().prediction_step(pipeline.WholeBatchForward(self.shardwise_model), inputs,
                                           prediction_loss_only, ignore_keys=ignore_keys)
        # An evaluation step in the model's step context too (a vocabulary-parallel loss needs it).
        with self.shardwise_model.microbatch_context(last=True):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.optimizer.norm_to_log()  # the step clips (gradient_clipping = max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else self.optimizer.norm_to_log()

    # ----- saving -----

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Weights `from_pretrained` loads: every rank gathers the whole model, the saving rank writes it."""
        if self._shardwise_model is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        whole = self._shardwise_model.full_state_dict()  # a gather every rank joins
        if self.args.should_save:  # transformers' _save writes on every rank that calls it (before 5.24)
            self._save(output_dir, state_dict=whole)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        content = {"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}
        save_checkpoint(output_dir, CHECKPOINT_TAG, model=self.shardwise_model, optimizer=self.optimizer,
                        user_content=content)

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the shardwise checkpoint holds the fp16 loss scale."""

    # ----- loading -----

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        if has_shardwise_checkpoint(resume_from_checkpoint):
            return  # loaded with the optimizer once the model is wrapped (_resume)
        warnings.warn(f"{resume_from_checkpoint} holds no shardwise checkpoint (it was not written by "
                      "shardwise.hf.Trainer): its weights are loaded, the optimizer and the schedule start afresh",
                      stacklevel=2)
        target = model if model is not None else self._shardwise_model
        super()._load_from_checkpoint(resume_from_checkpoint, target)

    def _resume(self, folder: str) -> None:
        if not has_shardwise_checkpoint(folder):
            return
        # The Trainer restores the RNG streams and skips the trained batches itself.
        content = resume_from_checkpoint(folder, CHECKPOINT_TAG, model=self.shardwise_model, optimizer=self.optimizer,
                                         restore_positions=False)
        saved = content.get("lr_scheduler") if isinstance(content, dict) else None
        if saved is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(saved)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if not has_shardwise_checkpoint(best):
            return super()._load_best_model()
        resume_from_checkpoint(best, CHECKPOINT_TAG, load_optimizer=False, model=self.shardwise_model,
                               restore_positions=False)


class Trainer(ShardwiseTrainerMixin, transformers.Trainer):
    __doc__ = (f"transformers.Trainer on shardwise: {__doc__.splitlines()[0]}\n\n"
               + (transformers.Trainer.__doc__ or ""))


class Seq2SeqTrainer(ShardwiseTrainerMixin, transformers.Seq2SeqTrainer):
    __doc__ = (f"transformers.Seq2SeqTrainer on shardwise: {__doc__.splitlines()[0]}\n\n"
               + (transformers.Seq2SeqTrainer.__doc__ or ""))


def shardwise_trainer(trainer_class: type) -> type:
    """`trainer_class` (a transformers.Trainer subclass, e.g. trl's SFTTrainer) on shardwise, in one line:
    `SFTTrainer = shardwise_trainer(trl.SFTTrainer)`."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"shardwise_trainer expects a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ShardwiseTrainerMixin):
        return trainer_class
    return type(trainer_class.__name__, (ShardwiseTrainerMixin, trainer_class),
                {"__module__": trainer_class.__module__, "__qualname__": trainer_class.__qualname__,
                 "__doc__": trainer_class.__doc__})
