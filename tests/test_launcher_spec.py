"""`shardwise run` without starting processes: hostfiles, flag resolution, log layout, failure summary."""

import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardwise.cli import build_parser
from shardwise.config import ConfigError
from shardwise.launcher import LaunchError, RunDir, parse_hostfile_text, resolve
from shardwise.launcher.failure import format_failure, rank_failures, tail
from shardwise.launcher.hostfile import Host, node_rank_of, slots_per_node
from shardwise.rundir import RankLogsSpecs, default_run_dir
from shardwise.launcher.spec import line_prefix_template, parse_console_ranks, rendezvous


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


# --- hostfile -------------------------------------------------------------------------------

def test_hostfile_parses_hosts_in_order_skipping_comments():
    text = "# cluster\nworker-1 slots=4\n\n  worker-2  slots = 4   # second node\n"
    assert parse_hostfile_text(text) == [Host("worker-1", 4), Host("worker-2", 4)]


@pytest.mark.parametrize("text, message", [
    ("worker-1\n", "line 1: 'worker-1' is not 'HOST slots=N'"),
    ("a slots=4\nb slots=four\n", "line 2: slots=four must be a positive integer"),
    ("a slots=0\n", "slots=0 must be a positive integer"),
    ("a slots=2\na slots=2\n", "host 'a' is listed twice"),
    ("# nothing\n\n", "lists no hosts"),
])
def test_hostfile_errors_name_the_line_and_the_fix(text, message):
    with pytest.raises(LaunchError, match="fix:") as err:
        parse_hostfile_text(text, source="hostfile h.txt")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_hostfile_needs_the_same_slots_on_every_node():
    with pytest.raises(LaunchError, match=r"different slots \(a=4, b=2\)"):
        slots_per_node([Host("a", 4), Host("b", 2)])


def test_node_rank_comes_from_the_local_hostname():
    hosts = [Host("node-a.cluster", 2), Host("node-b.cluster", 2)]
    assert node_rank_of(hosts, names={"node-b"}) == 1
    assert node_rank_of(hosts, names={"node-a.cluster"}) == 0
    with pytest.raises(LaunchError, match="is not listed; fix: run on a listed host, or pass --node-rank"):
        node_rank_of(hosts, names={"elsewhere"})


def test_resolve_takes_shape_master_and_node_rank_from_the_hostfile(script, tmp_path, monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    monkeypatch.setattr(socket, "getfqdn", lambda: "node-b.cluster")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\nnode-c slots=2\n")
    spec = resolve(script, hostfile=str(hostfile))
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank, spec.master_addr) == (3, 2, 1, "node-a")
    assert [spec.global_rank(lr) for lr in range(2)] == [2, 3]
    explicit = resolve(script, hostfile=str(hostfile), node_rank=2, master_addr="10.0.0.1")
    assert (explicit.node_rank, explicit.master_addr) == (2, "10.0.0.1")
    with pytest.raises(LaunchError, match=r"--nproc-per-node=4 disagrees with hostfile .* \(2\)"):
        resolve(script, hostfile=str(hostfile), nproc_per_node=4)


def test_single_host_hostfile_runs_locally(script, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=3\n")
    spec = resolve(script, hostfile=str(hostfile))
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank) == (1, 3, 0)
    assert rendezvous(spec)["rdzv_backend"] == "c10d"


def test_missing_hostfile(script):
    with pytest.raises(LaunchError, match="hostfile 'nope' does not exist"):
        resolve(script, hostfile="nope")


# --- flags → spec ---------------------------------------------------------------------------

def test_missing_script_is_one_line_with_a_fix():
    with pytest.raises(LaunchError) as err:
        resolve("no_such_script.py", nproc_per_node=2)
    assert str(err.value) == ("script 'no_such_script.py' does not exist; "
                              "fix: pass the path of the Python training script")


def test_defaults_one_node_and_one_process_per_accelerator(script, monkeypatch):
    from shardwise.launcher import spec as spec_module

    monkeypatch.setattr(spec_module, "default_nproc_per_node", lambda: 3)
    spec = resolve(script)
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank, spec.console_ranks) == (1, 3, 0, {0})


@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes=2, node_rank=2, master_addr="a"), "--node-rank=2 must be in 0..1 for --nnodes=2"),
    (dict(nnodes=2, node_rank=1), "--nnodes=2 needs the rendezvous host; fix: pass --master-addr"),
    (dict(master_port=70000), "--master-port=70000 is not a TCP port"),
    (dict(console_ranks="zero"), "--console-ranks='zero' is not a list of ranks"),
])
def test_bad_flags(script, kwargs, message):
    with pytest.raises(LaunchError, match="fix") as err:
        resolve(script, nproc_per_node=2, **kwargs)
    assert message in str(err.value)


def test_non_positive_sizes_are_config_errors(script):
    with pytest.raises(ConfigError, match="nproc_per_node=0: must be a positive integer"):
        resolve(script, nproc_per_node=0)


def test_console_ranks_are_global_and_map_to_this_nodes_local_ranks(script):
    assert parse_console_ranks("all") is None and parse_console_ranks("none") == frozenset()
    node1 = resolve(script, nnodes=2, node_rank=1, nproc_per_node=4, master_addr="a", console_ranks="0,5,6")
    assert node1.console_local_ranks() == {1, 2}
    assert line_prefix_template(node1) == "[rank${rank}]: "
    node0 = resolve(script, nnodes=2, node_rank=0, nproc_per_node=4, master_addr="a")
    assert node0.console_local_ranks() == {0}
    assert line_prefix_template(node0) == ""


def test_rendezvous_local_c10d_or_static_at_the_master(script):
    local = rendezvous(resolve(script, nproc_per_node=2))
    assert (local["rdzv_backend"], local["rdzv_endpoint"]) == ("c10d", "localhost:0")
    multi = rendezvous(resolve(script, nnodes=2, node_rank=1, nproc_per_node=2, master_addr="10.1.2.3",
                               master_port=1234))
    assert multi == {"rdzv_backend": "static", "rdzv_endpoint": "10.1.2.3:1234", "run_id": "shardwise",
                     "rdzv_configs": {"rank": 1}}


def test_cli_passes_everything_after_the_script_to_it():
    args = build_parser().parse_args(["run", "--nproc-per-node", "2", "--set", "microbatches=2", "train.py",
                                      "--nproc-per-node", "5", "--lr", "1e-3"])
    assert (args.nproc_per_node, args.overrides, args.script) == (2, ["microbatches=2"], "train.py")
    assert args.script_args == ["--nproc-per-node", "5", "--lr", "1e-3"]


# --- run directory and per-rank logs --------------------------------------------------------

def test_default_run_dir_is_timestamped_and_unique(tmp_path):
    first = default_run_dir(Path("my_train.py"), root=tmp_path)
    assert first.parent == tmp_path and first.name.endswith("-my_train")
    first.mkdir()
    second = default_run_dir(Path("my_train.py"), root=tmp_path)
    assert second != first and second.name.startswith(first.name)


def test_logs_are_laid_out_by_global_rank_and_only_console_ranks_are_teed(tmp_path):
    run_dir = RunDir(tmp_path / "run").create()
    stale = run_dir.error_file(6)
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    envs = {lr: {"RANK": str(4 + lr), "TORCHELASTIC_RESTART_COUNT": "0"} for lr in range(4)}
    dest = RankLogsSpecs(run_dir, console_local_ranks={0}).reify(envs)
    assert dest.stdouts[2] == str(tmp_path / "run/logs/rank6/stdout.log")
    assert dest.stderrs[3] == str(tmp_path / "run/logs/rank7/stderr.log")
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "run/logs/rank5/error.json")
    assert set(dest.tee_stdouts) == set(dest.tee_stderrs) == {0}
    assert not stale.exists()
    restart = RankLogsSpecs(run_dir).reify({0: {"RANK": "4", "TORCHELASTIC_RESTART_COUNT": "2"}})
    assert restart.stdouts[0] == str(tmp_path / "run/logs/attempt2/rank4/stdout.log")
    assert restart.tee_stdouts == {}


# --- failure summary ------------------------------------------------------------------------

def _failure(local_rank, exitcode, timestamp):
    return SimpleNamespace(local_rank=local_rank, exitcode=exitcode, timestamp=timestamp)


def test_first_failure_is_the_rank_that_raised_not_its_peers(tmp_path):
    run_dir = RunDir(tmp_path).create()
    for rank in range(3):
        run_dir.rank_dir(rank).mkdir(parents=True)
        run_dir.stdout(rank).write_text(f"rank {rank} started\n")
    run_dir.stderr(2).write_text("".join(f"line {i}\n" for i in range(30)) + "ValueError: boom\n")
    time.sleep(0.02)
    run_dir.stderr(0).write_text("RuntimeError: Connection closed by peer\n")  # written after rank 2's
    failures = {0: _failure(0, 1, 100), 1: _failure(1, -signal.SIGTERM, 100), 2: _failure(2, 1, 100)}
    ordered = rank_failures(failures, run_dir)
    assert [f.rank for f in ordered] == [2, 0, 1]
    first = ordered[0]
    assert first.tail[-1] == "ValueError: boom" and len(first.tail) == 20
    assert first.shell_exit_code == 1 and ordered[2].shell_exit_code == 143
    spec = resolve(__file__, nproc_per_node=3)
    text = format_failure(ordered, spec)
    assert text.splitlines()[0] == "shardwise run: rank 2 (node 0, local rank 2) failed first (exit code 1)"
    assert "  | ValueError: boom" in text
    assert "also failed: rank 0 (exit code 1), rank 1 (killed by SIGTERM)" in text


def test_a_crash_by_signal_counts_and_an_earlier_stamp_wins(tmp_path):
    run_dir = RunDir(tmp_path).create()
    failures = {0: _failure(0, -signal.SIGTERM, 101), 1: _failure(1, 1, 101), 3: _failure(3, -signal.SIGABRT, 100)}
    ordered = rank_failures(failures, run_dir)
    assert [f.rank for f in ordered] == [3, 1, 0]
    assert ordered[0].cause() == "killed by SIGABRT" and ordered[0].shell_exit_code == 134
    assert ordered[0].tail == []


def test_tail_reads_only_the_end(tmp_path):
    log = tmp_path / "big.log"
    log.write_text("".join(f"{i}\n" for i in range(100_000)))
    assert tail(log, 3) == ["99997", "99998", "99999"]
    assert tail(tmp_path / "missing.log") == []
