"""One validated config tree with SMP key names, from a dict, JSON/YAML file or overrides."""

from .effects import IneffectiveSettingsWarning, ineffective_notice, ineffective_settings
from ..errors import ConfigError, Problem
from .schema import ShardwiseConfig, unavailable_features
from .sources import load_dict, merge_sources
from .validate import config_problems, load_config, parse_config, unavailable_problems

__all__ = ["ConfigError", "IneffectiveSettingsWarning", "Problem", "ShardwiseConfig", "config_problems",
           "ineffective_notice", "ineffective_settings", "load_config", "load_dict", "merge_sources", "parse_config",
           "unavailable_features", "unavailable_problems"]
