"""SMP v1's other spellings of shardwise's keys and values, turned into shardwise's before validation.

SMP configs come from SageMaker notebooks and scripts: `partitions` names the
pipeline degree, `pipeline: simple | interleaved` the schedule, `fp16_params`
is fp16's earlier name, `sdp_gradient_clipping` the clip of sharded data
parallelism, and values arrive as 0/1 for booleans or as strings ("4", "5e8",
"true"). Each is translated here, so the rest of the config code sees one
spelling; two spellings given different values is a problem, never a silent winner.
"""

from __future__ import annotations

from types import NoneType, UnionType
from typing import Any, Mapping, Optional, Union, get_args, get_origin

from ..errors import Problem
from .schema import ShardwiseConfig

_SCHEDULES = {"simple": "gpipe", "interleaved": "1f1b"}  # SMP's pipeline → the torch schedule of the same order
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


def _scalar_types() -> dict[str, type]:
    """Each bool, int or float key (optional or not) and its type."""
    types = {}
    for name, field in ShardwiseConfig.model_fields.items():
        kind = field.annotation
        if get_origin(kind) in (Union, UnionType):
            args = [arg for arg in get_args(kind) if arg is not NoneType]
            kind = args[0] if len(args) == 1 else None
        if kind in (bool, int, float):
            types[field.alias or name] = kind
    return types


_TYPES = _scalar_types()


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def smp_value(key: str, value: Any) -> Any:
    """`value` of `key` as the type shardwise validates, when SMP's configs write it another way; else unchanged
    (validation then names what is wrong)."""
    kind = _TYPES.get(key)
    if kind is bool:
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)
        return _BOOLEANS.get(value.lower(), value) if isinstance(value, str) else value
    if kind in (int, float) and not isinstance(value, bool):
        number = _number(value) if isinstance(value, str) else value
        if kind is int and isinstance(number, float) and number.is_integer():
            return int(number)
        if kind is float and isinstance(number, (int, float)):
            return float(number)
    return value


def translate(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """`data` in shardwise's spelling, and a problem for every pair of spellings that disagree."""
    out = {key: smp_value(key, value) for key, value in data.items()}
    problems: list[Problem] = []
    if "partitions" in out:
        _alias(out, problems, "partitions", "pipeline_parallel_degree", smp_value("pipeline_parallel_degree",
                                                                                   out.pop("partitions")))
    if "pipeline" in out:
        _pipeline(out, problems, out.pop("pipeline"))
    if out.get("fp16_params") is True:
        if out.get("bf16") is True:
            problems.append(Problem("fp16_params", True, "is SMP's earlier fp16, and bf16 and fp16 cannot both be on",
                                    "set only one of bf16 and fp16_params"))
        else:
            out["fp16"] = True  # SMP: parameters in fp16 whenever fp16 or fp16_params is set
    clip = out.get("sdp_gradient_clipping")
    if isinstance(clip, float) and clip > 0 and _sharded(out):
        _alias(out, problems, "sdp_gradient_clipping", "gradient_clipping", clip)
    return out, problems


def _pipeline(data: dict[str, Any], problems: list[Problem], value: Any) -> None:
    """SMP's `simple` pipeline runs every forward before any backward (gpipe); `interleaved` is any other schedule,
    1f1b unless pipeline_schedule names one."""
    if value not in _SCHEDULES:
        problems.append(Problem("pipeline", value, "is not one of SMP's pipelines", "use 'interleaved' or 'simple'"))
        return
    schedule = data.setdefault("pipeline_schedule", _SCHEDULES[value])
    if (value == "simple") != (schedule == "gpipe"):
        problems.append(Problem("pipeline", value, f"conflicts with pipeline_schedule={schedule!r} ('simple' is gpipe, "
                                "'interleaved' any other schedule)", "give only one of pipeline and pipeline_schedule"))


def _sharded(data: Mapping[str, Any]) -> bool:
    degree = data.get("sharded_data_parallel_degree", 1)
    return isinstance(degree, int) and degree > 1


def _alias(data: dict[str, Any], problems: list[Problem], smp: str, ours: str, value: Any) -> None:
    """Set `ours` to `value`, given under SMP's name `smp`; `ours` given another value is a problem."""
    if ours in data and data[ours] != value:
        problems.append(Problem(smp, value, f"conflicts with {ours}={data[ours]!r} (both set the same thing)",
                                f"give only one of {smp} and {ours}, or make them agree"))
        return
    data[ours] = value
