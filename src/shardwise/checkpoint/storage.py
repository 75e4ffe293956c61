"""Reading and writing torch.distributed.checkpoint (DCP) files safely.

DCP itself unpickles its `.metadata` and the non-tensor entries with full
pickle, so a checkpoint from elsewhere could run code on load. Here the
metadata goes through an unpickler that knows only DCP's own record classes and
torch's dtypes, the non-tensor entries through `torch.load(weights_only=True)`,
and every file is checked against the checksums the manifest recorded, so a
truncated or altered checkpoint is named as such instead of failing deep in torch.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
import zlib
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from ..torch_internals import layout_unpickler
from .directory import CheckpointError

_DCP_RECORDS = "torch.distributed.checkpoint."
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}
_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata records (its dataclasses and enums), torch.Size and torch's dtype-like
    constants: nothing it can reach runs code."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP_RECORDS):
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUES)):
            return getattr(torch, name)
        if module == "pathlib" and name in _PATHS:  # the checkpoint_id DCP records
            return super().find_class(module, name)
        if (module, name) == (layout_unpickler.__module__, layout_unpickler.__name__):  # a layout, by its name
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict" or module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata cannot run code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = Path(self.path) / ".metadata"
        try:
            with open(file, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing; the checkpoint is incomplete") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
            raise CheckpointError(f"{file} is damaged or not DCP metadata ({error})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{file} does not hold DCP metadata")
        return _with_load_id(metadata, self.load_id)


def _with_load_id(metadata: Metadata, load_id: Any) -> Metadata:
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor entries weights-only: plain Python values and tensors, never arbitrary objects."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as error:  # torch raises UnpicklingError or RuntimeError for refused globals
            raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} holds an object weights-only "
                                  f"loading refuses ({_first_line(error)})") from None
        super().load_bytes(read_item, _as_stream(loaded))


def _as_stream(value: Any) -> io.BytesIO:
    """`value` re-serialised, for DefaultLoadPlanner.load_bytes, which reads it back once more."""
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream


def entries(metadata: Metadata) -> dict[tuple, tuple[str, Any]]:
    """Every stored entry by its path in the nested state dict: (flat key, its tensor or bytes metadata)."""
    paths = metadata.planner_data or {}
    return {tuple(paths.get(key, (key,))): (key, item) for key, item in metadata.state_dict_metadata.items()}


def is_tensor(item: Any) -> bool:
    return isinstance(item, TensorStorageMetadata)


def is_object(item: Any) -> bool:
    return isinstance(item, BytesStorageMetadata)


def failure_message(error: CheckpointException) -> str:
    """One line from DCP's per-rank failures: the first rank's exception, and how many ranks failed."""
    failures = error.failures
    if not failures:
        return _first_line(error)
    rank = min(failures)
    exc = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    others = f" (and {len(failures) - 1} other ranks)" if len(failures) > 1 else ""
    if isinstance(exc, CheckpointError):
        return f"{exc}{others}"
    return f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}{others}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def checksum(file: Path) -> str:
    """crc32 of the file's bytes and its size: cheap enough to run on every file at save and load."""
    crc, size = 0, 0
    with open(file, "rb") as stream:
        while chunk := stream.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return f"{crc:08x}:{size}"


def checksums(directory: Path, names: Iterable[str]) -> dict[str, str]:
    return {name: checksum(directory / name) for name in names}


def verify(directory: Path, expected: dict[str, str]) -> None:
    """Every listed file present, of its size and checksum; a one-line CheckpointError on the first that is not."""
    for name, recorded in sorted(expected.items()):
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint")
        actual = checksum(file)
        if actual != recorded:
            size, want = actual.split(":")[1], recorded.split(":")[1]
            what = f"truncated ({size} of {want} bytes)" if size != want else "altered (checksum differs)"
            raise CheckpointError(f"{file} is {what} since it was saved; the checkpoint is damaged")


def plain_data_globals(file: Path) -> list[Any]:
    """The classes beyond weights-only types that `file` needs, when all are plain data training scripts keep in
    `user_content` (SMP's examples keep a Hugging Face config and NumPy counts there), rebuilt without running
    code: Hugging Face config classes, NumPy scalars and dtypes. Anything else: none, so loading refuses."""
    found = [_plain_data(name) for name in torch.serialization.get_unsafe_globals_in_checkpoint(file)]
    if any(value is None for value in found):
        return []
    if any(getattr(value, "__module__", "").startswith("numpy") for value in found):
        import numpy  # a pickled dtype is rebuilt as its concrete class (Int64DType, ...), not named in the file

        found += [getattr(numpy.dtypes, name) for name in numpy.dtypes.__all__]
    return found


def _plain_data(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    if not (module.startswith("transformers.") or module in _NUMPY_DATA):
        return None
    try:
        found = getattr(importlib.import_module(module), attribute, None)
    except ImportError:
        return None
    if module in _NUMPY_DATA:
        import numpy

        return found if found is numpy._core.multiarray.scalar or (
            isinstance(found, type) and issubclass(found, numpy.dtype)) else None
    from transformers import PretrainedConfig

    return found if isinstance(found, type) and issubclass(found, PretrainedConfig) else None


# Where NumPy's pickles of scalars and dtypes name their globals (torch's weights-only docs allowlist these).
_NUMPY_DATA = ("numpy._core.multiarray", "numpy.core.multiarray", "numpy", "numpy.dtypes")
