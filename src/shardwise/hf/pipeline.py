"""The Trainer's micro-step and evaluation step on a pipelined model, through `@sw.step`'s schedule.

A pipeline runs a whole step at once: the micro-step's batch is split into the config's `microbatches`, which
the schedule sends through the stages, and the loss exists on the last stage. The Trainer's `compute_loss` runs
unchanged inside the step function (on the last stage with the real outputs, elsewhere up to the model call).
With the Trainer's token-count normalisation (`num_items_in_batch`) each microbatch's loss is its share of the
micro-step's, so their gradients add up (the step averages over microbatches: the loss goes in scaled back) and
the micro-step's loss is their sum; without it, their mean. Every rank gets the loss, as SMP's step gives it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..api.model import DistributedModel
from ..api.step import StepOutput, step
from ..runtime import ranks
from ..runtime.state import current
from ..torch_internals import tree_map_only


def _count(num_items_in_batch: Any) -> Optional[float]:
    """The token count as a number: a pipeline splits every tensor argument into microbatches."""
    if num_items_in_batch is None:
        return None
    return float(num_items_in_batch.item() if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


def _scaled_for_accumulation(trainer: Any, count: Optional[float]) -> bool:
    """The Trainer's rule: a loss normalised by the token count (or a custom loss) is already scaled for it."""
    stated = getattr(trainer, "loss_is_scaled_for_ga", None)  # a Trainer attribute from transformers 5.19 on
    if stated is not None:
        return stated
    return (trainer.model_accepts_loss_kwargs and count is not None) or trainer.compute_loss_func is not None


def _training_function(trainer: Any) -> Callable:
    @step
    def micro_step(model: DistributedModel, inputs: dict[str, Any], count: Optional[float]) -> torch.Tensor:
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs, num_items_in_batch=count)
        if not _scaled_for_accumulation(trainer, count):
            loss = loss / trainer.current_gradient_accumulation_steps
        pieces = current("shardwise.hf").config.microbatches
        # accelerate's backward divides by its accumulation steps (1 from transformers 5.5 on, the Trainer's own
        # before): the same gradients as the Trainer's backward in every version
        scale = (pieces if count is not None else 1) / trainer.accelerator.gradient_accumulation_steps
        model.backward(loss * scale)  # with the token count each piece is its share: their sum
        return loss

    return micro_step


def training_step(trainer: Any, model: DistributedModel, inputs: dict[str, Any],
                  num_items_in_batch: Any) -> torch.Tensor:
    """The Trainer's `training_step` on a pipelined model: the micro-step's loss, as a tensor on every rank."""
    model.train()
    if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
        trainer.optimizer.train()
    inputs = trainer._prepare_inputs(inputs)
    count = _count(num_items_in_batch)
    if getattr(trainer, "_shardwise_pipeline_step", None) is None:
        trainer._shardwise_pipeline_step = _training_function(trainer)
    result = trainer._shardwise_pipeline_step(model, inputs, count)
    loss = result.reduce_sum() if count is not None else result.reduce_mean()
    return loss.detach().to(trainer.args.device)


def _from_first_stage(value: Optional[torch.Tensor]) -> torch.Tensor:
    """Pipeline rank 0's `value` on every stage of this pipeline: the Trainer pads and gathers predictions over
    every rank, so each needs them (the step leaves them on rank 0 and the last stage only)."""
    held = [value]
    dist.broadcast_object_list(held, group=ranks.get_pp_process_group(), group_src=0)
    return held[0]


class WholeBatchForward:
    """A pipelined model called on a whole batch, for the Trainer's evaluation and prediction: one `@sw.step`
    without gradients, its outputs as one process's on every stage (the loss combined over microbatches as
    `training_step` combines it; per-row outputs, logits say, joined and sent from pipeline rank 0)."""

    def __init__(self, model: DistributedModel):
        self.model = model

        @step
        def forward(model: DistributedModel, inputs: dict[str, Any]) -> Any:
            return model(**inputs)

        self._forward = forward

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, **inputs: Any) -> Any:
        count = _count(inputs.pop("num_items_in_batch", None))
        if count is not None:
            inputs["num_items_in_batch"] = count
        with torch.no_grad():
            outputs = self._forward(self.model, {**inputs, "use_cache": False})

        def combined(value: StepOutput) -> Any:
            if not value.outputs:
                return None
            scalar = torch.is_tensor(value.outputs[0]) and value.outputs[0].dim() == 0
            if scalar:
                return value.reduce_sum() if count is not None else value.reduce_mean()
            return value.concat()

        def everywhere(value: StepOutput) -> Any:
            # Every rank holds the scalars; rank 0 sends the per-row values (same tree order on every rank).
            if value.outputs and torch.is_tensor(value.outputs[0]) and value.outputs[0].dim() == 0:
                return combined(value)
            return _from_first_stage(combined(value) if ranks.pp_rank() == 0 else None)

        return tree_map_only(StepOutput, everywhere, outputs)
