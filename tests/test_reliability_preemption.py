"""Preemption: SIGTERM to `shardwise run` makes every rank save a checkpoint at one step boundary, the job exits
75, and the next launch resumes from that checkpoint to the parameters of an uninterrupted run.

The script is test_reliability_elastic.py's (a 2-rank DDP world, eight AdamW steps). Rank 0 signals the launcher
after its fourth backward and pauses, so rank 1 gets past the fourth optimizer step first: the ranks see the
request at different boundaries and must agree on one.
"""

from __future__ import annotations

import json
import re

from shardwise.checkpoint.directory import newest_tag, resolve
from shardwise.cli import main
from shardwise.rundir import PREEMPTED_EXIT_CODE
from test_reliability_elastic import WORLD, assert_trained_as_one_process, write_script


def test_sigterm_saves_a_checkpoint_at_one_step_and_the_next_launch_resumes_from_it(tmp_path, capsys, monkeypatch):
    script, checkpoints = write_script(tmp_path), tmp_path / "ckpt"
    launch = ["run", "--nproc-per-node", str(WORLD), "--checkpoint-dir", str(checkpoints),
              "--set", "preemption_grace_seconds=20"]
    monkeypatch.setenv("FAULT", "sigterm")
    code = main([*launch, "--run-dir", str(tmp_path / "run"), str(script), str(tmp_path / "unused.pt")])
    err = capsys.readouterr().err
    assert code == PREEMPTED_EXIT_CODE, err
    line = next(line for line in err.splitlines() if line.startswith("shardwise run: preempted"))
    step = int(re.search(r"at step (\d+);", line).group(1))
    tag = f"preempted-step{step}"
    assert line == (f"shardwise run: preempted: every rank saved checkpoint {checkpoints}/{tag} at step {step}; "
                    "the next launch with the same checkpoint_dir resumes from it")
    assert step in (4, 5)  # rank 0 saw the signal before its fourth optimizer step ended, rank 1 maybe after
    assert newest_tag(checkpoints) == tag and resolve(checkpoints, None).name == tag  # complete: its manifest
    for rank in range(WORLD):
        record = json.loads((tmp_path / f"run/logs/rank{rank}/preempted.json").read_text())
        assert record == {"checkpoint": f"{checkpoints}/{tag}", "step": step}

    monkeypatch.delenv("FAULT")
    code = main([*launch, "--run-dir", str(tmp_path / "resumed"), str(script), str(tmp_path / "state.pt")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"attempt 0 starts at step {step}" in out
    assert_trained_as_one_process(tmp_path / "state.pt")
