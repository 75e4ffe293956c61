"""`shardwise run`: start a training script on every rank of a node through torchrun's own
agent (`torch.distributed.launcher.api.elastic_launch`), with the config validated first,
one log directory per rank, and a short report of the first rank that failed.

Modules: `spec` (flags → LaunchSpec → torch LaunchConfig), `hostfile` (DeepSpeed-style
hostfiles), `resources` (DeepSpeed's --include/--exclude/--num_nodes/--num_gpus selection),
`environment` (a scheduler's shape; the variable that picks a node's devices), `rundir` (run
directory and per-rank log layout), `failure` (failure summary), `runner` (the launch itself).
"""

from ..config.sources import CONFIG_ENV
from .errors import LaunchError
from .hostfile import Host, parse_hostfile_text, read_hostfile
from ..rundir import RUN_DIR_ENV, RunDir
from .runner import launch
from .spec import LaunchSpec, default_nproc_per_node, resolve

__all__ = ["CONFIG_ENV", "RUN_DIR_ENV", "Host", "LaunchError", "LaunchSpec", "RunDir", "default_nproc_per_node",
           "launch", "parse_hostfile_text", "read_hostfile", "resolve"]
