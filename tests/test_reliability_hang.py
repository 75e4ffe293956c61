"""A collective that never completes (`collective_timeout_seconds`, runtime/hang_report.py).

TinyStack under DDP in a 2-rank gloo world launched by `shardwise run`, AdamW, four steps.
With the fault, both ranks train two steps, then in the third rank 1 skips the step (it is
busy elsewhere, sleeping) while rank 0 waits in DDP's gradient all-reduce. Within the small
timeout the job ends; rank 0's error, the job's, names the collective, its group and
sequence number and says rank 1 never joined; both ranks leave a report with their recent
collectives and stacks. Without it, the watched run trains as one plain process and ends cleanly.
The script saves checkpoint step1 after the first step and step2, asynchronously, after the second,
so that it may still be being written as the hang begins; after the job ends both are complete and
read back as saved. Groups of the mesh and groups shardwise makes after init (the checkpoint group)
wait `collective_timeout_seconds` too, not torch's 30 minutes.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.checkpoint.coordination import checkpoint_group
from shardwise.cli import main
from shardwise.runtime import state
from shardwise.runtime.hang_report import is_collective_timeout
from shardwise.testing import run_distributed
from tiny_models import assert_checkpoints_intact, relative_error, train_reference

TIMEOUT, STEPS, ROWS, WORLD = 3, 4, 4, 2
SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
import torch
import shardwise as sw
from tiny_models import build, dataset, loss_fn, make_optimizer, train_reference

sw.init()
model = sw.DistributedModel(build("stack"))
optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
data = dataset("stack", {steps} * {rows} * 2)
saved = {{}}

@sw.step
def train_step(model, inputs, targets):
    loss = loss_fn("stack", model, inputs, targets)
    model.backward(loss)
    return loss

for index in range({steps}):
    if {fault} and index == 2 and sw.rank() == 1:
        time.sleep(60)  # busy elsewhere: never joins this step's gradient all-reduce
        print("rank 1 slept to the end", flush=True)
    start = (index * 2 + sw.dp_rank()) * {rows}
    optimizer.zero_grad()
    train_step(model, *data[start:start + {rows}])
    optimizer.step()
    if index < 2:
        sw.save_checkpoint(sys.argv[2], f"step{{index + 1}}", async_save=index == 1)
        saved[f"step{{index + 1}}"] = {{name: value.clone() for name, value in model.full_state_dict().items()}}
        if sw.rank() == 0:
            torch.save(saved, sys.argv[3])
state = model.full_state_dict()
if sw.rank() == 0:
    torch.save(state, sys.argv[1])
sw.shutdown()
"""


def _launch(tmp_path: Path, fault: bool) -> tuple[int, Path]:
    """Run the script through `shardwise run` with the small timeout, checkpoints to `tmp_path/ckpt`, what
    they hold to `tmp_path/saved.pt`; the exit code and run dir."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(Path(__file__).parent), steps=STEPS, rows=ROWS,
                                                    fault=fault)))
    run_dir = tmp_path / "run"
    code = main(["run", "--nproc-per-node", str(WORLD), "--set", f"collective_timeout_seconds={TIMEOUT}",
                 "--run-dir", str(run_dir), str(script), str(tmp_path / "state.pt"), str(tmp_path / "ckpt"),
                 str(tmp_path / "saved.pt")])
    return code, run_dir


def test_watched_run_without_faults_trains_as_one_process_and_ends_cleanly(tmp_path, capsys):
    want = train_reference("stack", "adamw", STEPS, ROWS * WORLD)["state"]
    code, run_dir = _launch(tmp_path, fault=False)
    assert code == 0, capsys.readouterr().err
    state = torch.load(tmp_path / "state.pt")
    for name, value in want.items():
        assert relative_error(state[name], value) < 1e-5, name
    assert not list(run_dir.glob("logs/rank*/hang.json"))


def test_a_rank_that_skips_a_collective_is_named_within_the_timeout(tmp_path, capsys):
    code, run_dir = _launch(tmp_path, fault=True)
    err = capsys.readouterr().err
    assert code == 1, err
    # The job ended while rank 1 still slept (it was stopped, not waited for), on rank 0's timeout.
    assert "slept to the end" not in (run_dir / "logs" / "rank1" / "stdout.log").read_text()
    line = next(line for line in err.splitlines() if "shardwise.CollectiveTimeout" in line)
    assert "rank 0 (node 0, local rank 0) failed first" in err, err
    assert " timed out after 3 s on rank 0; rank 1 never joined it (its last in that group: #" in line, line
    report = json.loads((run_dir / "logs" / "rank0" / "hang.json").read_text())
    hung = report["hung_on_rank"]
    assert hung["collective"] == "gloo:all_reduce" and f"#{hung['sequence']} of process group {hung['group']}" in line
    assert report["never_joined"] == {"1": hung["sequence"] - 1}
    assert any("train_step" in frame for frame in hung["stack"]), hung["stack"]
    rank1 = json.loads((run_dir / "logs" / "rank1" / "hang.json").read_text())
    assert rank1["positions"][hung["group"]] == hung["sequence"] - 1 and rank1["recent"]
    assert_checkpoints_intact(tmp_path / "ckpt", torch.load(tmp_path / "saved.pt"), tmp_path)


def _rank_0_all_reduces_while_rank_1_sleeps(group: dist.ProcessGroup, sleep: float, done: str) -> dict:
    """Whether rank 0's all-reduce in `group` timed out while rank 1 slept (`sleep` s at most: it wakes when rank 0
    has its answer, the file `done`), and its error."""
    result = {"ranks": dist.get_process_group_ranks(group)}
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError as error:
            result.update(timed_out=is_collective_timeout(error), error=str(error))
        Path(done).touch()
    elif dist.get_rank() == 1:
        deadline = time.monotonic() + sleep
        while time.monotonic() < deadline and not Path(done).exists():
            time.sleep(0.1)
    sw.shutdown(wait=False)
    return result


def _time_a_tensor_parallel_collective_rank_1_skips(done: str) -> dict:
    """Rank 0 all-reduces in its tensor-parallel group (ranks 0 and 1, a group of the mesh) while rank 1 sleeps."""
    sw.init({"tensor_parallel_degree": 2, "collective_timeout_seconds": TIMEOUT})
    return _rank_0_all_reduces_while_rank_1_sleeps(state.current().mesh["tp"].get_group(), 3 * TIMEOUT, done)


def _time_a_checkpoint_group_collective_rank_1_skips(done: str) -> dict:
    """The same in the checkpoint group, which shardwise makes after init."""
    sw.init({"collective_timeout_seconds": TIMEOUT})
    return _rank_0_all_reduces_while_rank_1_sleeps(checkpoint_group(state.current()), 3 * TIMEOUT, done)


def test_mesh_groups_wait_the_configured_timeout_not_torchs_default(tmp_path):
    """Groups a DeviceMesh makes keep torch's 30-minute default unless shardwise sets theirs."""
    first = run_distributed(_time_a_tensor_parallel_collective_rank_1_skips, 4, str(tmp_path / "done"), timeout=120)[0]
    assert first["ranks"] == [0, 1] and first["timed_out"], first
    assert f"Timed out waiting {TIMEOUT * 1000}ms" in first["error"], first  # gloo names the timeout it waited


def test_groups_made_after_init_wait_the_configured_timeout(tmp_path):
    """torch's new_group would wait 30 minutes; the checkpoint group waits collective_timeout_seconds."""
    first = run_distributed(_time_a_checkpoint_group_collective_rank_1_skips, 2, str(tmp_path / "done"), timeout=120)[0]
    assert first["timed_out"] and f"Timed out waiting {TIMEOUT * 1000}ms" in first["error"], first
