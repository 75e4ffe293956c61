"""Every private member of transformers' Trainer and of accelerate that shardwise.hf relies on, in one place.

transformers promises nothing about these, so each is listed here with why shardwise.hf needs it, and
`tests/test_hf_internals.py` checks each still exists with the parameters assumed and is still called where the
Trainer's loop calls it: a transformers or accelerate upgrade that moves one fails there, by name. Checked with
transformers 5.3 and the newest (tests/test_hf_versions.py runs this smoke test on 5.3) and accelerate 1.15.

Trainer methods overridden (trainer.py), by the Trainer method that calls each:

- `_prepare_for_training` (from `_inner_training_loop`): accelerate's `prepare` would wrap the model in its
  DDP or DeepSpeed; here the model becomes a DistributedModel, the optimizer a DistributedOptimizer over its
  parameters, and a resumed run loads the shardwise checkpoint.
- `_wrap_model` (from `evaluation_loop` and `predict`): evaluation runs the DistributedModel (ZeRO-3's shards).
- `_clip_grad_norm` and `_get_grad_norm` (from `_run_epoch`): clipping is the optimizer step's, by the global
  norm over every shard; they hand the Trainer the tensor that step fills with the norm it logs.
- `_save_optimizer_and_scheduler` and `_save_scaler` (from `_save_checkpoint`): one shardwise checkpoint holds
  the optimizer, the fp16 loss scale and the schedule (any layout resumes it), no optimizer.pt/scaler.pt.
- `_load_from_checkpoint` (from `train`): the weights load with the optimizer after wrapping, not before.
- `_load_best_model` (from `_finalize_training`): the best checkpoint's weights into every rank's shards.

Trainer members used: `_save` (writes `save_pretrained`'s files from a state dict, from `save_model`),
`_prepare_inputs` (a pipelined micro-step prepares its batch as `training_step` does, pipeline.py) and
`_created_lr_scheduler` (a later `train()` rebuilds a schedule the Trainer built).

accelerate, under tensor parallelism only (replicas.py): the accelerator's `prepare_data_loader` and
`gather_for_metrics` are replaced on the Trainer's instance by ones over the model replicas, the first calling
accelerate's public `prepare_data_loader` with the replicas' count and index as its own does with the ranks'
(and adding to `Accelerator._dataloaders`, as its own does).

accelerate: `Accelerator._optimizers` (its `optimizer_step_was_skipped` asks each for `step_was_skipped`: the
DistributedOptimizer is added there, as accelerate adds its own wrappers), `Accelerator.scaler` (its `backward`
scales by it: shardwise's fp16 loss scale stands in), `AcceleratorState._reset_state` (the process state is a
singleton made when the TrainingArguments were, often before the process group).

TrainingArguments: `distributed_state`, `_n_gpu` and the cached `_setup_devices` (the world and device they
report; runtime.adopt_world sets them to shardwise's process group and device).
"""

from __future__ import annotations

import inspect
from typing import Callable

# name -> (the parameters it takes after self, the Trainer method calling it)
TRAINER_OVERRIDES = {
    "_prepare_for_training": (("max_steps", "train_dataloader", "resume_from_checkpoint"), "_inner_training_loop"),
    "_wrap_model": (("model", "training", "dataloader"), "evaluation_loop"),
    "_clip_grad_norm": (("model",), "_run_epoch"),
    "_get_grad_norm": (("model", "grad_norm"), "_run_epoch"),
    "_save_optimizer_and_scheduler": (("output_dir",), "_save_checkpoint"),
    "_save_scaler": (("output_dir",), "_save_checkpoint"),
    "_load_from_checkpoint": (("resume_from_checkpoint", "model"), "train"),
    "_load_best_model": ((), "_finalize_training"),
}
# Public Trainer methods overridden whose call site matters: the hook must run before what it prepares.
TRAINER_HOOKS = {"create_accelerator_and_postprocess": "__init__", "training_step": "_run_epoch",
                 "create_optimizer": "_prepare_for_training", "save_model": "_save_checkpoint"}
TRAINER_USED = {"_save": ("output_dir", "state_dict"), "_prepare_inputs": ("inputs",)}
TRAINER_ATTRIBUTES = ("_created_lr_scheduler",)


def _parameters(fn: Callable) -> tuple[str, ...]:
    return tuple(name for name in inspect.signature(fn).parameters if name != "self")


def problems() -> list[str]:
    """What no longer holds in the installed transformers and accelerate: one line each, empty when all do."""
    import transformers
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    trainer = transformers.Trainer
    found = []
    for name, (params, caller) in TRAINER_OVERRIDES.items():
        method = getattr(trainer, name, None)
        if method is None:
            found.append(f"transformers.Trainer.{name} is gone")
            continue
        if _parameters(method) != params:
            found.append(f"transformers.Trainer.{name} takes {_parameters(method)}, not {params}")
        if f"self.{name}(" not in inspect.getsource(getattr(trainer, caller)):
            found.append(f"transformers.Trainer.{caller} no longer calls self.{name}")
    for name, caller in TRAINER_HOOKS.items():
        if f"self.{name}(" not in inspect.getsource(getattr(trainer, caller)):
            found.append(f"transformers.Trainer.{caller} no longer calls self.{name}")
    for name, params in TRAINER_USED.items():
        method = getattr(trainer, name, None)
        if method is None or _parameters(method)[:len(params)] != params:
            found.append(f"transformers.Trainer.{name} is gone or no longer takes {params}")
    init = inspect.getsource(trainer.__init__) + inspect.getsource(trainer._prepare_for_training)
    found += [f"transformers.Trainer no longer sets {name}" for name in TRAINER_ATTRIBUTES if f"self.{name}" not in init]
    run_epoch = inspect.getsource(trainer._run_epoch)
    for use in ("self.accelerator.optimizer_step_was_skipped", "self.accelerator.gradient_state._set_sync_gradients"):
        if use not in run_epoch:
            found.append(f"transformers.Trainer._run_epoch no longer reads {use}")
    if "for optimizer in self._optimizers" not in inspect.getsource(Accelerator.optimizer_step_was_skipped.fget):
        found.append("accelerate's optimizer_step_was_skipped no longer asks Accelerator._optimizers")
    if "self.scaler.scale(loss)" not in inspect.getsource(Accelerator.backward):
        found.append("accelerate's Accelerator.backward no longer scales by Accelerator.scaler")
    if not callable(getattr(AcceleratorState, "_reset_state", None)):
        found.append("accelerate's AcceleratorState._reset_state is gone")
    setup = getattr(transformers.TrainingArguments, "_setup_devices", None)
    if not hasattr(setup, "attrname"):
        found.append("transformers.TrainingArguments._setup_devices is no longer a cached_property")
    return found
