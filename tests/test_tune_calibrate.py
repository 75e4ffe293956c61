"""Calibration of the planner from a tuning run's trials (recorded on a shared 2-core CPU machine, GPT-2 on 4 gloo
ranks: tests/data/tune_gpt2_4ranks/), the cluster file it writes read back by `plan` and `tune`, and the fit
recovering constants it is given. No launches, no timed assertions."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.planner import PlanError, cluster_preset, evaluate, resolve_model
from shardwise.planner.cluster_file import read_cluster_file, resolve_cluster, with_values
from shardwise.tune import TrialResult
from shardwise.tune import tuner
from shardwise.tune.calibrate import (Trial, calibrate, calibrate_results, calibrated_cluster, held_out,
                                      measured_trials, planning_inputs, read_trials)
from shardwise.tune.measure import Measurement

RECORDED = Path(__file__).parent / "data" / "tune_gpt2_4ranks"
PLANNING = planning_inputs(RECORDED)


@pytest.fixture(scope="module")
def recorded():
    spec = resolve_model(PLANNING["model"], seq=PLANNING["seq"])
    cluster = cluster_preset("local", devices_per_node=PLANNING["nproc"])
    inputs = dict(global_batch=PLANNING["global_batch"], seq=PLANNING["seq"])
    return spec, cluster, measured_trials(read_trials(RECORDED)), inputs


@pytest.fixture(scope="module")
def fitted(recorded):
    spec, cluster, trials, inputs = recorded
    return calibrate(spec, cluster, trials, **inputs)


def _abs_log(predicted, measured):
    return sum(abs(math.log(p / m)) for p, m in zip(predicted, measured)) / len(measured)


def test_calibration_moves_predictions_toward_the_trials_it_was_fitted_on(recorded, fitted):
    assert len(fitted.trials) >= 4
    assert _abs_log(fitted.after, fitted.measured) < _abs_log(fitted.before, fitted.measured)
    s = fitted.summary()
    assert s["mean_abs_error_after"] < s["mean_abs_error_before"]
    assert set(s["constants"]) == {"peak_flops", "memory_bandwidth", "intra_node_bandwidth", "intra_node_latency",
                                   "critical_op_seconds"}  # trials 5 and 6 are tensor-parallel
    op = s["constants"]["critical_op_seconds"]
    assert "critical_op_seconds" not in s["scales"] and f"critical_op_seconds {op:.3g} s" in s["fitted"]


def test_calibration_moves_held_out_trials_toward_their_measurements(recorded):
    """Each trial predicted by a fit on the others: closer to its measurement on the whole (log error)."""
    spec, cluster, trials, inputs = recorded
    folds = [held_out(spec, cluster, trials, t.trial, **inputs) for t in trials]
    before, after, measured = zip(*folds)
    assert _abs_log(after, measured) < _abs_log(before, measured)


def test_the_fit_recovers_constants_it_is_given():
    """Step times the planner predicts on a cluster with known constants are fitted back to within 2 %."""
    spec = resolve_model("gpt2:vocab_size=256,n_positions=64,n_embd=128,n_layer=4,n_head=4", seq=64)
    preset = cluster_preset("local", devices_per_node=4)
    true = with_values(preset, {"peak_flops": 2e9, "intra_node_latency": 2e-3})
    configs = [{}, {"zero_stage": 3, "sharded_data_parallel_degree": 4}, {"zero_stage": 2,
               "sharded_data_parallel_degree": 2}, {"shard_optimizer_state": True}, {"microbatches": 4}]
    trials = [Trial(n, c, evaluate(spec, true, c, global_batch=32, seq=64).step_time)
              for n, c in enumerate(configs, 1)]
    fitted = calibrate(spec, preset, trials, global_batch=32, seq=64)
    assert max(abs(e) for e in fitted.errors(fitted.after)) < 0.02
    assert min(abs(e) for e in fitted.errors(fitted.before)) > 0.5
    assert fitted.scales["peak_flops"] == pytest.approx(2e9 / 50e9, rel=0.05)


def test_the_fit_finds_a_bandwidth_and_a_latency_that_trade_off():
    """Links far from the preset (bandwidth ×0.05, latency ×40) over sharded and replicated layouts: a descent one
    constant at a time stopped with errors above 1 %; the global fit recovers both."""
    spec = resolve_model("gpt2:vocab_size=256,n_positions=64,n_embd=128,n_layer=4,n_head=4", seq=64)
    preset = cluster_preset("local", devices_per_node=4)
    true = with_values(preset, {"peak_flops": {k: v / 2 for k, v in preset.device.peak_flops.items()},
                                "intra_node_bandwidth": preset.intra_node_bandwidth * 0.05,
                                "intra_node_latency": preset.intra_node_latency * 40})
    configs = [{"zero_stage": stage, "sharded_data_parallel_degree": n} for stage in (2, 3) for n in (4, 2)]
    configs += [{"shard_optimizer_state": True}, {"microbatches": 8}]
    trials = [Trial(n, c, evaluate(spec, true, c, global_batch=32, seq=64).step_time)
              for n, c in enumerate(configs, 1)]
    fitted = calibrate(spec, preset, trials, global_batch=32, seq=64)
    assert max(abs(e) for e in fitted.errors(fitted.after)) < 0.01
    assert fitted.scales["intra_node_latency"] == pytest.approx(40, rel=0.15)
    assert fitted.scales["intra_node_bandwidth"] == pytest.approx(0.05, rel=0.15)


def test_the_host_time_of_critical_ops_is_fitted_where_trials_issue_them():
    """The presets charge no host time per critical op; trials that wait on tensor-parallel all-reduces and pipeline
    sends recover a given 3 ms (written to the cluster file, read back by plan), and trials that issue none leave
    it out of the fit."""
    spec = resolve_model("gpt2:vocab_size=256,n_positions=64,n_embd=128,n_layer=4,n_head=4", seq=64)
    preset = cluster_preset("local", devices_per_node=4)
    true = with_values(preset, {"peak_flops": {k: v / 2 for k, v in preset.device.peak_flops.items()},
                                "critical_op_seconds": 3e-3})
    configs = [{"zero_stage": stage, "sharded_data_parallel_degree": n} for stage, n in ((2, 4), (3, 2))]
    configs += [{"tensor_parallel_degree": 2, "prescaled_batch": True}, {"microbatches": 8}]
    configs += [{"pipeline_parallel_degree": pp, "microbatches": m} for pp, m in ((4, 8), (2, 16))]
    trials = [Trial(n, c, evaluate(spec, true, c, global_batch=32, seq=64).step_time)
              for n, c in enumerate(configs, 1)]
    fitted = calibrate(spec, preset, trials, global_batch=32, seq=64)
    assert max(abs(e) for e in fitted.errors(fitted.after)) < 0.01
    assert fitted.values["critical_op_seconds"] == pytest.approx(3e-3, rel=0.05)
    assert with_values(preset, fitted.values).critical_op_seconds == fitted.values["critical_op_seconds"]
    sharded = calibrate(spec, preset, [t for t in trials if t.trial in (1, 2, 4)], global_batch=32, seq=64)
    assert "critical_op_seconds" not in sharded.values


def test_the_cluster_file_is_read_back_by_plan_and_tune(tmp_path, recorded, capsys):
    results = tmp_path / "results"
    shutil.copytree(RECORDED, results)
    fitted, path, held = calibrate_results(results, PLANNING)
    assert path == results / "cluster.json" and held == []
    spec, cluster, trials, inputs = recorded
    again = resolve_cluster(str(path))
    assert again.devices_per_node == cluster.devices_per_node
    first = next(t for t in trials if t.trial == fitted.trials[0])
    assert evaluate(spec, again, first.config, **inputs).step_time == pytest.approx(fitted.after[0])
    assert evaluate(spec, calibrated_cluster(cluster, fitted), first.config, **inputs).step_time \
        == pytest.approx(fitted.after[0])
    assert main(["plan", "--model", PLANNING["model"], "--seq", "64", "--global-batch", "32", "--cluster", str(path),
                 "--json"]) == 0
    capsys.readouterr()
    flagged = read_cluster_file(str(path), peak_flops=1e12, devices_per_node=2)  # flags win over the file
    assert flagged.device.peak_flops["fp32"] == 1e12 and flagged.devices_per_node == 2
    assert flagged.intra_node_latency == fitted.values["intra_node_latency"]


def test_bad_cluster_files_are_one_line_each(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"preset": "local"}')
    with pytest.raises(PlanError, match="not a cluster file"):
        resolve_cluster(str(bad))
    with pytest.raises(PlanError, match="missing.json: .*No such file"):
        resolve_cluster(str(tmp_path / "missing.json"))
    bad.write_text('{"cluster_file": 1, "preset": "local", "values": {"warp_speed": 9}}')
    with pytest.raises(PlanError, match="'warp_speed' is not one a cluster file sets"):
        resolve_cluster(str(bad))


def test_calibrate_command_prints_before_and_after_and_writes_the_file(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(RECORDED, results)
    assert main(["calibrate", str(results), "--out", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "calibration: trial" in out and " before, " in out and "mean |error|" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["preset"] == "local" and data["calibration"]["mean_abs_error_after"] is not None
    (results / "summary.json").write_text("{}")
    assert main(["calibrate", str(results)]) == 2
    assert "does not say what was planned" in capsys.readouterr().err


def test_tune_calibrate_fits_the_trials_it_ran(tmp_path, monkeypatch, capsys):
    """`shardwise tune --calibrate` with each trial ending as the recorded one did."""
    rows = {json.dumps(r["config"], sort_keys=True): r for r in read_trials(RECORDED)}

    def run_trial(config, script, args, *, run_dir, **_):
        row = rows.get(json.dumps(config, sort_keys=True))
        if row is None or row["measured_step_time_s"] is None:
            return TrialResult(run_dir, 1, 1.0, failure="crash", message="not recorded")
        peaks = {int(k): v for k, v in row["peak_memory_bytes"].items()}
        return TrialResult(run_dir, 0, 1.0, Measurement(3, 2, row["measured_step_time_s"], row["samples_per_s"],
                                                        row["tokens_per_s"], peaks))

    monkeypatch.setattr(tuner, "run_trial", run_trial)
    monkeypatch.chdir(tmp_path)
    code = main(["tune", "--model", PLANNING["model"], "--seq", "64", "--global-batch", "32", "--nproc-per-node",
                 "4", "--trials", "6", "--no-bound-stop", "--calibrate", "--results", "out", "train.py"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "calibration: mean |error|" in out and (tmp_path / "out" / "cluster.json").is_file()
    ran = [r for r in read_trials(tmp_path / "out") if r["measured_step_time_s"] is not None]
    assert len(ran) >= 4   # configs the plan ranks first that the recording lacks end as failed trials
    if (tmp_path / "out" / "tune_report.html").is_file():  # with matplotlib
        page = (tmp_path / "out" / "tune_report.html").read_text()
        assert "<h2>Calibration</h2>" in page and page.count('<tr><td class="n">') == 6 + len(ran)  # tried, fitted
    assert planning_inputs(tmp_path / "out")["global_batch"] == 32
    cluster_file = str(tmp_path / "out" / "cluster.json")
    code = main(["tune", "--model", PLANNING["model"], "--seq", "64", "--global-batch", "32", "--nproc-per-node",
                 "4", "--trials", "1", "--cluster", cluster_file, "--results", "again", "train.py"])
    row = read_trials(tmp_path / "again")[0]
    assert code == (0 if row["measured_step_time_s"] is not None else 1)   # 1: no trial ran (one not recorded)
    spec = resolve_model(PLANNING["model"], seq=64)
    assert row["predicted_step_time_s"] == pytest.approx(evaluate(spec, resolve_cluster(cluster_file), row["config"],
                                                                  global_batch=32, seq=64).step_time)
    assert planning_inputs(tmp_path / "again")["cluster"] == cluster_file
