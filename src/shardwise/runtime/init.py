"""`init` and `shutdown`: config → process group → layout → named DeviceMesh."""

from __future__ import annotations

import atexit
import gc
import os
import warnings
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..config import IneffectiveSettingsWarning, Problem, ShardwiseConfig, ineffective_settings, load_dict, merge_sources
from ..config.effects import ineffective_on_device
from ..config.effects import notice_of
from ..config.sources import CONFIG_ENV
from ..topology import Cluster
from ..config.decisions import Decisions
from ..config.layout import validate
from . import hang_report, state
from .agreement import check_same_config
from .devices import backend_for, local_device
from .launcher_store import attempt_key, connect
from ..parallel.mesh import ParallelMesh, forget_cached_meshes

ConfigLike = Union[None, str, os.PathLike, Mapping[str, Any], ShardwiseConfig]


def _freeze_at_exit() -> None:
    """Spare a rank's exit the last garbage collections over torch's objects (half a second of every rank, more
    on shared cores): Python does not promise to finalize what is alive at exit, and module teardown still frees
    what references hold. Registered first, so it runs after every other exit handler."""
    gc.freeze()


atexit.register(_freeze_at_exit)


def _config_data(config: ConfigLike) -> tuple[dict[str, Any], list[Problem]]:
    """init's own config merged with the one `shardwise run` wrote (which fills the keys init's leaves
    unset), and a problem for every key the two set differently."""
    given = config.model_dump(exclude_unset=True) if isinstance(config, ShardwiseConfig) else load_dict(config)
    launched = os.environ.get(CONFIG_ENV)
    if launched is None:
        return given, []
    return merge_sources(given, load_dict(launched), launched)


def _torchrun_world() -> bool:
    """True when torchrun's variables name a world to join; False for one process on its own."""
    if "WORLD_SIZE" not in os.environ:
        return False
    if "MASTER_ADDR" not in os.environ and os.environ["WORLD_SIZE"] != "1":
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but MASTER_ADDR is not, so this process "
                           "cannot join the other ranks; fix: start the ranks with `shardwise run` or torchrun, "
                           "or unset WORLD_SIZE to run one process")
    return "MASTER_ADDR" in os.environ


def _cluster() -> Cluster:
    """The world this process is about to join: a process group its caller made, torchrun's, or one process."""
    if not dist.is_initialized():
        return Cluster.from_env() if _torchrun_world() else Cluster()
    world = dist.get_world_size()
    cluster = Cluster.from_env()
    return cluster if cluster.world_size == world else Cluster(1, world)  # a caller's group: nodes unknown


def _attempt_store() -> Optional[dist.Store]:
    """The agent's store under this attempt's prefix when the ranks share it (as `shardwise run` and torchrun
    launch them), else None. That store outlives an attempt and torch adds no per-attempt prefix, so a restarted
    attempt's gloo would read the dead attempt's addresses there."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.PrefixStore(attempt_key("process_group"), connect(default_pg_timeout))


def _start_process_group(device: torch.device) -> bool:
    """Join torchrun's world, or make a one-process world, with the flight recorder on (hang reports need it);
    False when the caller already made one. Joining keeps torch's timeout: `collective_timeout_seconds` is set
    after, so that ranks slow to start are not taken for a hang."""
    if dist.is_initialized():
        return False
    hang_report.enable_flight_recorder()
    backend = backend_for(device)
    if _torchrun_world():
        device_id = device if device.type != "cpu" else None
        store = _attempt_store()
        if store is None:
            dist.init_process_group(backend, device_id=device_id)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


# What each front-end caller of a running runtime (a second DeepSpeed engine, a Trainer beside the script's own
# sw.init) chooses for itself; every other key shapes the process's one layout.
CALLER_KEYS = frozenset({"optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
                         "microbatches", "steps_per_print", "wall_clock_breakdown"})


def joined(data: Mapping[str, Any], why: str, fix: str) -> tuple[ShardwiseConfig, list[Problem]]:
    """`data` validated for the running world, and a problem for each layout key it sets otherwise than the runtime
    this process already runs (the rule `differs from the layout this process already runs (...)` + `why`)."""
    runtime = state.current()
    config, _ = validate(load_dict(data), runtime.cluster)
    mine = {key: value for key, value in config.model_dump().items() if key not in CALLER_KEYS}
    theirs = runtime.config.model_dump()
    return config, [Problem(key, mine[key], f"differs from the layout this process already runs ({theirs[key]!r})"
                            f"{why}", fix) for key in sorted(mine) if mine[key] != theirs[key]]


def warn_ineffective(found: list[tuple[str, str]]) -> None:
    """Rank 0 names the settings that change nothing here (once, not once per rank)."""
    notice = notice_of(found)
    if notice and dist.get_rank() == 0:
        warnings.warn(notice, IneffectiveSettingsWarning, stacklevel=3)


def init(config: ConfigLike = None) -> ShardwiseConfig:
    """Validate the config for this world, join the process group and build the named mesh.

    With no argument, takes the config `shardwise run` was given, else the defaults (pure
    data parallelism). A config given here under `shardwise run` is merged with the
    launcher's: keys only one sets come from it, and a key they set differently is an error
    (a note, keeping the launcher's value, for a key that changes nothing here).
    Every problem, the layout's included, is raised before the process group starts.
    Works in one process with no launcher.
    """
    if state.is_initialized():
        raise RuntimeError("shardwise.init() was already called in this process; call shardwise.shutdown() first")
    data, conflicts = _config_data(config)
    cluster = _cluster()
    resolved, layout = validate(data, cluster, conflicts)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = local_device(local_rank)
    owns = _start_process_group(device)
    check_same_config(resolved, device)
    warn_ineffective(ineffective_settings(resolved) + ineffective_on_device(resolved, device.type))
    decisions = Decisions(resolved, layout)
    mesh = ParallelMesh(device, layout, decisions.secondary_partition, decisions.expert_parallel_degree)
    hang_report.apply_timeout(resolved.collective_timeout_seconds)
    hang_report.start(dist.get_rank(), resolved.collective_timeout_seconds)
    state.set_current(state.Runtime(config=resolved, cluster=cluster, layout=layout, mesh=mesh, device=device,
                                    rank=dist.get_rank(), local_rank=local_rank, owns_process_group=owns))
    return resolved


def shutdown(wait: bool = True) -> None:
    """Forget the runtime and destroy the process group (also one a test harness made).

    With `wait`, parameter updates still in flight (ZeRO-1 overlaps them with the
    next forward) and an asynchronous checkpoint being written finish first: a
    process group must not be destroyed under pending collectives. A rank leaving after an error passes False, so that it never waits
    for peers that may not send.
    """
    if wait and state.is_initialized():
        for model in list(state.current().models):
            model.wait_for_parameters()
        state.current().wait_for_pending_save()
    state.set_current(None)
    hang_report.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_cached_meshes()
