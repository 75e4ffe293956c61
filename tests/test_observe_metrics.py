"""The recorder's metrics on a 4-rank world: comms bytes equal the volume DDP, ZeRO-3 and MiCS must move,
FLOPs equal the matmul formula, the breakdown sums to the step time, the files hold the documented keys,
and with metrics off nothing is recorded, written or hooked.

The model is a bag of matmuls, so its volumes and FLOPs have closed forms: an embedding (no FLOPs) feeds
Linear(D, H) -> ReLU -> Linear(H, V), no biases, so every weight gets both gradients and a step of T tokens
costs exactly 6 · N · T FLOPs (N = D·H + H·V; forward 2NT, backward 4NT); the optimizer's elementwise
update is not counted.
"""

from __future__ import annotations

import contextlib
import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import shardwise as sw
from shardwise.observe import metrics  # sw.metrics
from shardwise.observe.comms import CollectiveWatch, mesh_groups
from shardwise.runtime import state
from shardwise.runtime.state import current
from shardwise.testing import run_distributed

WORLD, ROWS, SEQ, STEPS = 4, 2, 8, 2
VOCAB, D, H = 16, 8, 12
FLOAT = 4  # bytes of an fp32 element
MATMUL_WEIGHTS = D * H + H * VOCAB
PARAMETERS = VOCAB * D + MATMUL_WEIGHTS  # the embedding's weights too


class Matmuls(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.up = nn.Linear(D, H, bias=False)
        self.out = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.up(self.embed(ids))))


def _train(config: dict, outer: bool = False) -> tuple[list, int]:
    """STEPS steps of the seed's loop under `config`; this rank's collectives seen from outside the recorder
    (with `outer`) and the forward hooks the model held during a step."""
    sw.init(config)
    model = sw.DistributedModel(Matmuls())
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    hooks = []

    @sw.step
    def train_step(model, ids, targets):
        hooks.append(len(model._forward_hooks) + len(model._forward_pre_hooks))
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (STEPS * ROWS * sw.dp_size(), SEQ), generator=g)
    watch = CollectiveWatch(mesh_groups(current().mesh))
    for inputs, targets in sw.data_loader(TensorDataset(ids, ids.roll(1, 1)), batch_size=ROWS):
        optimizer.zero_grad()
        with watch if outer else contextlib.nullcontext():
            train_step(model, inputs, targets).reduce_mean()
            optimizer.step()
    return [(c.name, c.group, c.nbytes) for c in watch.collectives], max(hooks)


def _done() -> None:
    state.set_current(None)  # the next config starts afresh on the same process group


def _run(config: dict) -> dict:
    _train(config)
    result = {"latest": metrics.latest()}
    _done()
    return result


def _rank_records(directory: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (directory / f"rank{rank}.jsonl").read_text().splitlines()]


def world(root: str) -> dict:
    """Every check's run, in one world."""
    out = {}
    costly = {"wall_clock_breakdown": True, "comms_logger": True, "flops_profiler": True, "peak_tflops": 2.0}
    for name, layout in (("ddp", {}), ("zero3", {"sharded_data_parallel_degree": 4}),
                         ("mics", {"sharded_data_parallel_degree": 2})):
        directory = Path(root) / name
        sinks = ["csv", "tensorboard"] if name == "ddp" else []
        out[name] = _run({**layout, **costly, "metrics_dir": str(directory), "metrics_sinks": sinks})
    out["pp"] = _run({"pipeline_parallel_degree": 2, "microbatches": 2, "wall_clock_breakdown": True,
                      "metrics_dir": str(Path(root) / "pp")})
    off_seen, off_hooks = _train({"metrics_interval": 0, "metrics_dir": str(Path(root) / "off")}, outer=True)
    out["off"] = {"latest": metrics.latest(), "seen": off_seen, "hooks": off_hooks}
    _done()
    cheap_seen, _ = _train({"metrics_dir": str(Path(root) / "cheap")}, outer=True)
    out["cheap"] = {"seen": cheap_seen}
    _done()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("metrics")
    return root, run_distributed(world, WORLD, str(root), timeout=240)


def _comms(root: Path, name: str) -> dict[tuple[str, str], int]:
    """Bytes per (collective, group) in one step, the same on every rank and every step."""
    per_rank = []
    for rank in range(WORLD):
        for record in _rank_records(root / name, rank):
            per_rank.append({(row["collective"], row["group"]): row["bytes"] for row in record["comms"]
                             if row["collective"] != "broadcast"})  # DDP's buffer broadcast: no buffers here
    assert all(entry == per_rank[0] for entry in per_rank), per_rank
    return per_rank[0]


def test_ddp_all_reduces_every_gradient_once(runs):
    root, _ = runs
    assert _comms(root, "ddp") == {("all_reduce", "dp"): PARAMETERS * FLOAT}


def test_zero3_gathers_twice_and_reduce_scatters_once_over_the_whole_world(runs):
    root, _ = runs
    # forward and backward each all-gather every parameter (output bytes); backward reduce-scatters every
    # gradient (input bytes); every shape here divides by 4, so FSDP2 pads nothing
    assert _comms(root, "zero3") == {("all_gather", "dp"): 2 * PARAMETERS * FLOAT,
                                     ("reduce_scatter", "dp"): PARAMETERS * FLOAT}


def test_mics_splits_sharding_traffic_from_the_replica_all_reduce(runs):
    root, _ = runs
    # ZeRO-3 inside each partition group of 2; its half of the gradients all-reduced across the 2 groups, with
    # one presence flag per parameter (parallel/sharding/mics.py)
    assert _comms(root, "mics") == {("all_gather", "shard"): 2 * PARAMETERS * FLOAT,
                                    ("reduce_scatter", "shard"): PARAMETERS * FLOAT,
                                    ("all_reduce", "replicate"): (PARAMETERS // 2 + 3) * FLOAT}


def test_bus_bandwidth_uses_nccl_tests_factors(runs):
    root, _ = runs
    rows = [row for record in _rank_records(root / "mics", 0) for row in record["comms"]]
    factors = {"all_gather": 1 / 2, "reduce_scatter": 1 / 2, "all_reduce": 1.0}  # groups of 2: (n-1)/n, 2(n-1)/n
    for row in rows:
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factors[row["collective"]])
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)


def test_flops_equal_six_n_tokens(runs):
    root, _ = runs
    tokens = ROWS * SEQ * WORLD
    for name in ("ddp", "zero3", "mics"):
        for line in (root / name / "global.jsonl").read_text().splitlines():
            record = json.loads(line)
            assert record["flops_per_step"] == 6 * MATMUL_WEIGHTS * tokens
            assert record["mfu"] == pytest.approx(record["tflops_per_s"] / (2.0 * WORLD))


def test_breakdown_sums_to_step_time(runs):
    root, _ = runs
    for name in ("ddp", "zero3", "mics"):
        for line in (root / name / "global.jsonl").read_text().splitlines():
            record = json.loads(line)
            parts = record["breakdown"]
            assert sum(parts.values()) == pytest.approx(record["step_time_s"], abs=1e-6)  # float rounding only
            assert all(value >= -1e-9 for value in parts.values()), parts
            assert min(parts["forward_s"], parts["backward_s"], parts["optimizer_s"]) > 0, parts


def test_forward_time_under_a_pipeline_is_its_stages_forward_calls(runs):
    """The schedule calls pp rank 0's stage between backward passes, never the model: its calls are forward."""
    root, _ = runs
    records = [json.loads(line) for line in (root / "pp" / "global.jsonl").read_text().splitlines()]
    assert len(records) == STEPS
    for record in records[1:]:  # the module-graph cut is made during the first step, after its hooks were set
        parts = record["breakdown"]
        assert sum(parts.values()) == pytest.approx(record["step_time_s"], abs=1e-6)
        assert parts["forward_s"] > 0 and parts["backward_s"] > 0, parts


GLOBAL_KEYS = {"step", "time", "loss", "step_time_s", "samples", "samples_per_s", "tokens_per_s", "lr", "grad_norm",
               "loss_scale", "skipped_steps", "breakdown", "flops_per_step", "tflops_per_s", "mfu"}
MEMORY_KEYS = {"parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "device_peak_bytes",
               "device_allocated_bytes", "host_rss_bytes"}


def test_files_hold_the_documented_keys(runs):
    root, results = runs
    records = [json.loads(line) for line in (root / "ddp" / "global.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    last = records[-1]
    assert set(last) == GLOBAL_KEYS
    assert last == results[0]["ddp"]["latest"]  # metrics.latest() is the last line rank 0 wrote
    assert last["samples"] == ROWS * WORLD and last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * SEQ)
    assert last["lr"] == 0.1 and last["loss_scale"] is None and last["grad_norm"] is None
    assert last["skipped_steps"] == 0 and last["loss"] > 0
    rank = _rank_records(root / "ddp", 3)[-1]
    assert set(rank) == {"step", "rank", "memory", "comms"} and rank["rank"] == 3
    assert set(rank["memory"]) == MEMORY_KEYS
    zero3 = [_rank_records(root / "zero3", r)[-1]["memory"] for r in range(WORLD)]
    assert sum(m["parameters_bytes"] for m in zero3) == PARAMETERS * FLOAT  # each rank holds a quarter
    with (root / "ddp" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == STEPS and float(rows[-1]["breakdown/forward_s"]) == last["breakdown"]["forward_s"]
    assert not (root / "zero3" / "metrics.csv").exists()


def test_tensorboard_event_file_reads_back(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, results = runs
    events = EventAccumulator(str(root / "ddp" / "tensorboard"))
    events.Reload()
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == list(range(1, STEPS + 1))
    assert losses[-1].value == pytest.approx(results[0]["ddp"]["latest"]["loss"])
    assert "breakdown/exposed_comm_s" in events.Tags()["scalars"]


def test_metrics_off_records_writes_and_hooks_nothing(runs):
    root, results = runs
    for result in results:
        assert result["off"]["latest"] is None and result["off"]["hooks"] == 0
        # the cheap default metrics add no collective either
        assert result["off"]["seen"] == result["cheap"]["seen"]
    assert not (root / "off").exists()
    assert (root / "cheap" / "global.jsonl").is_file()
