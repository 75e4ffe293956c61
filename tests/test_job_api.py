"""`shardwise.Job(...).fit()` runs the seed script (examples/seed_vit.py) as `shardwise run` does."""

from __future__ import annotations

import json
import re

import pytest

from shardwise.config import ConfigError
from shardwise.launcher.job import Job
from test_seed_script import SCRIPT, TINY


def test_job_fit_runs_the_seed_script(tmp_path, capsys):
    job = Job(entry_point=str(SCRIPT), nproc_per_node=2, config={"sharded_data_parallel_degree": 2},
              run_dir=str(tmp_path / "run"), hyperparameters={"steps": 4}, script_args=TINY)
    result = job.fit()
    out = capsys.readouterr().out
    assert result.exit_code == 0, out
    assert result.run_dir == tmp_path / "run"
    assert json.loads((result.run_dir / "config.json").read_text()) == {"sharded_data_parallel_degree": 2}
    assert len(re.findall(r"^step: \d+: loss", out, flags=re.M)) == 4
    metrics = result.run_dir / "metrics" / "global.jsonl"
    assert result.metrics == (json.loads(metrics.read_text().splitlines()[-1]) if metrics.is_file() else None)


def test_job_with_a_bad_config_starts_nothing(tmp_path):
    job = Job(entry_point=str(SCRIPT), nproc_per_node=2, config={"sharded_data_parallel_degree": 3},
              run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="sharded_data_parallel_degree=3: must divide the data-parallel degree 2"):
        job.fit()
    assert not (tmp_path / "run").exists()
