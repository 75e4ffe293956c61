"""The SageMaker estimator's `distribution` dict, taken as is.

    {"smdistributed": {"modelparallel": {"enabled": true, "parameters": {...}}},
     "mpi": {"enabled": true, "processes_per_host": 8, "custom_mpi_options": "..."}}

The parameters are the config, as SageMaker passes them to SMP: only when
`enabled` is true (SageMaker's rule; a path to a JSON file works too, as in the
SageMaker SDK). `mpi.processes_per_host` is `shardwise run`'s default processes
per node. What only SageMaker's MPI launcher used is named once, with what
shardwise does instead; a key SageMaker would not take is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..errors import ConfigError, Problem

_TORCHRUN = "shardwise run (or torchrun) starts the processes, not MPI"
_TRUE = (True, 1, "true", "True")  # SageMaker's notebooks write the flags these ways


@dataclass(frozen=True)
class Distribution:
    """What a `distribution` dict says: the config keys, the processes per node, and what is ignored."""

    parameters: dict[str, Any]
    processes_per_host: Optional[int] = None
    ignored: list[tuple[str, str]] = field(default_factory=list)


def is_distribution(data: Mapping[str, Any]) -> bool:
    return isinstance(data.get("smdistributed"), Mapping) or isinstance(data.get("mpi"), Mapping)


def parse_distribution(data: Mapping[str, Any], read: Callable[[str], dict[str, Any]]) -> Distribution:
    """The parts of a `distribution` dict; `read` reads a parameters file. Raises one ConfigError for all problems."""
    problems = [Problem(key, value, "sits beside smdistributed, so the SageMaker form would drop it",
                        "move it into smdistributed.modelparallel.parameters")
                for key, value in data.items() if key not in ("smdistributed", "mpi")]
    smdistributed = _section(data, "smdistributed", "smdistributed", problems)
    problems += [Problem(f"smdistributed.{key}", value, "is another SageMaker library than model parallelism",
                         "drop it; shardwise takes smdistributed.modelparallel")
                 for key, value in smdistributed.items() if key != "modelparallel"]
    modelparallel = _section(smdistributed, "modelparallel", "smdistributed.modelparallel", problems)
    problems += [Problem(f"smdistributed.modelparallel.{key}", value, "is not a key SageMaker takes here",
                         "keep enabled and parameters only")
                 for key, value in modelparallel.items() if key not in ("enabled", "parameters")]
    mpi = _section(data, "mpi", "mpi", problems)
    per_host = mpi.get("processes_per_host")
    if per_host is not None and not (isinstance(per_host, int) and not isinstance(per_host, bool) and per_host > 0):
        problems.append(Problem("mpi.processes_per_host", per_host, "must be a positive integer",
                                "give the number of processes (devices) per node, e.g. 8"))
    parameters = modelparallel.get("parameters", {})
    if not isinstance(parameters, (Mapping, str)):
        problems.append(Problem("smdistributed.modelparallel.parameters", parameters,
                                "is neither a dict of config keys nor the path of a JSON file of them",
                                "give the config keys as a dict"))
    if problems:
        raise ConfigError(problems)
    ignored = _ignored(modelparallel, mpi)
    enabled = modelparallel.get("enabled", False) in _TRUE
    if not enabled or not parameters:
        return Distribution({}, per_host, ignored)
    return Distribution(read(parameters) if isinstance(parameters, str) else dict(parameters), per_host, ignored)


def _section(data: Mapping[str, Any], key: str, path: str, problems: list[Problem]) -> Mapping[str, Any]:
    """`data[key]`, a dict (empty when absent); anything else is a problem."""
    section = data.get(key, {})
    if isinstance(section, Mapping):
        return section
    problems.append(Problem(path, section, "must be a dict", f"write {path} as a dict of its keys"))
    return {}


def _ignored(modelparallel: Mapping[str, Any], mpi: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, what shardwise does instead) for every part of the dict that changes nothing here."""
    ignored = []
    if modelparallel.get("enabled", False) not in _TRUE and modelparallel.get("parameters"):
        ignored.append(("smdistributed.modelparallel.parameters", "enabled is not true, so SageMaker would not pass "
                        "them either; set smdistributed.modelparallel.enabled to true to use them"))
    if "enabled" in mpi and mpi["enabled"] not in _TRUE:
        ignored.append(("mpi.enabled", f"{_TORCHRUN}, processes_per_host of them on each node"))
    ignored += [(f"mpi.{key}", _TORCHRUN) for key, value in mpi.items()
                if key not in ("enabled", "processes_per_host") and value]
    return ignored
