"""`PipelineEngine`: DeepSpeed's `train_batch`/`eval_batch` for a `PipelineModule`, on shardwise's pipeline.

One `train_batch()` pulls `gradient_accumulation_steps` micro-batches of `(inputs, labels)`, joins them into
one batch and runs it as one `@sw.step` whose microbatches are those micro-batches: the pipeline schedule
(`pipeline_parallel_degree` = the module's `num_stages`, `microbatches` = the accumulation steps) runs every
forward and backward, then the optimizer steps once. As in DeepSpeed, the loss returned is the mean over the
micro-batches and the data-parallel ranks, on every rank; `forward`, `backward` and `step` are refused.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ..api.step import step
from ..runtime import ranks
from ..torch_internals import tree_flatten, tree_unflatten
from .engine import DeepSpeedEngine
from .utils import RepeatingLoader


def _joined(micro_batches: list[Any]) -> Any:
    """The micro-batches' tensors joined along dim 0, in the structure of one micro-batch."""
    flat = [tree_flatten(batch) for batch in micro_batches]
    leaves, spec = flat[0]
    columns = [[leaves_of[i] for leaves_of, _ in flat] for i in range(len(leaves))]
    return tree_unflatten([torch.cat(column) if torch.is_tensor(column[0]) else column[0] for column in columns],
                          spec)


def _loss(module: Any, outputs: Any, labels: Any) -> Any:
    """The module's `loss_fn(outputs, labels)`; without one, the last layer's output is the loss."""
    return outputs if module.loss_fn is None else module.loss_fn(outputs, labels)


class PipelineEngine(DeepSpeedEngine):
    """DeepSpeed's pipeline engine: `train_batch(data_iter)` and `eval_batch(data_iter)` per global batch. As
    DeepSpeed's, it reads `training_data` in order and repeats it (the loader `initialize` returns never ends)."""

    shuffles_training_data = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._data_iterator: Optional[Iterator[Any]] = None
        pipeline = self.module_spec

        @step
        def train_step(model: Any, inputs: Any, labels: Any) -> Any:
            loss = _loss(pipeline, model(inputs), labels)
            model.backward(loss)
            return loss

        @step
        def eval_step(model: Any, inputs: Any, labels: Any) -> Any:
            outputs = model(inputs)
            return _loss(pipeline, outputs, labels), outputs

        self._train_step, self._eval_step = train_step, eval_step

    @property
    def module_spec(self) -> Any:
        """The PipelineModule as built (its `loss_fn`; its layers, of which this rank runs its stages')."""
        return self.module

    @property
    def num_stages(self) -> int:
        return ranks.pp_size()

    @property
    def stage_id(self) -> int:
        return ranks.pp_rank()

    @property
    def micro_batches(self) -> int:
        return self.gradient_accumulation_steps()

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def training_loader(self, dataset: Any) -> Any:
        return RepeatingLoader(self.deepspeed_io(dataset))

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator `train_batch()` pulls from when it is given none."""
        self._data_iterator = iterator

    def _micro_batches(self, data_iter: Optional[Iterator[Any]], count: int) -> Any:
        if data_iter is None:
            if self._data_iterator is None:
                if self.training_dataloader is None:
                    raise ValueError("train_batch() needs data: pass data_iter=, or training_data= to "
                                     "deepspeed.initialize")
                self._data_iterator = iter(self.training_dataloader)
            data_iter = self._data_iterator
        return _joined([next(data_iter) for _ in range(count)])

    def _mean_over_data_parallel(self, loss: Optional[torch.Tensor]) -> torch.Tensor:
        loss = loss.detach().clone() if loss is not None else torch.zeros((), device=self.device)
        group = ranks.process_group("dp", "PipelineEngine")
        if dist.get_world_size(group) > 1:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        return loss

    def train_batch(self, data_iter: Optional[Iterator[Any]] = None) -> torch.Tensor:
        """Forward and backward of one global batch through the pipeline, then the optimizer step; the mean
        loss over its micro-batches and the data-parallel ranks, on every rank."""
        self.train()
        inputs, labels = self._micro_batches(data_iter, self.micro_batches)
        loss = self._train_step(self._model, inputs, labels).reduce_mean()
        self._losses = [loss] if loss is not None else []
        self._take_model_step(None)
        self.micro_steps += self.micro_batches
        return self._mean_over_data_parallel(loss)

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None) -> Any:
        """The loss of one global batch without gradients (the mean over micro-batches and data-parallel ranks
        with `reduce_output='avg'`), and the outputs too with `return_logits=True` (on the last stage)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        self.eval()
        inputs, labels = self._micro_batches(data_iter, num_micro_batches or self.micro_batches)
        with torch.no_grad():
            losses, outputs = self._eval_step(self._model, inputs, labels)
        loss = self._mean_over_data_parallel(losses.reduce_mean()) if reduce_output == "avg" else losses.outputs
        self.train()
        return (loss, outputs.concat()) if return_logits else loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Only train_batch() and eval_batch() are accessible in pipeline mode (as in "
                           "DeepSpeed): the schedule runs every micro-batch's forward and backward")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Only train_batch() and eval_batch() are accessible in pipeline mode (as in "
                           "DeepSpeed): train_batch() runs backward")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Only train_batch() and eval_batch() are accessible in pipeline mode (as in "
                           "DeepSpeed): train_batch() steps the optimizer")
