"""Where a config comes from: a dict, a JSON or YAML file, and `key=value` overrides.

Every source ends as one plain dict of SMP keys; `validate.py` turns that into
a `ShardwiseConfig`. Reading errors (missing file, bad syntax) are `ConfigError`s
that carry the file and line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

import yaml

from .errors import ConfigError, Problem

ConfigSource = Union[None, str, os.PathLike, Mapping[str, Any]]

# Set by `shardwise run` for every rank: the path of the validated config it was given.
CONFIG_ENV = "SHARDWISE_CONFIG"

# The SageMaker estimator nests the same keys under this path; accept it as is.
_SAGEMAKER_PATH = ("smdistributed", "modelparallel", "parameters")


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


def unwrap_sagemaker(data: Mapping[str, Any]) -> dict[str, Any]:
    """Accept a SageMaker `distribution` dict by taking its model-parallel parameters; refuse what taking
    them alone would silently drop: keys beside `smdistributed` (its `mpi` section is SageMaker's launcher's)
    and `enabled: false`."""
    node: Any = data
    for key in _SAGEMAKER_PATH:
        if not isinstance(node, Mapping) or key not in node:
            return dict(data)
        node = node[key]
    problems = [Problem(key, value, "sits beside smdistributed, so the SageMaker form would drop it",
                        "move it into smdistributed.modelparallel.parameters")
                for key, value in data.items() if key not in (_SAGEMAKER_PATH[0], "mpi")]
    enabled = data[_SAGEMAKER_PATH[0]][_SAGEMAKER_PATH[1]].get("enabled", True)
    if enabled is not True:
        problems.append(Problem("smdistributed.modelparallel.enabled", enabled,
                                "turns model parallelism off, yet its parameters would apply",
                                "set it to true, or pass no config for plain data parallelism"))
    if problems:
        raise ConfigError(problems)
    return dict(node)


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


def load_dict(source: ConfigSource = None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Merge a source (dict, path, or None) with `key=value` overrides into one dict."""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_file(source)
    data = unwrap_sagemaker(data)
    for item in overrides:
        key, value = parse_override(item)
        data[key] = value
    return data


def merge_sources(given: Mapping[str, Any], launched: Mapping[str, Any],
                  where: str) -> tuple[dict[str, Any], list[Problem]]:
    """`init`'s own config over the launcher's (file `where`): keys either one sets are taken from it,
    equal values agree, and a key set to different values is a problem, never a silent winner."""
    conflicts = [Problem(key, value, f"init() passes {value!r} but the launcher's config ({where}) sets "
                         f"{launched[key]!r}", "give the key one value: drop it from init() or from the "
                         "`shardwise run` config, or make them equal")
                 for key, value in given.items() if key in launched and launched[key] != value]
    return {**launched, **given}, conflicts
