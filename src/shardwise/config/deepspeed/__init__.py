"""DeepSpeed's JSON config, recognised by its keys and translated into shardwise's, with DeepSpeed's meaning.

    {"train_batch_size": 32, "gradient_accumulation_steps": 2, "bf16": {"enabled": true},
     "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

Every key DeepSpeed reads (keys.py lists them all, zero.py those of
zero_optimization) becomes the shardwise key that does the same, is honoured in
another way (said how), or is listed with why it cannot be honoured (a warning
at run, a section in check-config): never dropped unsaid. A key DeepSpeed does
not read is an unknown key, an error with the closest name; so is the Hugging
Face Trainer's "auto" outside the Trainer (auto.py: one error naming every such
key). The batch triple is completed and checked where the data-parallel degree
is known (`validate.batch_triple`); the optimizer and scheduler blocks are
checked by config/blocks.py. Pure: no torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..distribution import Distribution
from ...errors import ConfigError
from ..schema import field_names
from .auto import auto_keys, auto_problem, without_auto
from .data_types import translate_data_types
from .keys import ALWAYS, CHOICES, DIFFERENTLY, NOT_HONOURED, REFUSED_VALUES, REMOVED, TOP_LEVEL
from .sections import SECTIONS, VALUES
from .translation import Translation, switched_off
from .zero import translate_zero

__all__ = ["Translation", "as_distribution", "auto_keys", "describe", "is_deepspeed", "translate"]

DEFAULT_CLIPPING = 1.0  # DeepSpeed 0.19's GRADIENT_CLIPPING_DEFAULT (earlier releases: no clipping)

# Sections shardwise spells as scalars (or SMP as a string): a DeepSpeed config writes them as dicts.
_DICT_SECTIONS = frozenset({"fp16", "bf16", "flops_profiler", "comms_logger", "pipeline", "optimizer", "scheduler"})


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """True for a DeepSpeed config: a key only DeepSpeed has, or `fp16`/`bf16`/... written as DeepSpeed's dict."""
    own = set(field_names())
    return any((key in TOP_LEVEL and key not in own and key not in _DICT_SECTIONS)
               or (key in _DICT_SECTIONS - {"optimizer", "scheduler"} and isinstance(value, Mapping))
               for key, value in data.items())


def translate(data: Mapping[str, Any]) -> Translation:
    """The shardwise keys a DeepSpeed config asks for; shardwise's own keys beside them pass as they are. The
    Trainer's "auto" values are one problem and are otherwise left out, so the rest is checked in the same pass."""
    t = Translation()
    auto = auto_keys(data)
    if auto:
        t.problems.append(auto_problem(auto))
        data = without_auto(data, auto)
    own = set(field_names())
    for key, value in data.items():
        if key in CHOICES and value is not None and str(value).lower() not in CHOICES[key]:
            t.problem(key, value, f"is not one DeepSpeed accepts: {', '.join(CHOICES[key])}",
                      f"use one of {', '.join(CHOICES[key])}")
        elif (key, str(value).lower()) in REFUSED_VALUES:
            t.problem(key, value, *REFUSED_VALUES[key, str(value).lower()])
        elif key == "zero_optimization":
            translate_zero(t, value)
        elif key == "data_types":
            pass  # after the rest: its meaning depends on the precision and the ZeRO stage
        elif key in SECTIONS and isinstance(value, Mapping):
            SECTIONS[key](t, value)
        elif key in SECTIONS and key not in own:
            t.problem(key, value, "must be a dict (DeepSpeed's section)", f'write e.g. "{key}": {{"enabled": true}}')
        elif key in VALUES:
            VALUES[key](t, value, key)
        elif key in ALWAYS:
            t.always(key, value.lower() if key in CHOICES and isinstance(value, str) else value, *ALWAYS[key])
        elif key in DIFFERENTLY:
            t.note(key, DIFFERENTLY[key])
        elif key in REMOVED:
            t.ignore(key, REMOVED[key])
        elif key in NOT_HONOURED:
            if not (switched_off(value) or value is False or value is None):  # off asks for nothing
                t.ignore(key, NOT_HONOURED[key])
        elif key in own:
            t.set(key, value, key)
        else:
            t.unknown(key, value, [*TOP_LEVEL, *own], "at the top level, and it is no shardwise key either")
    if "data_types" in data:
        translate_data_types(t, data["data_types"])
    if "gradient_clipping" not in data:  # DeepSpeed 0.19 clips at 1.0 unless the config says otherwise
        t.set("gradient_clipping", DEFAULT_CLIPPING, "DeepSpeed's default when gradient_clipping is absent")
    return t


def as_distribution(data: Mapping[str, Any]) -> Distribution:
    """The translation in the form every config source ends in (sources.py); its problems as one ConfigError."""
    t = translate(data)
    if t.problems:
        raise ConfigError(t.problems)
    return Distribution(t.config, ignored=t.ignored)


def describe(t: Translation) -> str:
    """check-config's section: each shardwise key with the DeepSpeed key(s) it came from, then what is honoured in
    another way (how) and what is not honoured (why)."""
    lines = ["DeepSpeed config, translated:"]
    lines += [f"  {key} = {value!r}    <- {t.origin[key]}" for key, value in t.config.items()]
    for title, entries in (("honoured differently:", t.notes), ("not honoured:", t.ignored)):
        if entries:
            lines.append(title)
            lines += [f"  {key}: {why}" for key, why in entries]
    return "\n".join(lines)

