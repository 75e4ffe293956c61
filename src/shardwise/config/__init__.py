"""One validated config tree with SMP key names, from a dict, JSON/YAML file or overrides."""

from .errors import ConfigError, Problem
from .schema import ShardwiseConfig, unavailable_features
from .sources import load_dict
from .validate import load_config, parse_config, refuse_unavailable

__all__ = ["ConfigError", "Problem", "ShardwiseConfig", "load_config", "load_dict", "parse_config",
           "refuse_unavailable", "unavailable_features"]
