"""The seed article's script (examples/seed_vit.py, a tiny ViT) trains under `shardwise run` with MiCS.

A real user's command in a fresh process: the launcher starts 4 CPU ranks,
hands the seed's whole config with MiCS groups of 2 (and SMP's activation
offloading keys) to `sw.init()` in each, and the loss falls.
"""

from __future__ import annotations

import math
import os
import re
import signal
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "seed_vit.py"
TINY = ["--image-size", "16", "--patch-size", "4", "--hidden-size", "32", "--layers", "2", "--heads", "2",
        "--num-labels", "4", "--lr", "3e-3"]

# seed 000's parameters (ddp, sharded_data_parallel_degree, delayed_parameter_initialization) with MiCS groups of 2,
# and seed 001's activation offloading
SEED_CONFIG = ["--set", "ddp=true", "--set", "sharded_data_parallel_degree=2", "--set", "offload_activations=true",
               "--set", "activation_loading_horizon=2", "--set", "delayed_parameter_initialization=true"]


def test_seed_vit_trains_with_mics_under_shardwise_run(tmp_path):
    command = shutil.which("shardwise", path=os.path.dirname(sys.executable)) or shutil.which("shardwise")
    result = subprocess.run(
        [command, "run", "--nproc-per-node", "4", *SEED_CONFIG, "--run-dir", str(tmp_path / "run"), str(SCRIPT),
         "--steps", "20", *TINY],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "layout: pp=1 × dp_replicate=2 × dp_shard=2 × tp=1" in out  # the launcher's check
    assert ("training on 4 ranks (4 data-parallel) with {'sharded_data_parallel_degree': 2, 'offload_activations': "
            "True, 'activation_loading_horizon': 2, 'delayed_parameter_initialization': True}") in out  # init's
    losses = [float(x) for x in re.findall(r"^step: \d+: loss (\S+),", out, flags=re.M)]
    assert len(losses) == 20
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses
    assert "average step time" in out
    assert all((tmp_path / "run" / "logs" / f"rank{r}" / "stdout.log").is_file() for r in range(4))


def _losses(out: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step: (\d+): loss (\S+),", out, flags=re.M)}


def test_seed_vit_killed_then_started_again_resumes_where_it_was(tmp_path):
    """Killed (SIGKILL to the whole job) after its step-5 checkpoint, the script started again resumes from it:
    the steps both runs trained give the same losses, so weights, optimizer and data position came back."""
    command = shutil.which("shardwise", path=os.path.dirname(sys.executable)) or shutil.which("shardwise")
    job = [command, "run", "--nproc-per-node", "2", "--set", "sharded_data_parallel_degree=2",
           "--run-dir", str(tmp_path / "run"), str(SCRIPT), "--steps", "8", "--save-every", "5",
           "--checkpoint-dir", str(tmp_path / "ckpt"), *TINY]
    first = subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                             start_new_session=True)
    seen = []
    for line in first.stdout:
        seen.append(line)
        if line.startswith("step: 7:"):
            os.killpg(first.pid, signal.SIGKILL)
            break
    first.wait(timeout=60)
    killed = _losses("".join(seen))
    assert 7 in killed, "".join(seen)[-3000:]
    assert (tmp_path / "ckpt" / "newest").read_text().strip() == "step_5"
    second = subprocess.run(job, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from step 5" in second.stdout
    resumed = _losses(second.stdout)
    assert sorted(resumed) == [6, 7, 8]
    assert resumed[6] == killed[6] and resumed[7] == killed[7]
