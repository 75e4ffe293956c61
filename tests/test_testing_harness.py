"""shardwise.testing: pooled multi-process worlds, loud failures, hard timeouts."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import DistributedTestError, distributed, run_distributed
from shardwise.testing._worker import _os_threads


def _all_reduce_rank_plus_one():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


def _rank_record(scale, offset=0.0):
    rank = dist.get_rank()
    return {"rank": rank, "value": torch.full((2,), rank * scale + offset)}


def _launch_env():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
    return {k: int(os.environ[k]) for k in keys} | {"pg_rank": dist.get_rank()}


def _set_env_var():
    os.environ["SHARDWISE_TEST_LEAK"] = "1"


def _get_env_var():
    return os.environ.get("SHARDWISE_TEST_LEAK")


def _print_and_fail_on_rank_one():
    print(f"printed by rank {dist.get_rank()}", flush=True)
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # blocked on a rank that will never arrive


def _exit_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _sleep_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(300)


def _init_mics():
    import shardwise as sw

    sw.init({"sharded_data_parallel_degree": 2})  # a mesh, with views flattened from it: a reference cycle


_KEPT_GROUPS = []


def _keep_groups(count):
    """Process groups a test leaves referenced: gloo's threads live on in the worker."""
    _KEPT_GROUPS.extend(dist.new_group() for _ in range(count))


@distributed(world_size=2)
def _rank_and_world():
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_over_ranks(world_size):
    expected = world_size * (world_size + 1) / 2
    assert run_distributed(_all_reduce_rank_plus_one, world_size) == [expected] * world_size


def test_results_are_ordered_by_rank_and_args_are_passed():
    results = run_distributed(_rank_record, 4, 10.0, offset=0.5)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["value"], torch.full((2,), rank * 10.0 + 0.5))


def test_env_simulates_two_nodes_of_two():
    envs = run_distributed(_launch_env, 4, nproc_per_node=2)
    seen = [(e["RANK"], e["pg_rank"], e["LOCAL_RANK"], e["GROUP_RANK"], e["NODE_RANK"])
            for e in envs]
    assert seen == [(0, 0, 0, 0, 0), (1, 1, 1, 0, 0), (2, 2, 0, 1, 1), (3, 3, 1, 1, 1)]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {(4, 2)}


def test_env_is_restored_after_a_call():
    run_distributed(_set_env_var, 2)
    assert run_distributed(_get_env_var, 2) == [None, None]


def test_pool_is_reused_across_calls():
    first = run_distributed(os.getpid, 2)
    assert len(set(first)) == 2 and os.getpid() not in first
    assert run_distributed(os.getpid, 2) == first


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts a worker's threads in /proc")
def test_a_calls_process_groups_end_with_it_and_their_threads_too():
    """Its meshes' reference cycle would keep the groups, and each group's polling threads, in an idle worker."""
    before = run_distributed(_os_threads, 4)
    for _ in range(2):
        run_distributed(_init_mics, 4)
    assert run_distributed(_os_threads, 4) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts a worker's threads in /proc")
def test_a_worker_left_holding_process_groups_is_replaced():
    pids = run_distributed(os.getpid, 2)
    run_distributed(_keep_groups, 2, 2)  # a few threads more: kept
    assert run_distributed(os.getpid, 2) == pids
    run_distributed(_keep_groups, 2, 10)  # thirty: the worker says so after the call, the next call reads it
    assert run_distributed(os.getpid, 2) == pids
    assert set(run_distributed(os.getpid, 2)).isdisjoint(pids)  # and the one after runs on a new pool


def test_output_is_quiet_on_success(capfd):
    run_distributed(print, 2, "hello from a worker", flush=True)
    out, err = capfd.readouterr()
    assert "hello from a worker" not in out + err


def test_exception_names_rank_and_message_and_pool_is_replaced():
    before = run_distributed(os.getpid, 2)
    with pytest.raises(DistributedTestError) as info:  # waiting for rank 0, blocked on rank 1, would time out
        run_distributed(_print_and_fail_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "did not finish within" not in message
    assert "_print_and_fail_on_rank_one failed on rank 1 of 2: ValueError: boom on rank 1" \
        in message
    assert 'raise ValueError("boom on rank 1")' in message  # the remote traceback
    assert "printed by rank 1" in message  # the rank's output tail
    assert info.value.rank == 1 and "ValueError: boom on rank 1" in info.value.tracebacks[1]
    assert not set(run_distributed(os.getpid, 2)) & set(before)  # fresh workers after a failure
    assert run_distributed(_all_reduce_rank_plus_one, 2) == [3.0, 3.0]


def test_dead_worker_is_reported_and_replaced():
    died = r"failed on rank 1 of 2: the worker process died \(exit code 3\)"
    with pytest.raises(DistributedTestError, match=died):
        run_distributed(_exit_on_rank_one, 2, timeout=60)
    assert run_distributed(_all_reduce_rank_plus_one, 2) == [3.0, 3.0]


def test_hang_raises_timeout_with_stacks_and_next_call_works():
    before = run_distributed(os.getpid, 2)
    with pytest.raises(TimeoutError) as info:
        run_distributed(_sleep_on_rank_zero, 2, timeout=2.0)
    message = str(info.value)
    assert ("_sleep_on_rank_zero did not finish within 2.0s on ranks [0] of 2; "
            "ranks [1] had returned and were waiting for them") in message
    if sys.platform != "win32":
        assert "in _sleep_on_rank_zero" in message  # rank 0's stack, dumped before the kill
    assert not set(run_distributed(os.getpid, 2)) & set(before)  # the sleeping worker was killed, not waited for
    assert run_distributed(_all_reduce_rank_plus_one, 2) == [3.0, 3.0]


def test_decorator_returns_results_by_rank():
    assert _rank_and_world() == [(0, 2), (1, 2)]


@distributed(world_size=2)
def test_decorated_test_runs_on_every_rank_with_fixtures(tmp_path):
    assert dist.get_world_size() == 2 and tmp_path.is_dir()


def test_bad_arguments_are_rejected_before_launch():
    with pytest.raises(TypeError, match="picklable fn and arguments .a module-level function."):
        run_distributed(lambda: None, 2)
    with pytest.raises(ValueError, match="nproc_per_node=3 must be a positive int dividing "
                                         "world_size=4"):
        run_distributed(os.getpid, 4, nproc_per_node=3)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        run_distributed(os.getpid, 0)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        run_distributed(os.getpid, 2, timeout=0)


_ORPHANING_PARENT = """
import os
from shardwise.testing import run_distributed
print(*run_distributed(os.getpid, 2), flush=True)
os._exit(0)  # no atexit: the workers must notice on their own
"""


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_parent_dies():
    out = subprocess.run([sys.executable, "-c", _ORPHANING_PARENT], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    pids = [int(p) for p in out.split()]
    for _ in range(600):  # a guard against a hang only: the workers poll for their parent
        if not any(map(_running, pids)):
            break
        time.sleep(0.2)
    assert not any(map(_running, pids))


_PRELOADING_PARENT = """
import sys
from shardwise.testing import preload, run_distributed

def loaded():
    return "wave" in sys.modules   # a standard module nothing here imports: there only if preloaded

if __name__ == "__main__":
    preload("wave")
    print(*run_distributed(loaded, 2), "wave" in sys.modules)
    try:
        preload("json.tool")
    except RuntimeError as e:
        print(e)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver")
def test_preloaded_modules_are_in_every_worker_and_preload_after_the_first_pool_is_refused(tmp_path):
    script = tmp_path / "preloading.py"
    script.write_text(_PRELOADING_PARENT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out[0] == "True True False"   # in the workers, not imported by the parent itself
    assert "must be called before the first run_distributed call" in out[1]


_CRASHING_TESTS = """
import os
import signal

import torch.distributed as dist

from shardwise.testing import run_distributed


def crash(marker, raise_instead):
    if dist.get_rank() == 1 and not os.path.exists(marker):
        if raise_instead:
            raise ValueError("a Python error")
        if marker != "always":
            open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def test_crashes_once():
    run_distributed(crash, 2, os.environ["CRASHED_ONCE"], False, timeout=60)  # outlives the rerun's tmp_path


def test_crashes_every_time():
    run_distributed(crash, 2, "always", False, timeout=60)


def test_raises(tmp_path):
    run_distributed(crash, 2, str(tmp_path / "raised"), True, timeout=60)
"""


def test_a_worker_crashed_by_a_signal_reruns_its_test_once_and_nothing_else_does(tmp_path):
    """The suite's configuration (pyproject.toml) reruns a test once when a rank's worker died by a native
    crash's signal; a crash that repeats, or a Python error, fails the test."""
    (tmp_path / "test_crashing.py").write_text(_CRASHING_TESTS)
    project = os.path.join(os.path.dirname(__file__), os.pardir, "pyproject.toml")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-c", project,
                          "--rootdir", str(tmp_path), str(tmp_path / "test_crashing.py")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CRASHED_ONCE": str(tmp_path / "crashed")})
    outcomes = {line.split("::")[-1].split()[0]: line.split()[0] for line in run.stdout.splitlines()
                if "::test_" in line and line.split()[0] in ("PASSED", "FAILED", "RERUN")}
    assert outcomes == {"test_crashes_once": "PASSED", "test_crashes_every_time": "FAILED",
                        "test_raises": "FAILED"}, run.stdout[-3000:]
    assert "2 failed, 1 passed, 2 rerun" in run.stdout, run.stdout[-3000:]
