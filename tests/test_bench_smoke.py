"""bench/sharding.py runs end to end: every configuration trains, and is timed and measured, in fp32 and bf16."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sharding.py"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sharding_bench_runs(tmp_path, precision):
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCH), "--model", "gpt2-tiny", "--nproc", "2", "--steps", "1", "--rounds", "1",
               "--precision", precision, "--no-deepspeed", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"torch DDP", "torch FSDP2", "shardwise DDP", "shardwise ZeRO-1", "shardwise ZeRO-2",
                         "shardwise ZeRO-3", "shardwise MiCS 1×2"}
    for name, row in rows.items():
        assert row["median_s"] > 0 and row["memory_bytes"]["Total"] > 0, name
        assert row["collectives"], name
    assert rows["torch DDP"]["vs torch DDP"] == 1
    assert all("planner_peak_bytes" in row for name, row in rows.items() if name.startswith("shardwise"))
    assert "| shardwise ZeRO-2 |" in result.stdout and f"per rank, {precision}," in report["setup"]
    # in bf16 ZeRO-1 reduces gradients to their owners and keeps its replicas' parameters in bf16
    zero1, half = rows["shardwise ZeRO-1"], precision == "bf16"
    assert ("reduce/2" in zero1["collectives"]) == half
    assert zero1["memory_bytes"]["PARAM"] * (2 if half else 1) == rows["torch DDP"]["memory_bytes"]["PARAM"]
