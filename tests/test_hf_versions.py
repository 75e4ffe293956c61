"""shardwise.hf on the oldest transformers release it supports: the lower bound pyproject.toml declares.

The rest of the suite runs on the transformers pip installs (the newest release). This test installs the
declared lower bound, with what that release needs that is not installed already, into a folder of its own, put
first on the path of a pytest run in a subprocess (the installed packages stay as they are), and runs there the
private-member smoke test and the same-math cases that touch the Trainer's loop most: DDP, ZeRO-3, a pipeline
with compute_metrics and predict, and a checkpoint saved, reloaded with `from_pretrained` and resumed bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CASES = ["tests/test_hf_internals.py",
         "tests/test_hf_trainer.py::test_trains_and_evaluates_as_one_process[ddp]",
         "tests/test_hf_trainer.py::test_trains_and_evaluates_as_one_process[zero3]",
         "tests/test_hf_trainer.py::test_pipeline_trains_evaluates_and_predicts_as_one_process",
         "tests/test_hf_checkpoint.py::test_save_model_writes_weights_from_pretrained_loads",
         "tests/test_hf_checkpoint.py::test_resume_in_the_same_layout_is_bit_exact"]
CASE_COUNT = 7  # test_hf_internals.py holds two


def lowest_supported() -> str:
    """The transformers release pyproject.toml's dependencies start at."""
    found = re.search(r'"transformers>=([0-9][0-9.]*)', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml declares no transformers>=X lower bound"
    return found.group(1)


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"pip {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def install_beside(release: str, folder: Path) -> None:
    """transformers==`release` and the packages it needs at other versions than the installed ones, in `folder`."""
    report = folder.parent / "report.json"
    _pip("install", "--quiet", "--dry-run", "--report", str(report), f"transformers=={release}")
    wanted = [f"{item['metadata']['name']}=={item['metadata']['version']}"
              for item in json.loads(report.read_text())["install"]]
    if wanted:
        _pip("install", "--quiet", "--no-deps", "--target", str(folder), *wanted)


def test_oldest_supported_transformers_trains_as_one_process(tmp_path):
    release = lowest_supported()
    folder = tmp_path / "site"
    folder.mkdir()
    install_beside(release, folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    seen = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert Version(seen.stdout.strip() or "0") == Version(release), seen.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CASES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and summary.startswith(f"{CASE_COUNT} passed"), \
        f"with transformers {release}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
