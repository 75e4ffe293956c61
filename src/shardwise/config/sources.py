"""Where a config comes from: a dict, a JSON or YAML file, and `key=value` overrides.

Each may be a SageMaker estimator's whole `distribution` dict (`distribution.py`) or a
DeepSpeed config (`deepspeed.py`), told apart by their keys.
Every source ends as one plain dict of SMP keys; `validate.py` turns that into
a `ShardwiseConfig`. Reading errors (missing file, bad syntax) are `ConfigError`s
that carry the file and line.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

import yaml

from . import deepspeed
from .distribution import Distribution, is_distribution, parse_distribution
from .effects import IneffectiveSettingsWarning, notice_of
from ..errors import ConfigError, Problem
from .smp_forms import smp_value
from .smp_only import SmpOnlySettings

ConfigSource = Union[None, str, os.PathLike, Mapping[str, Any]]

# Set by `shardwise run` for every rank: the path of the validated config it was given.
CONFIG_ENV = "SHARDWISE_CONFIG"

# Keys whose value changes nothing in shardwise, whatever it is (see smp_only.py): a conflict on them is a note.
WITHOUT_EFFECT = frozenset({"skip_tracing", *SmpOnlySettings.model_fields,
                            *(f.alias for f in SmpOnlySettings.model_fields.values() if f.alias)})


def read_file(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """Parse a JSON (.json) or YAML (anything else) config file into a dict."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError([Problem("config", str(file), "file does not exist", "pass the path of a JSON or YAML config file")])
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as err:
            raise ConfigError([Problem(
                "config", str(file), f"malformed JSON at line {err.lineno}, column {err.colno}: {err.msg}",
                "correct the JSON syntax at that line")]) from None
    else:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            reason = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError([Problem(
                "config", str(file), f"malformed YAML{where}: {reason}", "correct the YAML syntax at that line")]) from None
    if not isinstance(data, dict):
        raise ConfigError([Problem("config", str(file), f"top level is a {type(data).__name__}, not a mapping",
                                   "write the config as key: value pairs")])
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with YAML scalar typing (true, 4, 0.5, null)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([Problem("--set", text, "override is not of the form key=value",
                                   "write it as e.g. --set sharded_data_parallel_degree=2")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def read_distribution(source: ConfigSource = None) -> Distribution:
    """A source (dict, path, or None) as a SageMaker `distribution` dict; a plain dict of config keys is its
    parameters, a DeepSpeed config its translation. What the source holds that changes nothing here is named
    once (the first rank, or the process that reads it alone)."""
    data = {} if source is None else dict(source) if isinstance(source, Mapping) else read_file(source)
    if deepspeed.is_deepspeed(data):
        distribution = deepspeed.as_distribution(data)
    elif is_distribution(data):
        distribution = parse_distribution(data, read_file)
    else:
        return Distribution(data)
    return _noticed(distribution)


def read_deepspeed(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config known to be DeepSpeed's (the one `deepspeed.initialize` is given) as shardwise keys, translated
    even where its keys alone would not tell (`{"train_batch_size": 8, "gradient_clipping": 0}`)."""
    return _noticed(deepspeed.as_distribution(data)).parameters


def _noticed(distribution: Distribution) -> Distribution:
    """Name what the source holds that changes nothing here, once (the first rank, or a process alone)."""
    notice = notice_of(distribution.ignored)
    if notice and os.environ.get("RANK", "0") == "0":
        warnings.warn(notice, IneffectiveSettingsWarning, stacklevel=4)
    return distribution


def load_dict(source: ConfigSource = None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Merge a source (dict, path, None, or a SageMaker `distribution` dict) with `key=value` overrides into one
    dict of config keys."""
    data = read_distribution(source).parameters
    for item in overrides:
        key, value = parse_override(item)
        data[key] = value
    return data


def merge_sources(given: Mapping[str, Any], launched: Mapping[str, Any],
                  where: str) -> tuple[dict[str, Any], list[Problem]]:
    """`init`'s own config over the launcher's (file `where`): keys either one sets are taken from it,
    equal values agree (also when one writes SMP's 0/1 or "true" for a boolean), and a key set to different
    values is a problem, never a silent winner. A key that changes nothing here either way (`skip_tracing`,
    SMP's internal and TensorFlow keys) cannot make training wrong: the launcher's value is kept, as SMP's
    estimator overrode the script, and rank 0 names the difference once."""
    differing = [key for key, value in given.items()
                 if key in launched and smp_value(key, launched[key]) != smp_value(key, value)]
    conflicts = [Problem(key, given[key], f"init() passes {given[key]!r} but the launcher's config ({where}) sets "
                         f"{launched[key]!r}", "give the key one value: drop it from init() or from the "
                         "`shardwise run` config, or make them equal")
                 for key in differing if key not in WITHOUT_EFFECT]
    overridden = [key for key in differing if key in WITHOUT_EFFECT]
    if overridden and os.environ.get("RANK", "0") == "0":
        warnings.warn("init() and the launcher's config (" + where + ") differ on " + ", ".join(
            f"{key} ({given[key]!r} vs {launched[key]!r})" for key in overridden) + ", which change nothing "
            "here; the launcher's values are kept; fix: make them equal to silence this", IneffectiveSettingsWarning,
            stacklevel=3)
    return {**launched, **{k: v for k, v in given.items() if k not in overridden}}, conflicts
