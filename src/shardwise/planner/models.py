"""Where a model spec comes from: a preset, a config.json, `arch:key=value,...`, or `module:function`.

`resolve_model` accepts any of these in one string, so the CLI's `--model` and
the Python API read models the same way. Only `module:function` imports torch,
and only when used: it builds the model on the meta device (no memory, no
process group), reads a transformers model's config, and traces any other
module's forward (traced.py).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

import yaml

from ..families import family_of as registered_family
from .errors import PlanError, unknown
from .families import BUILDERS, DEFAULTS, spec_from_hf, with_overrides
from .spec import ModelSpec

# The seeds' models. GPT-2 at sequence length 512 and a 50,000-token vocabulary (seed 001's
# reference table gives only the parameter counts): 30B is SMP's own gpt2-30b shape (hidden 7168,
# 48 layers, 64 heads); 10B and 60B keep its depth and scale the width, with 128-wide heads.
_GPT2_SEED = {"vocab_size": 50000, "n_positions": 512, "n_layer": 48}
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-10b": {"model_type": "gpt2", **_GPT2_SEED, "n_embd": 4096, "n_head": 32},
    "gpt2-30b": {"model_type": "gpt2", **_GPT2_SEED, "n_embd": 7168, "n_head": 64},
    "gpt2-60b": {"model_type": "gpt2", **_GPT2_SEED, "n_embd": 10240, "n_head": 80},
    # Seed 000's ViT (~630M parameters), ViTForImageClassification with 1000 labels.
    "vit-630m": {"model_type": "vit", "hidden_size": 1024, "num_hidden_layers": 50, "num_attention_heads": 16,
                 "intermediate_size": 4096, "image_size": 256, "patch_size": 16, "num_labels": 1000},
}
FORMS = ("give a preset (" + ", ".join(sorted(PRESETS)) + "), a family with optional overrides ("
         + ", ".join(sorted(BUILDERS)) + ", e.g. gpt2:n_layer=24,n_embd=1024), a config.json path, "
         "or module:function that builds the model")


def _read_config_json(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as err:
        raise PlanError(f"cannot read model config {str(file)!r}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise PlanError(f"model config {str(file)!r} is not JSON: line {err.lineno}: {err.msg}") from None
    if not isinstance(data, dict):
        raise PlanError(f"model config {str(file)!r} is a JSON {type(data).__name__}, not an object")
    return data


def _parse_overrides(text: str, source: str) -> dict[str, Any]:
    """`n_layer=24,n_embd=1024` → {"n_layer": 24, "n_embd": 1024} with YAML scalar typing."""
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PlanError(f"model {source!r}: {item!r} is not key=value; write e.g. gpt2:n_layer=24,n_embd=1024")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def _build_on_meta(target: str) -> tuple[Any, ModuleType]:
    """Import `module:function`, call it under the meta device; the model it builds and the module."""
    module_name, _, func_name = target.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` does: the user's modules where the command runs
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PlanError(f"model {target!r}: cannot import module {module_name!r} ({err})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise unknown(f"function in module {module_name!r}:", func_name, names,
                      "name a function of that module that returns the model")
    import torch  # only this path needs torch, and only its meta device

    try:
        with torch.device("meta"):
            model = func()
    except Exception as err:  # the user's code: report any failure as bad input, in one line
        raise PlanError(f"model {target!r}: {func_name}() failed on the meta device: "
                        f"{type(err).__name__}: {err}") from None
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"model {target!r}: {func_name}() returned {type(model).__name__}, not a torch.nn.Module")
    return model, module


def spec_from_builder(target: str, input_shape: Optional[Sequence[int]] = None, seq: Optional[int] = None) -> ModelSpec:
    """Spec of the model `module:function` builds: a transformers model of a supported family from its config
    (parameters as counted), any other module from a traced forward (traced.py) of `input_shape` per sample or
    of the module's `example_inputs(batch, seq)`."""
    model, module = _build_on_meta(target)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if hasattr(config, "to_dict") and registered_family(str(model_type)) in BUILDERS and not input_shape:
        counted = sum(p.numel() for p in model.parameters())
        return replace(spec_from_hf(config.to_dict(), target, source=f"model {target!r}"), parameters=counted)
    from .traced import example_inputs, spec_from_module

    seq = seq or 1
    return spec_from_module(model, target, example_inputs(model, target, module, input_shape, seq), seq)


def resolve_model(text: str, *, input_shape: Optional[Sequence[int]] = None, seq: Optional[int] = None) -> ModelSpec:
    """The spec `text` names: preset, `family[:key=value,...]`, config.json path, or `module:function` (whose
    forward is traced on `input_shape` per sample, or on its module's `example_inputs(batch, seq)`)."""
    head, sep, rest = text.partition(":")
    if text in PRESETS or text in DEFAULTS:
        return spec_from_hf(PRESETS.get(text, {"model_type": text}), text)
    if sep and head in DEFAULTS:
        return spec_from_hf(with_overrides(head, _parse_overrides(rest, text), text), text)
    if text.endswith(".json") or Path(text).is_dir():
        return spec_from_hf(_read_config_json(Path(text)), Path(text).stem, source=text)
    if sep and rest and head.replace(".", "").replace("_", "").isalnum():
        return spec_from_builder(text, input_shape, seq)
    raise unknown("model", text, [*PRESETS, *DEFAULTS], FORMS)
