"""The benches run end to end: bench/sharding.py (every configuration trains, and is timed and measured, in fp32 and
bf16), bench/link.py on its namespace cluster and bench/tune.py across its two namespace nodes (where there is
root)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sharding.py"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sharding_bench_runs(tmp_path, precision):
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCH), "--model", "gpt2-tiny", "--nproc", "2", "--steps", "1", "--rounds", "1",
               "--precision", precision, "--no-deepspeed", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"torch DDP", "torch FSDP2", "shardwise DDP", "shardwise ZeRO-1", "shardwise ZeRO-2",
                         "shardwise ZeRO-3", "shardwise MiCS 1×2"}
    for name, row in rows.items():
        assert row["median_s"] > 0 and row["memory_bytes"]["Total"] > 0, name
        assert row["collectives"], name
    assert rows["torch DDP"]["vs torch DDP"] == 1
    assert all("planner_peak_bytes" in row for name, row in rows.items() if name.startswith("shardwise"))
    assert "| shardwise ZeRO-2 |" in result.stdout and f"per rank, {precision}," in report["setup"]
    # in bf16 ZeRO-1 reduces gradients to their owners and keeps its replicas' parameters in bf16
    zero1, half = rows["shardwise ZeRO-1"], precision == "bf16"
    assert ("reduce/2" in zero1["collectives"]) == half
    assert zero1["memory_bytes"]["PARAM"] * (2 if half else 1) == rows["torch DDP"]["memory_bytes"]["PARAM"]


LINK_BENCH = BENCH.parent / "link.py"
ROOT = os.geteuid() == 0


def _theory_all_reduce_bytes(width: int, units: int, shard_of: int, element: int) -> int:
    """One replica pair's cross-group all-reduce in MiCS per step: each unit's gradient shard (a width × width
    weight and a bias, split over the partition group) and one presence flag per parameter."""
    return units * (width * width // shard_of + width // shard_of + 2) * element


@pytest.mark.skipif(not ROOT, reason="bench/link.py builds network namespaces, which needs root")
def test_link_bench_runs_on_the_namespace_cluster(tmp_path):
    """bench/link.py --smoke: every configuration trains one step on two namespaced nodes of two ranks; MiCS keeps
    gathers and reduce-scatters inside a node, and only its all-reduce crosses, in bf16 half the bytes; what the
    veth counted is at least what the ring algorithms must send; the cluster is gone afterwards."""
    out = tmp_path / "link.json"
    result = subprocess.run([sys.executable, str(LINK_BENCH), "--smoke", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    report = json.loads(out.read_text())
    rows = report["results"]["none"]
    mics = ("shardwise MiCS", "shardwise MiCS bf16 cross-group", "shardwise MiCS overlapping forward",
            "shardwise MiCS bf16 overlapping forward")
    assert set(rows) == {"compute only (nothing sent)", "torch DDP", "torch FSDP2 (flat)", "torch FSDP2 HSDP",
                         "shardwise DDP", "shardwise ZeRO-3", *mics}
    nodes, pairs = {"0,1", "2,3"}, {"0,2", "1,3"}
    for name in (*mics, "torch FSDP2 HSDP"):
        groups = {key.split("/")[0]: set() for key in rows[name]["group_bytes"]}
        for key in rows[name]["group_bytes"]:
            op, ranks = key.split("/")
            groups[op].add(ranks)
        assert groups == {"all-gather": nodes, "reduce-scatter": nodes, "all-reduce": pairs}, (name, groups)
    for name in mics:  # a step's all-reduces, whether or not they outlive it
        element = 2 if "bf16" in name else 4
        for pair in pairs:
            assert rows[name]["group_bytes"][f"all-reduce/{pair}"] == _theory_all_reduce_bytes(64, 3, 2, element)
    fp32 = rows["shardwise MiCS"]["group_bytes"]["all-reduce/0,2"]
    assert rows["shardwise MiCS"]["link_bytes_theory"] == 2 * fp32  # both replica pairs, one ring edge each way
    for name, row in rows.items():
        assert row["link_bytes"] >= row["link_bytes_theory"], name
    order = [rows[n]["link_bytes_theory"] for n in ("shardwise MiCS", "shardwise DDP", "shardwise ZeRO-3")]
    assert 0 < order[0] < order[1] < order[2]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(report["namespaces"]) & set(left)


def test_namespace_cluster_refuses_without_root_in_one_line(monkeypatch, capsys):
    """Without root bench/netns.py (and so bench/link.py) stops before touching anything, saying why."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import netns

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns, "_ip", lambda *args, **kwargs: pytest.fail(f"ran ip {args} without root"))
    assert netns.main(["up", "--rate", "400mbit"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "bench/netns.py: the namespace cluster needs root (ip netns, tc): run it as root, e.g. with sudo"]


LARGEST_BENCH = BENCH.parent / "largest_model.py"


def test_largest_model_bench_runs(tmp_path):
    """bench/largest_model.py --smoke: ZeRO-3 with offloading searches two tiny GPT-2s, the planner's pick first;
    the bytes its offload options moved in a step are the planner's count."""
    out, png = tmp_path / "largest.json", tmp_path / "largest.png"
    result = subprocess.run([sys.executable, str(LARGEST_BENCH), "--smoke", "--json", str(out), "--plot", str(png)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert (row["layout"], row["variant"], row["largest"], row["planner"]) == ("ZeRO-3", "offload", "2×64", "2×64")
    assert [trial["cell"] for trial in row["trials"]] == ["2×64"] and row["trials"][0]["peak"] > 0
    for kind in ("activations", "optimizer"):
        for direction in ("to_device", "to_host"):
            assert row["moved"][kind][direction] == pytest.approx(row["planned_moves"][kind][direction], rel=0.01)
    assert "| ZeRO-3 | offload | 2×64" in result.stdout and png.stat().st_size > 0

    # --replan recomputes the planner's columns of a saved run, here tampered with, and trains nothing
    saved = json.loads(out.read_text())
    stale = {**row, "planner": None, "planner_params": 0, "trials": [{**t, "predicted": 0} for t in row["trials"]],
             "planned_moves": {kind: {"to_device": 0, "to_host": 0} for kind in ("activations", "optimizer")}}
    out.write_text(json.dumps({**saved, "results": [stale]}))
    again = tmp_path / "replanned.json"
    result = subprocess.run([sys.executable, str(LARGEST_BENCH), "--smoke", "--replan", str(out), "--json", str(again)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(again.read_text()) == saved


def test_largest_model_search_starts_at_the_prediction_and_gallops(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from largest_model import search

    for boundary in range(-1, 20):  # the largest index that fits
        for first in (-1, 0, 7, 19):
            probed = []
            found, probes = search(20, first, lambda i: probed.append(i) or i <= boundary)
            assert found == (boundary if boundary >= 0 else None) and probes == probed
            assert probes[0] == max(first, 0) and len(probes) <= 9 and len(set(probes)) == len(probes)
    assert search(20, 7, lambda i: i <= 7)[1] == [7, 8]  # an exact prediction costs two trials
    assert search(20, 7, lambda i: i <= 9)[1] == [7, 8, 10, 9]  # one two off, four
    assert search(20, 7, lambda i: i <= 5)[1] == [7, 6, 4, 5]


@pytest.mark.skipif(not ROOT, reason="bench/tune.py --nodes 2 builds network namespaces, which needs root")
def test_tune_bench_runs_across_the_namespace_nodes(tmp_path):
    """bench/tune.py --nodes 2: `shardwise tune` in each namespace node, node 0 keeping the results; one GPT-2
    trial measured on both ranks, its row in the markdown table; the namespaces are gone afterwards."""
    def namespaces() -> set[str]:
        return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())

    before = namespaces()
    result = subprocess.run([sys.executable, str(BENCH.parent / "tune.py"), "--nodes", "2", "--nproc", "1", "--rate",
                             "800mbit", "--trials", "1", "--steps", "2", "--families", "gpt2", "--batch-size", "2",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    row = json.loads((tmp_path / "gpt2" / "trials.jsonl").read_text())
    assert row["failure"] is None and set(row["peak_memory_bytes"]) == {"0", "1"}, row
    assert "| gpt2 | 2 × 1 (800mbit) | 1 | 1 |" in (tmp_path / "summary.md").read_text()
    assert namespaces() == before
