"""Optional packages a config asks for, looked up before any process starts.

A metrics sink whose package is missing would otherwise fail at the first
recorded step, after the launch. `find_spec` finds a package without importing
it, so validation stays cheap and torch-free.
"""

from __future__ import annotations

import importlib.util

from ..errors import Problem
from .schema import ShardwiseConfig

# The package each metrics sink needs (csv needs none), and the DeepSpeed section that turns the sink on.
SINK_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def package_problems(config: ShardwiseConfig) -> list[Problem]:
    """A problem for each sink in `metrics_sinks` whose package is not installed here (none while metrics_interval
    is 0: nothing is recorded then)."""
    if config.metrics_interval == 0:
        return []
    problems = []
    for sink in config.metrics_sinks:
        if sink in SINK_PACKAGES and not installed(SINK_PACKAGES[sink][0]):
            package, section = SINK_PACKAGES[sink]
            problems.append(Problem("metrics_sinks", config.metrics_sinks, f"the {sink} sink needs the {package} "
                                    "package, which is not installed", f"pip install {package}, or drop {sink} from "
                                    f"metrics_sinks (in a DeepSpeed config: {section}.enabled false)"))
    return problems
