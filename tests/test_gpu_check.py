"""The device check's parts that need no GPU: bench/gpu_check.py's dry run on the CPU and the shell scripts' syntax.

The dry run is the benchmark at a tiny size (dynamo's eager backend standing in for
inductor), in a process of its own since it starts its own process group: it must
write both result files, and shardwise's run must train what raw torch's FSDP2
trains (the same bf16 model, data and AdamW).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_writes_the_table_and_shardwise_trains_as_raw_torch(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    runs = result["runs"]
    assert set(runs) == {"torch eager", "torch compiled", "shardwise"}
    for run in runs.values():
        assert run["step_s"] > 0 and run["tokens_per_s"] > 0 and 0 < run["mfu"] and math.isfinite(run["loss"])
    assert runs["torch compiled"]["loss"] == pytest.approx(runs["torch eager"]["loss"], rel=1e-6)
    assert runs["shardwise"]["sharded"]  # ZeRO-3, as the torch runs' FSDP2
    assert runs["shardwise"]["loss"] == pytest.approx(runs["torch eager"]["loss"], rel=1e-3)  # bf16's rounding
    assert result["planner"]["step_s"] > 0 and result["planner"]["tensor_bytes"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in runs) and "| planner" in table


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_wheels_folder_stays_out_of_git():
    assert ".gpu_wheels/" in (ROOT / ".gitignore").read_text().split()
