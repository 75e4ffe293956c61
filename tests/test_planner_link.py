"""`shardwise plan` predicts bench/link.py's slow-link cluster: the ranking measured and each step time within ±30 %
(MiCS's options too: bf16 across groups, and the all-reduces outliving backward).

The measured step times are in planner_link_measured.json (docs/benchmarks.md's run). The
cluster is given by flags: the local (gloo) preset, 2 nodes × 2 ranks, the link's rate,
and the device's speed from the bench's compute-only step at that rate.
"""

import json
import statistics
import sys
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.planner import assumptions, cluster_preset, evaluate, resolve_model

MEASURED = json.loads((Path(__file__).parent / "planner_link_measured.json").read_text())
BATCH_PER_RANK, RANKS = 32, 4
sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))


def link_mlp():
    """bench/link.py's model, for `--model test_planner_link:link_mlp`."""
    from link_setups import MLP, Shape

    return MLP(Shape())


@pytest.fixture(scope="module")
def spec():
    return resolve_model("test_planner_link:link_mlp", input_shape=(1024,))


def _peak_tflops(spec, rate: str) -> float:
    """The peak that makes the model's compute the bench's compute-only step (mean of its rounds)."""
    seconds = statistics.mean(MEASURED["step_ms"][rate]["compute only"]) / 1e3
    flops = 3 * BATCH_PER_RANK * (spec.forward_flops_per_token(1, spec.layers) + spec.edge_flops_per_token())
    return flops / seconds / assumptions.ACHIEVABLE_FLOPS_FRACTION / 1e12


def _flags(spec, rate: str) -> list[str]:
    return ["--cluster", "2xlocal", "--devices-per-node", "2", "--inter-node-gbs", str(MEASURED["inter_node_gbs"][rate]),
            "--peak-tflops", f"{_peak_tflops(spec, rate):.6f}"]


def test_the_traced_mlp_counts_as_built(spec):
    assert spec.parameters == 9 * (1024 * 1024 + 1024) and spec.layers == 8
    assert spec.layer_tensors == (1024 * 1024, 1024) and spec.head_tensors == (1024 * 1024, 1024)
    assert spec.forward_flops_per_token(1, 1) == 2 * 1024 * 1024       # one linear layer per block
    assert spec.traced.block_saved_bytes == 2 * 1024 * 4                # its input and the ReLU's output, fp32


@pytest.mark.parametrize("rate", ["200mbit", "400mbit"])
def test_plan_ranks_ddp_zero3_and_mics_as_measured_and_predicts_each_within_30_percent(spec, rate, capsys):
    assert main(["plan", "--model", "test_planner_link:link_mlp", "--input-shape", "1024",
                 "--global-batch", str(BATCH_PER_RANK * RANKS), "--json", *_flags(spec, rate)]) == 0
    considered = json.loads(capsys.readouterr().out)

    def best(**keys) -> float:
        """The planner's best step time of the layouts with these config values (unpipelined, no checkpointing)."""
        rows = [e for e in considered if e["fits"] and e["layout"]["pp"] == 1 and e["activation_checkpointing"] == "none"
                and all(e["config"].get(k) == v for k, v in keys.items())]
        return min(e["step_time_s"] for e in rows)

    measured = {name: statistics.mean(ms) / 1e3 for name, ms in MEASURED["step_ms"][rate].items()}
    planned = {"ddp": best(zero_stage=None, shard_optimizer_state=None),
               "zero3": best(zero_stage=3, sharded_data_parallel_degree=4),
               "mics": best(zero_stage=3, sharded_data_parallel_degree=2)}
    assert sorted(planned, key=planned.get) == sorted(planned, key=measured.get) == ["mics", "ddp", "zero3"]

    cluster = cluster_preset("2xlocal", devices_per_node=2, inter_node_bandwidth=MEASURED["inter_node_gbs"][rate] * 1e9,
                             peak_flops=_peak_tflops(spec, rate) * 1e12)
    predicted = {}
    for name, config in MEASURED["configs"].items():
        predicted[name] = evaluate(spec, cluster, config, global_batch=BATCH_PER_RANK * RANKS).step_time
        print(f"{rate} {name}: predicted {predicted[name] * 1e3:.0f} ms, measured {measured[name] * 1e3:.0f} ms "
              f"({predicted[name] / measured[name] - 1:+.0%})")
        assert predicted[name] == pytest.approx(measured[name], rel=0.3), name
    for dtype in ("mics", "mics bf16"):  # the all-reduces outliving backward gain, as measured
        deferred = f"{dtype} overlapping forward"
        assert predicted[deferred] < predicted[dtype] and measured[deferred] < measured[dtype], dtype
