"""shardwise tune across nodes: the same command on two "nodes" of this machine (node 0 at 127.0.0.1, one rank
each); node 0 plans and keeps the results, node 1 launches its share of each trial and reports it. Failures are
named (node 1's rank out of memory, every rank crashing), every rank's peak memory is kept, and with --run-after
both nodes train with the best config."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardwise.tune.measure import Measurement
from shardwise.tune.nodes import clear_stale, merge, outcome
from shardwise.tune.trial import TrialResult
from tune_scripts import TRAIN_SCRIPT

CLI = "import sys; from shardwise.cli import main; sys.exit(main())"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_tune_name_failures_from_either_node_and_train_with_the_best(tmp_path):
    (tmp_path / "tiny_nodes.py").write_text(textwrap.dedent(TRAIN_SCRIPT))
    port = _free_port()

    def node(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", CLI, "tune", "--model", "tiny_nodes:build", "--input-shape", "16", "--nnodes", "2",
             "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "--trials", "4",
             "--steps", "2", "--no-bound-stop", "--trial-timeout", "240", "--run-after", "tiny_nodes.py",
             "--inject-failures", "--steps", "3"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)

    follower, leader = node(1), node(0)
    out0, _ = leader.communicate(timeout=900)
    out1, _ = follower.communicate(timeout=120)
    assert leader.returncode == 0 and follower.returncode == 0, out0 + "\n" + out1
    rows = {r["config"].get("zero_stage"): r for r in map(json.loads, (tmp_path / "tune_results" / "trials.jsonl")
                                                          .read_text().splitlines())}
    assert rows[2]["failure"] == "out_of_memory" and "can't allocate memory" in rows[2]["message"]
    assert rows[3]["failure"] == "crash" and "injected crash under ZeRO-3" in rows[3]["message"]
    ddp = rows[None] if None in rows else next(r for r in rows.values() if not r["config"])
    assert ddp["failure"] is None and set(ddp["peak_memory_bytes"]) == {"0", "1"}
    assert "trial1: " in out1 and "trial4: crash" in out1
    best = json.loads((tmp_path / "tune_results" / "best_config.json").read_text())
    for rank in (0, 1):
        trained = json.loads((tmp_path / f"trained{rank}.json").read_text())
        assert trained["steps"] == 3 and all(trained["config"].get(k) == v for k, v in best.items())
    assert "--nnodes 2 --node-rank $NODE_RANK --master-addr 127.0.0.1" in \
        (tmp_path / "tune_results" / "best_cmd.txt").read_text()


def _result(failure=None, message=None, peaks=None, step=0.5):
    measurement = None if failure else Measurement(3, 2, step, 8.0, None, peaks or {})
    return TrialResult(run_dir=Path("trial1"), exit_code=0 if failure is None else 1,
                       seconds=1.0, measurement=measurement, failure=failure, message=message)


def test_a_trial_is_named_by_its_most_telling_failure_on_any_node():
    ok = _result(peaks={0: 10, 1: 11})
    peer_lost = _result("crash", "RuntimeError: Connection closed by peer")
    oom = {"failure": "out_of_memory", "message": "MemoryError", "peak_memory_bytes": {}, "exit_code": 1,
           "seconds": 1.0}
    merged = merge(peer_lost, {1: oom})
    assert (merged.failure, merged.message) == ("out_of_memory", "node 1: MemoryError")
    whole = merge(ok, {1: {"failure": "unmeasured", "message": "no step", "exit_code": 0, "seconds": 1.0,
                           "peak_memory_bytes": {"2": 12, "3": 13}}})
    assert whole.ok and whole.measurement.peak_memory_bytes == {0: 10, 1: 11, 2: 12, 3: 13}
    assert whole.measurement.step_time_s == 0.5
    silent = merge(ok, {1: None})
    assert silent.failure == "crash" and silent.message.startswith("node 1 sent no report")
    assert merge(_result("hang", "no end"), {1: {**oom, "failure": "crash", "message": "x"}}).failure == "crash"


def test_a_node_reports_its_ranks_peaks_from_its_run_directory(tmp_path):
    metrics = tmp_path / "trial1" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "rank3.jsonl").write_text(json.dumps({"step": 1, "memory": {"host_rss_bytes": 1234}}) + "\n")
    result = TrialResult(tmp_path / "trial1", 0, 1.0, failure="unmeasured", message="no step")
    assert outcome(result)["peak_memory_bytes"] == {"3": 1234}


def test_a_node_clears_only_what_an_earlier_run_left(tmp_path):
    """A trial directory from before this node's run goes; one written since (node 0's, on a shared file system,
    its clock up to a minute behind) stays."""
    import time

    since = time.time()
    old, new = tmp_path / "trial1", tmp_path / "trial2"
    for directory in (old, new):
        (directory / "metrics").mkdir(parents=True)
        (tmp_path / f"{directory.name}.config.json").write_text("{}")
    for path in (old, tmp_path / "trial1.config.json"):
        os.utime(path, (since - 3600, since - 3600))
    os.utime(new, (since - 30, since - 30))
    clear_stale(old, since)
    clear_stale(new, since)
    assert not old.exists() and not (tmp_path / "trial1.config.json").exists()
    assert new.exists() and (tmp_path / "trial2.config.json").exists()


def test_the_nodes_come_from_the_flags_or_a_hostfile_as_run_reads_them(tmp_path, capsys):
    from shardwise.cli import build_parser, main
    from shardwise.cli.tune import _launch_shape
    from shardwise.tune.trial import NodePlace

    (tmp_path / "hosts").write_text("localhost slots=2\nnode-b slots=2\n")
    script = tmp_path / "train.py"
    script.write_text("")
    parse = build_parser().parse_args
    assert _launch_shape(parse(["tune", "--model", "gpt2", str(script)])) == (1, None)
    assert _launch_shape(parse(["tune", "--model", "gpt2", "--hostfile", str(tmp_path / "hosts"), str(script)])) == \
        (2, NodePlace(nnodes=2, node_rank=0, master_addr="localhost", master_port=29500))
    assert _launch_shape(parse(["tune", "--model", "gpt2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "a",
                                "--master-port", "29611", "--nproc-per-node", "4", str(script)])) == \
        (4, NodePlace(nnodes=2, node_rank=1, master_addr="a", master_port=29611))
    assert main(["tune", "--model", "gpt2", "--nnodes", "2", "--node-rank", "1", str(script)]) == 2
    assert capsys.readouterr().err.strip() == ("shardwise tune: --nnodes=2 needs the rendezvous host; fix: pass "
                                               "--master-addr (the address of node 0) or --hostfile")


def test_the_nodes_come_from_a_slurm_job_as_run_reads_them(tmp_path, capsys, monkeypatch):
    """`srun shardwise tune ...` on every node: the shape from SLURM's variables, named on the console; flags win."""
    from shardwise.cli import build_parser
    from shardwise.cli.tune import _launch_shape
    from shardwise.tune.trial import NodePlace

    script = tmp_path / "train.py"
    script.write_text("")
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4",
                        "SLURM_JOB_NODELIST": "gpu[03-04]"}.items():
        monkeypatch.setenv(name, value)
    parse = build_parser().parse_args
    assert _launch_shape(parse(["tune", "--model", "gpt2", str(script)])) == \
        (4, NodePlace(nnodes=2, node_rank=1, master_addr="gpu03", master_port=29500))
    assert "shardwise tune: launch environment: SLURM" in capsys.readouterr().out
    assert _launch_shape(parse(["tune", "--model", "gpt2", "--nproc-per-node", "2", str(script)]))[0] == 2


def test_a_node_without_node_0_stops_in_one_line(capfd):
    from shardwise.tune.nodes import NodeChannel
    from shardwise.tune.trial import NodePlace

    with pytest.raises(ConnectionError) as caught:
        NodeChannel(NodePlace(2, 1, "127.0.0.1", _free_port()), connect_s=2)
    assert "node 1: no tuning node 0 at 127.0.0.1:" in str(caught.value) and "within 2 s" in str(caught.value)
    assert "--node-rank 0" in str(caught.value) and not capfd.readouterr().err  # no store client's retry logs
