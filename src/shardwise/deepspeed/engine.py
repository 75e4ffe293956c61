"""`DeepSpeedEngine`: DeepSpeed's training engine over a `DistributedModel` and a `DistributedOptimizer`.

A micro-step is `engine(batch)` then `engine.backward(loss)`; `engine.step()` after each one updates the
weights only at the gradient accumulation boundary (every `gradient_accumulation_steps`-th micro-step), then
clears the gradients and steps the scheduler, as DeepSpeed does. Between boundaries the model's own
accumulation context keeps gradients local (DDP's no_sync, FSDP2's deferred reduction), so a micro-step costs
what a microbatch of `@sw.step` costs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..api.data import data_loader
from ..api.model import DistributedModel
from ..api.optimizer import DistributedOptimizer
from ..checkpoint.resume import resume_from_checkpoint
from ..checkpoint.save import save_checkpoint as save_shardwise_checkpoint
from ..config import ShardwiseConfig
from ..observe.recorder import recorder_for
from ..runtime import ranks
from ..runtime.state import current
from .utils import log_dist

LATEST = "latest"  # DeepSpeed's file naming the newest tag of a checkpoint directory


@dataclass(frozen=True)
class EngineSettings:
    """What one engine reads from its DeepSpeed config (the layout's keys are the runtime's)."""

    gradient_accumulation_steps: int
    train_micro_batch_size_per_gpu: int
    train_batch_size: int
    steps_per_print: Optional[int]
    dataloader_drop_last: bool
    fp16: bool
    bf16: bool
    zero_stage: int
    gradient_clipping: float

    @classmethod
    def of(cls, config: ShardwiseConfig, data: Mapping[str, Any]) -> "EngineSettings":
        micro = config.train_micro_batch_size_per_gpu
        if micro is None:
            raise ValueError("deepspeed.initialize: the config sets neither train_batch_size nor "
                             "train_micro_batch_size_per_gpu; set one of them, as DeepSpeed requires")
        return cls(gradient_accumulation_steps=config.microbatches, train_micro_batch_size_per_gpu=micro,
                   train_batch_size=config.train_batch_size, steps_per_print=config.steps_per_print,
                   dataloader_drop_last=bool(data.get("dataloader_drop_last", False)), fp16=config.fp16,
                   bf16=config.bf16, zero_stage=config.effective_zero_stage,
                   gradient_clipping=float(config.gradient_clipping or 0.0))


class DeepSpeedEngine(nn.Module):
    """DeepSpeed's engine: call it as the model, then `backward(loss)` and `step()` once per micro-batch.

    `module` is the user's module (under ZeRO-3 holding this rank's shards, under a pipeline its stages), the
    optimizer and scheduler are the ones `initialize` returned. Counters (`global_steps`, `global_samples`,
    `micro_steps`, `skipped_steps`) follow DeepSpeed's definitions; checkpoints are shardwise's (atomic,
    resharding) under DeepSpeed's calls and `latest` tag file.
    """

    shuffles_training_data = True  # DeepSpeed's pipeline engine reads its training data in order
    optimizer: Optional[DistributedOptimizer]
    lr_scheduler: Any
    training_dataloader: Any
    global_steps: int  # optimizer steps, skipped ones included
    global_samples: int
    micro_steps: int
    skipped_steps: int

    def __init__(self, model: DistributedModel, optimizer: Optional[DistributedOptimizer], lr_scheduler: Any,
                 settings: EngineSettings, collate_fn: Optional[Callable] = None):
        super().__init__()
        self._model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.settings = settings
        self.collate_fn = collate_fn
        self.training_dataloader = None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._boundary_override: Optional[bool] = None
        self._micro_step: Optional[contextlib.ExitStack] = None  # open from a training forward to its backward
        self._no_sync = False
        self._reduce_at_boundary = False  # a micro-step's forward bypassed DDP's reduction (see backward)
        self._losses: list[torch.Tensor] = []  # of this accumulation's micro-steps, for the metrics' step loss
        self._runtime = current("deepspeed.initialize")

    # ----- what the script asks of the engine -----

    @property
    def module(self) -> nn.Module:
        return self._model.get_module()

    @property
    def local_rank(self) -> int:
        return self._runtime.local_rank

    @property
    def global_rank(self) -> int:
        return self._runtime.rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def dp_world_size(self) -> int:
        return ranks.dp_size()

    @property
    def mp_world_size(self) -> int:
        return ranks.mp_size()

    @property
    def device(self) -> torch.device:
        return self._runtime.device

    def gradient_accumulation_steps(self) -> int:
        return self.settings.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.settings.train_batch_size

    def steps_per_print(self) -> Optional[int]:
        return self.settings.steps_per_print

    def fp16_enabled(self) -> bool:
        return self.settings.fp16

    def bfloat16_enabled(self) -> bool:
        return self.settings.bf16

    def zero_optimization_stage(self) -> int:
        return self.settings.zero_stage

    def zero_optimization(self) -> bool:
        return self.settings.zero_stage > 0

    def gradient_clipping(self) -> float:
        return self.settings.gradient_clipping

    def get_lr(self) -> list[float]:
        return self._group_values("lr")

    def get_mom(self) -> list[Any]:
        key = "betas" if self.optimizer is not None and "betas" in self.optimizer.defaults else "momentum"
        return self._group_values(key)

    def _group_values(self, key: str) -> list[Any]:
        if self.optimizer is None:
            return []
        return [group[key] for group in self.optimizer.param_groups if key in group]

    def get_global_grad_norm(self) -> Optional[float]:
        """The global gradient norm the last step clipped by (None before any, or without gradient_clipping)."""
        norm = None if self.optimizer is None else self.optimizer.grad_norm
        return None if norm is None else float(norm)

    def was_step_applied(self) -> bool:
        """False when the last boundary's update was skipped (an fp16 overflow, or non-finite gradients)."""
        return self._step_applied

    def loss_scale(self) -> float:
        return 1.0 if self.optimizer is None else self.optimizer.loss_scale

    # ----- the accumulation boundary -----

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends an accumulation: gradients reduce and `step()` updates."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary for the following micro-steps (DeepSpeed's manual accumulation)."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without reducing them; `step()` is illegal inside, as in DeepSpeed."""
        if self.settings.zero_stage >= 2:
            raise RuntimeError(f"engine.no_sync() is incompatible with ZeRO stage {self.settings.zero_stage}, "
                               "which reduces gradients into shards every backward (as in DeepSpeed); use "
                               "gradient_accumulation_steps instead")
        if self._no_sync:
            raise RuntimeError("engine.no_sync() is already active; it does not nest")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    # ----- forward, backward, step -----

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            if self._micro_step is None:
                self._open_micro_step()
            recorder_for(self._runtime).batch_trained(args, kwargs)
        return self._model(*args, **kwargs)

    def _open_micro_step(self) -> None:
        """Enter the model's accumulation context for this micro-step; `backward` leaves it."""
        reduce = self.is_gradient_accumulation_boundary() and not self._no_sync
        stack = contextlib.ExitStack()
        stack.enter_context(self._model.microbatch_context(last=reduce))
        self._micro_step = stack

    def _close_micro_step(self) -> None:
        if self._micro_step is not None:
            stack, self._micro_step = self._micro_step, None
            stack.close()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` divided by the accumulation steps (unless `scale_wrt_gas=False`), loss-scaled
        in fp16; returns the divided loss, as DeepSpeed does."""
        if self.optimizer is None:
            raise RuntimeError("engine.backward needs an optimizer: pass optimizer= to deepspeed.initialize or "
                               "add an optimizer block to the config")
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ValueError("engine.backward expects a scalar loss tensor; reduce it first (e.g. loss.mean())")
        if self._micro_step is None and self._model.reduces_in_forward and ranks.rdp_size() > 1:
            # DDP arms its reduction in forward: a loss from the module called directly (DeepSpeedExamples' DCGAN
            # does so) leaves these gradients to the boundary, as DeepSpeed's engine reduces its own there.
            self._reduce_at_boundary = True
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        self._losses.append(loss.detach() * (self.gradient_accumulation_steps() if scale_wrt_gas else 1))
        try:
            self._model.scaled_loss(loss).backward(retain_graph=retain_graph)
        finally:
            self._close_micro_step()
        return loss

    def step(self, lr_kwargs: Optional[dict[str, Any]] = None) -> None:
        """At the accumulation boundary: the optimizer step (clipping, fp16 unscaling and skipping as
        configured), zeroed gradients and the scheduler's step unless the update was skipped. Always: one
        more micro-step."""
        if self._no_sync:
            raise RuntimeError("engine.step() is illegal inside engine.no_sync(), as in DeepSpeed; leave the "
                               "context before the boundary's backward and step")
        if self.optimizer is None:
            raise RuntimeError("engine.step needs an optimizer: pass optimizer= to deepspeed.initialize or add "
                               "an optimizer block to the config")
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1

    def _average_over_replicas(self) -> None:
        """This accumulation's gradients averaged over the data-parallel replicas. Gradients DDP reduced already
        are equal on every replica, and their average is themselves."""
        group = ranks.process_group("rdp", "engine.step")
        size = dist.get_world_size(group)
        with torch.no_grad():
            for param in self._model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)
                    param.grad /= size

    def _take_model_step(self, lr_kwargs: Optional[dict[str, Any]]) -> None:
        if self._reduce_at_boundary:
            self._average_over_replicas()
            self._reduce_at_boundary = False
        if self._losses:
            recorder_for(self._runtime).loss_returned(torch.stack(self._losses).mean())
            self._losses = []
        self.optimizer.step()
        self._step_applied = not self.optimizer.overflow
        self.optimizer.zero_grad(set_to_none=True)
        if not self._step_applied:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        every = self.steps_per_print()
        if every and (self.global_steps + 1) % every == 0:
            log_dist(f"step={self.global_steps + 1}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                     f"mom={self.get_mom()}", ranks=[0])
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for param in self.module.parameters():
                param.grad = None

    # ----- data -----

    def deepspeed_io(self, dataset: Any, batch_size: Optional[int] = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Optional[Callable] = None,
                     num_local_io_workers: Optional[int] = None) -> Any:
        """A loader of `batch_size` (the micro batch) samples per data-parallel rank, in DeepSpeed's order
        (DistributedSampler, seed 0, shuffled for training but under a pipeline, the same order every epoch)."""
        if not isinstance(dataset, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
            raise ValueError("deepspeed: training data must be a torch.utils.data.Dataset")
        if data_sampler is not None:
            raise ValueError("deepspeed_io(data_sampler=...): shardwise's loader deals the samples to the "
                             "data-parallel ranks itself (and keeps its position for checkpoints); pass None")
        kwargs: dict[str, Any] = {"collate_fn": collate_fn or self.collate_fn}
        if num_local_io_workers is not None:
            kwargs["num_workers"] = num_local_io_workers
        return data_loader(dataset, batch_size or self.train_micro_batch_size_per_gpu(),
                           shuffle=route == "train" and self.shuffles_training_data,
                           drop_last=self.settings.dataloader_drop_last, **kwargs)

    def training_loader(self, dataset: Any) -> Any:
        """The loader `initialize` returns for `training_data`."""
        return self.deepspeed_io(dataset)

    # ----- modes and parameters -----

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The user's module's parameters, named as in DeepSpeed's engine (`module.` first)."""
        return self._model.named_parameters(prefix + "module.", recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._model.parameters(recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The whole model, as `module.state_dict()` of one process (DeepSpeed's `module_state_dict`)."""
        return self._model.state_dict()

    module_state_dict = state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._model.load_state_dict(state_dict, strict=strict, assign=assign)

    # ----- checkpoints -----

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        ckpt_id: Any = None, client_sd: Optional[dict] = None) -> bool:
        """Save model, optimizer, scheduler, counters and `client_state` to `save_dir/tag` (default
        `global_step<N>`) on every rank, then write `save_dir/latest` naming the tag. The seed's `ckpt_id=` and
        `client_sd=` are the same arguments. Any layout resumes it."""
        tag = _either("tag", tag, "ckpt_id", ckpt_id)
        client_state = _either("client_state", client_state, "client_sd", client_sd) or {}
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True): shardwise checkpoints hold every "
                             "parameter, so any layout can resume them; pass False")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        content = {"client_state": dict(client_state), "engine": self._counters(),
                   "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}
        save_shardwise_checkpoint(save_dir, tag, model=self._model, optimizer=self.optimizer, user_content=content)
        if save_latest and dist.get_rank() == 0:
            (Path(save_dir) / LATEST).write_text(tag)
        dist.barrier()
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Optional[Callable] = None,
                        ckpt_id: Any = None) -> tuple[Optional[str], Optional[dict]]:
        """Load `load_dir/tag` (the tag in `load_dir/latest` when None); returns `(path, client_state)`, or
        `(None, None)` when there is no `latest` file, as DeepSpeed does. The data loaders' positions and the
        RNG streams stay as the script set them (DeepSpeed restores neither)."""
        tag = _either("tag", tag, "ckpt_id", ckpt_id)
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...): shardwise loads its own resharding checkpoints; "
                             "pass None")
        if tag is None:
            latest = Path(load_dir) / LATEST
            if not latest.is_file():
                log_dist(f"Unable to find latest file at {latest}, if trying to load latest checkpoint please "
                         "ensure this file exists or pass an explicit checkpoint tag when loading a checkpoint.",
                         ranks=[0])
                return None, None
            tag = latest.read_text().strip()
        with_optimizer = load_optimizer_states and not load_module_only
        content = resume_from_checkpoint(load_dir, str(tag), strict=load_module_strict,
                                         load_optimizer=with_optimizer and self.optimizer is not None,
                                         model=self._model, optimizer=self.optimizer, restore_positions=False)
        if not load_module_only:
            self._restore_counters(content.get("engine", {}))
            saved = content.get("lr_scheduler")
            if load_lr_scheduler_states and saved is not None and self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(saved)
        return str(Path(load_dir) / str(tag)), content.get("client_state", {})

    def _counters(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps}

    def _restore_counters(self, counters: Mapping[str, int]) -> None:
        for name, value in counters.items():
            setattr(self, name, int(value))


def _either(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise ValueError(f"save/load_checkpoint: {name}= and {alias}= are the same argument; pass one")
    return value if value is not None else alias_value
