"""Elastic resume (`shardwise run --max-restarts`, `--checkpoint-dir`).

TinyStack under DDP in a 2-rank gloo world, AdamW, eight steps, a checkpoint every two. In the first attempt
rank 1 SIGKILLs itself at step 6 while rank 0 has begun writing that checkpoint; the restart rendezvouses
afresh, resumes from step 4 (the newest complete checkpoint, not the interrupted one) and ends with the
parameters of a one-process run. The same job as two one-rank nodes (two `shardwise run --nnodes 2` on this
machine, static rendezvous) restarts both nodes and ends the same. tests/test_reliability_preemption.py launches
the same script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from shardwise.checkpoint.directory import newest_tag
from shardwise.cli import main
from test_launcher import _free_port
from tiny_models import relative_error, train_reference

STEPS, ROWS, WORLD, EVERY = 8, 4, 2, 2
# FAULT=kill: rank 1 dies at step 6 of the first attempt, after rank 0 entered that step's save.
# FAULT=sigterm: rank 0 sends SIGTERM to `shardwise run` (its parent) after its fourth backward, then pauses,
# so that it sees the signal a step before rank 1 does (rank 1 is then past that step's optimizer step).
SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
import torch
import shardwise as sw
from tiny_models import build, dataset, loss_fn, make_optimizer

config = sw.init()
model = sw.DistributedModel(build("stack"))
optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
data = dataset("stack", {steps} * {rows} * 2)

@sw.step
def train_step(model, inputs, targets):
    loss = loss_fn("stack", model, inputs, targets)
    model.backward(loss)
    return loss

if os.path.exists(os.path.join(config.checkpoint_dir, "newest")):
    sw.resume_from_checkpoint(config.checkpoint_dir)
attempt, fault = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), os.environ.get("FAULT")
print(f"attempt {{attempt}} starts at step {{optimizer.steps}}", flush=True)
while optimizer.steps < {steps}:
    start = (optimizer.steps * 2 + sw.dp_rank()) * {rows}
    optimizer.zero_grad()
    train_step(model, *data[start:start + {rows}])
    if fault == "sigterm" and optimizer.steps == 3 and sw.rank() == 0:
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(2)
    optimizer.step()
    if optimizer.steps % {every} == 0:
        if fault == "kill" and attempt == 0 and optimizer.steps == 6 and sw.rank() == 1:
            time.sleep(1)  # rank 0 is inside save_checkpoint by now
            os.kill(os.getpid(), signal.SIGKILL)
        sw.save_checkpoint(config.checkpoint_dir, f"step{{optimizer.steps}}")
state = model.full_state_dict()
if sw.rank() == 0:
    torch.save(state, sys.argv[1])
sw.shutdown()
"""


def write_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent), steps=STEPS, rows=ROWS,
                                                    every=EVERY)))
    return script


def assert_trained_as_one_process(state_file: Path) -> None:
    """The final parameters of the (interrupted, resumed) 2-rank run are those of an uninterrupted one-process run."""
    want = train_reference("stack", "adamw", STEPS, ROWS * WORLD)["state"]
    state = torch.load(state_file)
    for name, value in want.items():
        assert relative_error(state[name], value) < 1e-6, name


def test_a_killed_rank_restarts_the_job_from_the_newest_complete_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAULT", "kill")
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    code = main(["run", "--nproc-per-node", str(WORLD), "--max-restarts", "1", "--checkpoint-dir", str(checkpoints),
                 "--run-dir", str(run_dir), str(write_script(tmp_path)), str(tmp_path / "state.pt")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "attempt 0 starts at step 0" in out and "attempt 1 starts at step 4" in out, out
    assert (run_dir / "logs/attempt1/rank1/stdout.log").read_text().startswith("attempt 1 starts at step 4")
    assert json.loads((run_dir / "launch-node0.json").read_text())["attempts"] == 2
    assert newest_tag(checkpoints) == "step8" and not list(checkpoints.glob(".writing-*"))
    assert_trained_as_one_process(tmp_path / "state.pt")


def test_a_killed_rank_restarts_both_nodes_of_a_two_node_job(tmp_path):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    script, state_file = write_script(tmp_path), tmp_path / "state.pt"
    common = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(_free_port()), "--max-restarts", "1", "--checkpoint-dir", str(checkpoints),
              "--run-dir", str(run_dir)]
    launch = "import sys; from shardwise.cli import main; sys.exit(main())"
    nodes = [subprocess.Popen([sys.executable, "-c", launch, *common, "--node-rank", str(node), str(script),
                               str(state_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "FAULT": "kill"})
             for node in (1, 0)]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.terminate()  # a hung launch stops its ranks on SIGTERM; no-op for one that ended
    assert [node.returncode for node in nodes] == [0, 0], outputs
    for node in range(2):
        assert json.loads((run_dir / f"launch-node{node}.json").read_text())["attempts"] == 2
        assert (run_dir / f"logs/attempt1/rank{node}/stdout.log").read_text().startswith("attempt 1 starts at step 4")
    assert newest_tag(checkpoints) == "step8" and not list(checkpoints.glob(".writing-*"))
    assert_trained_as_one_process(state_file)
