"""`shardwise run` end to end: real ranks through torch's elastic agent, on this machine.

The rank scripts do not import torch, so each launch costs about a second.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from shardwise.cli import main

ENV_SCRIPT = """
import json, os, sys
rank = int(os.environ["RANK"])
with open(os.environ["SHARDWISE_CONFIG"]) as f:
    config = json.load(f)
print(json.dumps({"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]),
                  "world": int(os.environ["WORLD_SIZE"]), "run_dir": os.environ["SHARDWISE_RUN_DIR"],
                  "sdp": config.get("sharded_data_parallel_degree", 1), "args": sys.argv[1:]}))
print(f"stderr of rank {rank}", file=sys.stderr)
"""

FAIL_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} started", flush=True)
if rank == 1:
    for i in range(30):
        print(f"rank 1 progress {i}", file=sys.stderr)
    raise SystemExit("rank 1 gave up: loss is NaN")
time.sleep(60)
print("rank 0 slept to the end", flush=True)
"""


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_config_error_stops_before_any_rank_starts(tmp_path, capsys):
    script = _write(tmp_path, "train.py", ENV_SCRIPT)
    run_dir = tmp_path / "run"
    code = main(["run", "--nproc-per-node", "3", "--set", "sharded_data_parallel_degree=2",
                 "--run-dir", str(run_dir), script])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ("shardwise run: invalid shardwise config: sharded_data_parallel_degree=2: must divide the "
                   "data-parallel degree 3 (= world 3 / (tp 1 × pp 1)); fix: use a divisor of 3: 1, 3\n")
    assert not run_dir.exists()


def test_config_the_runtime_cannot_run_yet_stops_before_launch(tmp_path, capsys, monkeypatch):
    from shardwise.config import validate

    monkeypatch.setattr(validate, "unavailable_features", lambda config: [("offload_activations", True)])
    script = _write(tmp_path, "train.py", ENV_SCRIPT)
    code = main(["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), script])
    assert code == 2
    assert capsys.readouterr().err == ("shardwise run: invalid shardwise config: offload_activations=True: this "
                                       "feature is not available yet in this shardwise release; fix: remove the "
                                       "key (or set it to its default) for now\n")
    assert not (tmp_path / "run").exists()


def test_missing_script_exits_2_with_one_line(tmp_path, capsys):
    code = main(["run", "--nproc-per-node", "2", str(tmp_path / "nope.py")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "does not exist; fix: pass the path of the Python training script" in err


def test_two_ranks_get_config_env_and_their_own_log_files(tmp_path, capsys):
    script = _write(tmp_path, "train.py", ENV_SCRIPT)
    run_dir = tmp_path / "run"
    sigint = signal.getsignal(signal.SIGINT)
    code = main(["run", "--nproc-per-node", "2", "--set", "sharded_data_parallel_degree=2",
                 "--run-dir", str(run_dir), script, "--epochs", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    # Layout first, then rank 0's output echoed without a prefix; rank 1 only in its files.
    assert "layout: pp=1 × dp_replicate=1 × dp_shard=2 × tp=1" in out
    assert f"run dir: {run_dir}" in out
    echoed = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert echoed == {"rank": 0, "local_rank": 0, "world": 2, "run_dir": str(run_dir.resolve()), "sdp": 2,
                      "args": ["--epochs", "3"]}
    assert "stderr of rank 0" in err
    assert '"rank": 1' not in out and "stderr of rank 1" not in err
    rank1 = json.loads((run_dir / "logs/rank1/stdout.log").read_text())
    assert (rank1["rank"], rank1["local_rank"], rank1["sdp"]) == (1, 1, 2)
    assert (run_dir / "logs/rank1/stderr.log").read_text() == "stderr of rank 1\n"
    # Only the keys given: init() merges them with its own config, where a written default would conflict.
    assert json.loads((run_dir / "config.json").read_text()) == {"sharded_data_parallel_degree": 2}
    record = json.loads((run_dir / "launch-node0.json").read_text())
    assert (record["world_size"], record["exit_code"], record["layout"]["dp_shard"]) == (2, 0, 2)
    # The launch leaves the calling process as it found it.
    assert "SHARDWISE_CONFIG" not in os.environ and signal.getsignal(signal.SIGINT) is sigint


def test_failing_rank_sets_exit_code_and_shows_its_last_lines(tmp_path, capsys):
    script = _write(tmp_path, "train.py", FAIL_SCRIPT)
    run_dir = tmp_path / "run"
    code = main(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), script])
    out, err = capsys.readouterr()
    assert code == 1
    lines = err.splitlines()
    first = lines.index("shardwise run: rank 1 (node 0, local rank 1) failed first (exit code 1)")
    assert lines[first + 1] == f"last 20 lines of {run_dir / 'logs/rank1/stderr.log'}:"
    shown = lines[first + 2:first + 22]
    assert shown[0] == "  | rank 1 progress 11" and shown[-1] == "  | rank 1 gave up: loss is NaN"
    assert "also failed: rank 0 (killed by SIGTERM)" in err
    assert "Traceback" not in err and "ChildFailedError" not in err
    assert "rank 0 started" in out and "rank 1 started" not in out
    assert "slept to the end" not in out  # rank 0 was stopped in its sleep, not waited for


def test_exit_code_of_the_failing_rank_is_passed_through(tmp_path, capsys):
    script = _write(tmp_path, "train.py", "import os, sys\nsys.exit(3 if os.environ['RANK'] == '0' else 0)\n")
    assert main(["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), script]) == 3
    assert "rank 0 (node 0, local rank 0) failed first (exit code 3)" in capsys.readouterr().err


def _cli(*args, **kwargs):
    code = "import sys; from shardwise.cli import main; sys.exit(main())"
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_ctrl_c_stops_every_rank(tmp_path):
    script = _write(tmp_path, "train.py", """
        import os, time
        print(os.getpid(), flush=True)
        time.sleep(120)
    """)
    run_dir = tmp_path / "run"
    proc = _cli("run", "--nproc-per-node", "2", "--run-dir", str(run_dir), script)
    logs = [run_dir / f"logs/rank{r}/stdout.log" for r in range(2)]
    while not all(p.is_file() and p.read_text().strip() for p in logs):  # the ranks end their sleep in any case
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in logs]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "shardwise run: got SIGINT; stopped all ranks on node 0" in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_one_machine_number_ranks_by_node_rank(tmp_path):
    script = _write(tmp_path, "train.py", ENV_SCRIPT)
    run_dir = tmp_path / "run"
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(_free_port()), "--run-dir", str(run_dir)]
    node1 = _cli("run", *common, "--node-rank", "1", script)
    node0 = _cli("run", *common, "--node-rank", "0", script)
    out0, err0 = node0.communicate(timeout=120)
    out1, err1 = node1.communicate(timeout=120)
    assert node0.returncode == 0 and node1.returncode == 0, err0 + err1
    assert "crosses nodes" in out0 and "layout:" not in out1
    assert f"node 1/2: ranks 2-3; their output: {run_dir / 'logs'}/rank<R>/" in out1
    for rank in range(4):
        record = json.loads((run_dir / f"logs/rank{rank}/stdout.log").read_text())
        assert (record["rank"], record["local_rank"], record["world"]) == (rank, rank % 2, 4)
