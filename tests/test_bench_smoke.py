"""bench/sharding.py runs end to end: every configuration trains, and is timed and measured."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sharding.py"


def test_sharding_bench_runs(tmp_path):
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCH), "--model", "gpt2-tiny", "--nproc", "2", "--steps", "1", "--rounds", "1",
               "--no-deepspeed", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"torch DDP", "torch FSDP2", "shardwise DDP", "shardwise ZeRO-1", "shardwise ZeRO-2",
                         "shardwise ZeRO-3", "shardwise MiCS 1×2"}
    for name, row in rows.items():
        assert row["median_s"] > 0 and row["memory_bytes"]["Total"] > 0, name
        assert row["collectives"], name
    assert rows["torch DDP"]["vs torch DDP"] == 1
    assert all("planner_peak_bytes" in row for name, row in rows.items() if name.startswith("shardwise"))
    assert "| shardwise ZeRO-2 |" in result.stdout
