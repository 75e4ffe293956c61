"""`save_checkpoint`: SMP's call, written through torch.distributed.checkpoint, atomically.

Every rank writes its own pieces into `PATH/.writing-TAG/` in parallel; once all
have finished, their files' checksums go into the manifest and the directory is
renamed to `PATH/TAG/`, then `PATH/newest` is pointed at it. A full checkpoint
(`partial=False`) is written the same way and then consolidated by the first rank
into two plain torch files. With `async_save=True` the tensors are first copied to
host memory and the writing, checksums and rename happen in the background.
"""

from __future__ import annotations

import json
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ..parallel.tensor.registration import stood_in_for
from ..runtime.state import Runtime, current
from .contents import MODEL, subjects, training_state
from .coordination import agree, checkpoint_group
from .directory import (MODEL_FILE, TRAINING_FILE, USER_CONTENT, CheckpointError, check_tag, newest_tag, prune, publish,
                        start_writing, write_manifest, writing_dir)
from .sources import read_everything
from .storage import checksums, failure_message, plain_data_globals

_DCP_DIR = "dcp"  # inside a full checkpoint's staging directory, removed once consolidated


def save_checkpoint(path: str, tag: str, partial: bool = True, model: Any = None, optimizer: Any = None,
                    user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: Optional[int] = None, async_save: bool = False) -> None:
    """Save the model, its optimizer, the step counter, every rank's RNG states, the fp16 loss scaler, the
    positions of `sw.data_loader`s and `user_content` to `path/tag`, then point `path/newest` at it.

    Called by every rank. `partial=True` (sharded): each rank writes its own pieces; any layout resumes it.
    `partial=False` (full): one `model.pt` with the user's module's state dict, as plain PyTorch loads it,
    and `training_state.pt`; with `translate_if_full`, a model SMP's stand-in replaced (a Hugging Face GPT-2
    built for tensor parallelism) is written as the Hugging Face model's state dict, as SMP did. `num_kept_partial_checkpoints=N` keeps the N newest partial checkpoints in `path`.
    `async_save=True` returns once the state is copied to host memory; the next checkpoint call, `shutdown`
    or the end of the script waits for it (and raises its error)."""
    runtime = current("shardwise.save_checkpoint")
    tag = check_tag(tag)
    if num_kept_partial_checkpoints is not None and num_kept_partial_checkpoints < 1:
        raise ValueError(f"num_kept_partial_checkpoints={num_kept_partial_checkpoints}; keep at least 1, "
                         "or None to keep all")
    runtime.wait_for_pending_save()
    model, optimizer = subjects(runtime, model, optimizer)
    group = checkpoint_group(runtime)
    root = Path(path)
    state = training_state(runtime, model, optimizer)
    staging = agree(group, lambda: _prepare(root, tag, user_content) if dist.get_rank() == 0 else writing_dir(root, tag))
    translation = stood_in_for(model.get_module()) if translate_if_full else None
    finish = _finisher(runtime, group, root, tag, partial, model, num_kept_partial_checkpoints, translation)
    writer = FileSystemWriter(staging if partial else staging / _DCP_DIR)
    if not async_save:
        _write(lambda: dcp.save(state, storage_writer=writer, process_group=group), group, root, tag)
        finish()
        return
    written = _write(lambda: dcp.async_save(state, storage_writer=writer, process_group=group), group, root, tag)
    runtime.pending_save = _in_background(lambda: (_write(written.result, group, root, tag), finish()))


def _prepare(root: Path, tag: str, user_content: Any) -> Path:
    """The first rank's part before any rank writes: a fresh staging directory holding `user_content`."""
    staging = start_writing(root, tag)
    torch.save(user_content, staging / USER_CONTENT)
    try:
        with torch.serialization.safe_globals(plain_data_globals(staging / USER_CONTENT)):
            torch.load(staging / USER_CONTENT, weights_only=True)
    except Exception as error:
        warnings.warn(f"user_content holds objects weights-only loading refuses ({str(error).splitlines()[0][:120]}"
                      "); resume_from_checkpoint returns it only with trusted_user_content=True", stacklevel=4)
    return staging


def _write(action: Callable[[], Any], group: dist.ProcessGroup, root: Path, tag: str) -> Any:
    """Run DCP's save; its failure on any rank becomes one CheckpointError on every rank."""
    try:
        return action()
    except CheckpointException as error:
        raise _not_written(group, root, tag, failure_message(error)) from None


def _not_written(group: dist.ProcessGroup, root: Path, tag: str, reason: str) -> CheckpointError:
    """The error every rank raises for a save that failed, once the first has removed what was written."""
    if dist.get_rank() == 0:
        shutil.rmtree(writing_dir(root, tag), ignore_errors=True)
    dist.barrier(group=group)
    previous = newest_tag(root)
    kept = f"the previous checkpoint {previous!r} in {root} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"checkpoint {tag!r} was not written ({reason}); {kept}")


def _finisher(runtime: Runtime, group: dist.ProcessGroup, root: Path, tag: str, partial: bool, model: Any,
              keep: Optional[int], translation: Optional[Callable[[dict], dict]]) -> Callable[[], None]:
    """What follows the writing, on every rank: consolidation (full), checksums, manifest, rename, pointer."""
    def finish() -> None:
        staging = writing_dir(root, tag)
        first = dist.get_rank() == 0
        if not partial and first:
            _consolidate(staging, translation)
        files = sorted(entry.name for entry in staging.iterdir() if entry.is_file()) if partial or first else []
        mine = files[dist.get_rank()::dist.get_world_size()] if partial else files
        computed = agree(group, lambda: checksums(staging, mine))
        sums: list[Optional[dict[str, str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(sums, computed, group=group)
        recorded = {name: value for part in sums if part for name, value in part.items()}
        try:
            agree(group, lambda: _publish(runtime, root, tag, partial, model, recorded, keep,
                                                  translation is not None) if first else None)
        except CheckpointError as error:
            raise _not_written(group, root, tag, str(error)) from None

    return finish


def _consolidate(staging: Path, translation: Optional[Callable[[dict], dict]]) -> None:
    """The DCP files the ranks wrote, as `model.pt` (the user's module's state dict, translated when asked) and
    `training_state.pt`."""
    everything = read_everything(staging / _DCP_DIR)
    weights = everything.pop(MODEL)
    torch.save(translation(dict(weights)) if translation is not None else weights, staging / MODEL_FILE)
    torch.save(everything, staging / TRAINING_FILE)
    shutil.rmtree(staging / _DCP_DIR)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _publish(runtime: Runtime, root: Path, tag: str, partial: bool, model: Any, recorded: dict[str, str],
             keep: Optional[int], translated: bool) -> None:
    """Checksums and the manifest (the class whose state dict `model.pt` is: the replaced one when
    `translated`), then the rename and the `newest` pointer."""
    config = model.model_config
    write_manifest(writing_dir(root, tag), tag=tag, partial=partial, world_size=dist.get_world_size(),
                   degrees=runtime.layout.degrees(),
                   model_class=_class_path(model.replaced_class if translated else model.module_class),
                   hf_config=json.loads(config.to_json_string()) if hasattr(config, "to_json_string") else None,
                   checksums=recorded)
    publish(root, tag)
    if keep is not None:
        prune(root, keep)


_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-checkpoint")


def _in_background(work: Callable[[], Any]) -> Future:
    return _background.submit(work)
