"""`shardwise check-config`: validates a config for a cluster shape without starting anything, prints
the layout (degrees and the ranks of every group) or every error, and exits non-zero on error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from shardwise.cli import main


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["check-config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_mics_on_two_nodes_prints_degrees_and_groups(tmp_path, capsys):
    config = tmp_path / "mics.yaml"
    config.write_text("sharded_data_parallel_degree: 4\nmicrobatches: 2\nbf16: true\n")
    code, out, err = _check(capsys, str(config), "--nproc-per-node", "4", "--nnodes", "2")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "cluster: 2 node(s) × 4 device(s) = 8 ranks",
        "layout: pp=1 × dp_replicate=2 × dp_shard=4 × tp=1",
        "data parallel: MiCS / ZeRO-2D (ZeRO-3 in partition groups of 4, 2 replicas); precision: bf16; "
        "microbatches: 2",
        "dp_shard groups (ZeRO partition, inside nodes): [0,1,2,3] [4,5,6,7]",
        "dp_replicate groups (MiCS replicas, gradient all-reduce only, crosses nodes): [0,4] [1,5] [2,6] [3,7]",
        "rdp groups (reduced data parallel: ranks with the same TP shard, crosses nodes): [0,1,2,3,4,5,6,7]",
    ]


@pytest.mark.parametrize("overrides, strategy, layout", [
    ([], "DDP", "pp=1 × dp_replicate=4 × dp_shard=1 × tp=1"),
    (["shard_optimizer_state=true"], "ZeRO-1 (optimizer state sharding)",
     "pp=1 × dp_replicate=4 × dp_shard=1 × tp=1"),
    (["zero_stage=2", "sharded_data_parallel_degree=4"], "ZeRO-2", "pp=1 × dp_replicate=1 × dp_shard=4 × tp=1"),
    (["sharded_data_parallel_degree=4"], "ZeRO-3", "pp=1 × dp_replicate=1 × dp_shard=4 × tp=1"),
    (["tensor_parallel_degree=2"], "DDP", "pp=1 × dp_replicate=2 × dp_shard=1 × tp=2"),
])
def test_each_strategy_is_named(capsys, overrides, strategy, layout):
    code, out, _ = _check(capsys, "--nproc-per-node", "4", *[f"--set={o}" for o in overrides])
    assert code == 0
    assert f"layout: {layout}" in out
    assert f"data parallel: {strategy};" in out


def test_tensor_parallel_groups_are_consecutive_ranks(capsys):
    _, out, _ = _check(capsys, "--nproc-per-node", "4", "--nnodes", "2", "--set", "tensor_parallel_degree=2")
    assert "tp groups (tensor parallel, inside nodes): [0,1] [2,3] [4,5] [6,7]" in out
    assert "dp groups (data parallel as SMP counts it: rdp × tp, crosses nodes): [0,1,2,3,4,5,6,7]" in out


def test_overrides_win_over_the_file(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"sharded_data_parallel_degree": 4}))
    _, out, _ = _check(capsys, str(config), "--nproc-per-node", "4", "--set", "sharded_data_parallel_degree=2")
    assert "layout: pp=1 × dp_replicate=2 × dp_shard=2 × tp=1" in out


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "4", "--set", "sharded_data_parallel_degree=3"],
     "sharded_data_parallel_degree=3: must divide the data-parallel degree 4"),
    (["--nproc-per-node", "4", "--set", "tensor_parallel_degree=8"],
     "tensor_parallel_degree=8: must not exceed the 4 devices per node"),
    (["--nproc-per-node", "4", "--set", "microbatchs=2"],
     "microbatchs=2: unknown key; fix: did you mean 'microbatches'?"),
    (["--nproc-per-node", "0"], "nproc_per_node=0: must be a positive integer"),
])
def test_errors_go_to_stderr_with_exit_2(capsys, argv, message):
    code, out, err = _check(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("shardwise check-config: invalid shardwise config")
    assert message in err


def test_field_and_layout_errors_are_reported_together(capsys):
    code, out, err = _check(capsys, "--nproc-per-node", "4", "--set", "microbatches=0",
                            "--set", "sharded_data_parallel_degree=3")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "shardwise check-config: invalid shardwise config:",
        "  microbatches=0: input should be greater than or equal to 1; fix: use 1 or more",
        "  sharded_data_parallel_degree=3: must divide the data-parallel degree 4 (= world 4 / (tp 1 × pp 1)); "
        "fix: use a divisor of 4: 1, 2, 4",
    ]


def test_malformed_file_exits_2_with_its_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("microbatches: 2\nbf16: [true\n")
    code, _, err = _check(capsys, str(config), "--nproc-per-node", "2")
    assert code == 2
    assert "malformed YAML at line 3" in err


def _console(*argv: str) -> subprocess.CompletedProcess:
    command = shutil.which("shardwise", path=os.path.dirname(sys.executable)) or shutil.which("shardwise")
    assert command, "the `shardwise` console script is not installed (pip install -e .)"
    return subprocess.run([command, *argv], capture_output=True, text=True, timeout=120)


def test_console_script_exit_codes():
    """The installed `shardwise` command (a fresh process, as a user runs it) exits 0, or 2 on error."""
    ok = _console("check-config", "--nproc-per-node", "2", "--set", "sharded_data_parallel_degree=2")
    assert ok.returncode == 0, ok.stderr
    assert "data parallel: ZeRO-3" in ok.stdout
    bad = _console("check-config", "--nproc-per-node", "2", "--set", "bf16=true", "--set", "fp16=true")
    assert bad.returncode == 2
    assert "fp16=True: bf16 and fp16 cannot both be on" in bad.stderr
