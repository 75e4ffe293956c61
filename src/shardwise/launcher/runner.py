"""`launch`: validate, lay out the run directory, hand the ranks to torch's elastic agent,
and turn its outcome into an exit code and a short report."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import sys
import time
from typing import Any, Iterator, Mapping, Optional, TextIO

from ..config.sources import CONFIG_ENV
from ..config.layout import validate
from ..config.describe import describe_layout
from .failure import format_failure, preemption_line, rank_failures
from .leftovers import LAUNCH_ID_ENV, new_launch_id, start_reaper, stop_leftovers
from ..rundir import PREEMPTED_EXIT_CODE, RUN_DIR_ENV, RankLogsSpecs, RunDir, default_run_dir
from .spec import LaunchSpec, entrypoint, launch_config, rendezvous

# torch's agent logs restarts, SIGTERMs and its own ChildFailedError report; they go to
# logs/agent-node<K>.log so the console shows the ranks' output and our summary only.
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
_HANDLED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
STOP_MARGIN_SECONDS = 10  # beyond preemption_grace_seconds, for the ranks to exit after saving


def stop_seconds(config) -> int:
    """How long torch's agent waits for the ranks it stopped before it kills them: torch's 30 s, or the
    preemption grace period and a margin when a preempted job saves a checkpoint."""
    if config.checkpoint_dir is None:
        return 30
    return math.ceil(config.preemption_grace_seconds) + STOP_MARGIN_SECONDS


def worker_env(spec: LaunchSpec, run_dir: RunDir, launch_id: str) -> dict[str, str]:
    """What every rank gets besides torchrun's RANK/WORLD_SIZE/MASTER_*: where its config and
    run directory are, the launch's id, a thread count that does not oversubscribe the node's cores, and the
    devices DeepSpeed's selection flags picked."""
    env = {CONFIG_ENV: str(run_dir.config.resolve()), RUN_DIR_ENV: str(run_dir.root.resolve()),
           LAUNCH_ID_ENV: launch_id}
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // spec.nproc_per_node))
    env.update(spec.device_env)  # DeepSpeed's --include/--exclude/--num_gpus picked this node's devices
    return env


@contextlib.contextmanager
def _patched_environ(extra: dict[str, str]) -> Iterator[None]:
    """The agent hands os.environ to the ranks; set ours for the launch, then put it back."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _agent_logs_to(path) -> Iterator[None]:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in _AGENT_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


@contextlib.contextmanager
def _restored_signal_handlers() -> Iterator[None]:
    """The agent installs handlers that turn Ctrl-C into a clean stop of every rank; they must
    not outlive the launch when `launch` is called from a longer-lived program."""
    signums = [getattr(signal, name) for name in _HANDLED_SIGNALS if hasattr(signal, name)]
    try:
        saved = {s: signal.getsignal(s) for s in signums}
    except ValueError:
        saved = {}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)


def _launch_record(spec: LaunchSpec, layout) -> dict:
    cmd, args = entrypoint(spec)
    rdzv = rendezvous(spec)
    return {
        "argv": sys.argv, "command": [cmd, *args], "hostname": socket.gethostname(),
        "nnodes": spec.nnodes, "nproc_per_node": spec.nproc_per_node, "node_rank": spec.node_rank,
        "world_size": spec.world_size, "ranks": [spec.global_rank(lr) for lr in range(spec.nproc_per_node)],
        "layout": layout.degrees(), "rendezvous": {"backend": rdzv["rdzv_backend"], "endpoint": rdzv["rdzv_endpoint"]},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def launch(spec: LaunchSpec, data: Mapping[str, Any], *, out: Optional[TextIO] = None,
           err: Optional[TextIO] = None) -> int:
    """Run `spec.script` on this node's ranks; return the exit code the CLI should exit with.

    `data` is a dict of config keys, checked by the validation `shardwise.init()` makes on
    every rank: a ConfigError with every problem, the cluster shape's included, before anything starts.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    config, layout = validate(data, spec.cluster)
    run_dir = RunDir(spec.run_dir or default_run_dir(spec.script)).create()
    run_dir.write_config(config)
    record = _launch_record(spec, layout)
    run_dir.write_launch(spec.node_rank, record)
    if spec.node_rank == 0:
        print(describe_layout(config, layout, spec.cluster), file=out)
        print(f"run dir: {run_dir.root}  (each rank's output: logs/rank<R>/stdout.log, stderr.log)", file=out)
        out.flush()
    else:
        ranks = record["ranks"]
        print(f"node {spec.node_rank}/{spec.nnodes}: ranks {ranks[0]}-{ranks[-1]}; "
              f"their output: {run_dir.logs}/rank<R>/", file=out, flush=True)

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    logs = RankLogsSpecs(run_dir, spec.console_local_ranks())
    cmd, args = entrypoint(spec)
    start = time.monotonic()
    code = 0
    launch_id = new_launch_id()
    reaper = start_reaper(launch_id, stop_seconds(config))
    try:
        with _patched_environ(worker_env(spec, run_dir, launch_id)), \
                _agent_logs_to(run_dir.agent_log(spec.node_rank)), _restored_signal_handlers():
            elastic_launch(launch_config(spec, logs, stop_seconds(config)), cmd)(*args)
    except ChildFailedError as failure:
        failed = rank_failures(failure.failures, run_dir, attempt=logs.attempts - 1)
        preempted = preemption_line(run_dir, spec, logs.attempts - 1)
        if preempted and all(f.exitcode == PREEMPTED_EXIT_CODE for f in failed):
            print(preempted, file=err)
            code = PREEMPTED_EXIT_CODE
        else:
            print(format_failure(failed, spec), file=err)
            code = failed[0].shell_exit_code or 1
    except SignalException as stop:
        preempted = preemption_line(run_dir, spec, logs.attempts - 1)
        print(preempted or f"shardwise run: got {stop.sigval.name}; stopped all ranks on node {spec.node_rank}",
              file=err)
        code = PREEMPTED_EXIT_CODE if preempted else 128 + int(stop.sigval)
    except KeyboardInterrupt:
        print(f"shardwise run: interrupted; stopped all ranks on node {spec.node_rank}", file=err)
        code = 130
    except RendezvousError as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(f"shardwise run: rendezvous at {record['rendezvous']['endpoint']} failed: {first_line}; "
              f"fix: start every node with the same --nnodes and --master-addr/--master-port", file=err)
        code = 1
    finally:
        reaper.kill()
        reaper.wait()
        left = stop_leftovers(launch_id)
        if left:
            print(f"shardwise run: stopped {len(left)} process(es) the ranks left behind: {left}", file=err)
        err.flush()
        out.flush()
    record.update(exit_code=code, attempts=logs.attempts, left_behind=left, seconds=round(time.monotonic() - start, 3))
    run_dir.write_launch(spec.node_rank, record)
    return code
