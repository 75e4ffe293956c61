"""shardwise tune: trials of a tiny script on 2 CPU ranks through real launches, each failure kind caught and
named while the next trial runs; `shardwise run --autotuning run` on 4 ranks, its best config accepted as `shardwise
run` validates it and then trained with; the accuracy figures, the step limit's input and what --autotuning
refuses on their own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from shardwise.cli import main
from shardwise.config import ConfigError
from shardwise.config.layout import validate
from shardwise.config.sources import load_dict
from shardwise.planner import cluster_preset, evaluate, spec_from_builder
from shardwise.runtime.step_limit import STOP_AFTER_STEPS_ENV, step_limit
from shardwise.topology import Cluster
from shardwise.tune import Candidate, TuneSettings, planner_accuracy, run_trial, spearman, tune
from shardwise.tune.trial import _wait, classify
from tune_scripts import TRAIN_SCRIPT


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The script as module tiny_tune (the planner builds its model from tiny_tune:build), run from tmp_path."""
    (tmp_path / "tiny_tune.py").write_text(textwrap.dedent(TRAIN_SCRIPT))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _candidate(rank, spec, cluster, config):
    try:
        evaluation = evaluate(spec, cluster, config, global_batch=8)
    except ConfigError:  # a config refused on this cluster: the prediction shown beside it is plain DDP's
        evaluation = evaluate(spec, cluster, {}, global_batch=8)
    return Candidate(rank, config, evaluation)


def test_trials_survive_each_failure_and_keep_the_measured_best(tiny):
    spec = spec_from_builder("tiny_tune:build", input_shape=(16,))
    cluster = cluster_preset("local", devices_per_node=2)
    configs = [{}, {"zero_stage": 3, "sharded_data_parallel_degree": 2},
               {"zero_stage": 2, "sharded_data_parallel_degree": 2}, {"sharded_data_parallel_degree": 3}]
    chosen = [_candidate(i, spec, cluster, c) for i, c in enumerate(configs, 1)]
    settings = TuneSettings(script="tiny_tune.py", script_args=("--inject-failures",), nproc=2, steps=2, warmup=1, metric="latency",
                            trial_deadline_s=300, results=tiny / "results")
    result = tune(chosen, settings)
    kinds = [row["failure"] for row in result.rows]
    assert kinds == [None, "crash", "out_of_memory", "refused"], [r["message"] for r in result.rows]
    assert "injected crash under ZeRO-3" in result.rows[1]["message"]
    assert "can't allocate memory" in result.rows[2]["message"]
    assert "sharded_data_parallel_degree" in result.rows[3]["message"]
    best = result.rows[0]  # step 2, after one warm-up step, on both ranks
    assert result.best is best and best["measured_steps"] == 1 and set(best["peak_memory_bytes"]) == {"0", "1"}
    assert best["measured_step_time_s"] > 0 and best["step_time_error"] is not None
    assert result.accuracy.trials == 1 and result.accuracy.regret == 1.0
    assert [json.loads(line)["trial"] for line in (tiny / "results" / "trials.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4]


def test_a_hanging_trial_is_stopped_at_its_deadline(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(600)\n")
    result = run_trial({}, str(script), [], nproc=1, steps=2, warmup=1, deadline_s=3, run_dir=tmp_path / "trial1")
    assert result.failure == "hang" and "deadline of 3 s" in result.message
    assert result.exit_code is not None  # the launch ended (stopped), it was not left running


def test_failure_kinds_from_what_the_launch_said():
    assert classify(2, "shardwise run: sharded_data_parallel_degree=3 ...", "")[0] == "refused"
    assert classify(1, "", "shardwise.errors.ConfigError: bad key")[0] == "refused"
    assert classify(1, "", "torch.OutOfMemoryError: CUDA out of memory.")[0] == "out_of_memory"
    killed = "shardwise run: rank 1 (node 0, local rank 1) failed first (killed by SIGKILL)"
    assert classify(-9, killed, "")[0] == "out_of_memory"
    stopped_later = "shardwise run: rank 0 (node 0, local rank 0) failed first (exit code 1)\nalso failed: rank 1 " \
                    "(killed by SIGKILL)"
    assert classify(1, stopped_later, "ValueError: boom")[0] == "crash"
    assert classify(1, "", "ValueError: boom")[0] == "crash"


def test_deadline_stops_a_process_that_does_not_end():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stderr=subprocess.PIPE,
                            text=True)
    code, _, hung = _wait(proc, 0.5)
    assert hung and code is not None


def test_spearman_and_regret():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2], [1, 2, 3]) == pytest.approx(0.8660254)
    assert spearman([1], [1]) is None
    rows = [{"plan_rank": 1, "predicted_step_time_s": 1.0, "measured_step_time_s": 3.0, "step_time_error": -2 / 3},
            {"plan_rank": 2, "predicted_step_time_s": 2.0, "measured_step_time_s": 2.0, "step_time_error": 0.0},
            {"plan_rank": 3, "predicted_step_time_s": 3.0, "measured_step_time_s": None}]
    accuracy = planner_accuracy(rows)
    assert accuracy.trials == 2 and accuracy.regret == pytest.approx(1.5)
    assert accuracy.spearman_step_time == pytest.approx(-1.0)
    assert accuracy.mean_abs_step_time_error == pytest.approx(1 / 3)


def test_step_limit_reads_its_variable(monkeypatch):
    monkeypatch.delenv(STOP_AFTER_STEPS_ENV, raising=False)
    assert step_limit() is None
    monkeypatch.setenv(STOP_AFTER_STEPS_ENV, "3")
    assert step_limit() == 3
    monkeypatch.setenv(STOP_AFTER_STEPS_ENV, "0")
    with pytest.raises(ValueError, match="set it to an integer >= 1"):
        step_limit()




def test_run_autotuning_run_tunes_then_trains_with_the_best_config(tmp_path, monkeypatch, capsys):
    """DeepSpeed's `deepspeed --autotuning run train.py --deepspeed --deepspeed_config ds.json` as `shardwise
    run`: the script's DeepSpeed config's autotuning block sets the tuner (1 trial of 2 steps, results in tuned/,
    the trial's microbatch count passed as --accum), then the real training runs all its steps on 4 ranks under
    best_config.json with the best trial's arguments."""
    (tmp_path / "tiny_auto.py").write_text(textwrap.dedent(TRAIN_SCRIPT))
    (tmp_path / "ds.json").write_text(json.dumps({"autotuning": {
        "enabled": True, "tuner_num_trials": 1, "end_profile_step": 2, "results_dir": "tuned",
        "arg_mappings": {"gradient_accumulation_steps": "--accum"}}}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["run", "--autotuning", "run", "--model", "tiny_auto:build", "--nproc-per-node", "4", "tiny_auto.py",
                 "--steps", "3", "--deepspeed", "--deepspeed_config", "ds.json"])
    out = capsys.readouterr().out
    assert code == 0, out
    tuned = tmp_path / "tuned"
    rows = [json.loads(line) for line in (tuned / "trials.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["failure"] is None and rows[0]["measured_steps"] == 1
    assert rows[0]["plan_rank"] == 1 and set(rows[0]["peak_memory_bytes"]) == {"0", "1", "2", "3"}
    best = load_dict(str(tuned / "best_config.json"))  # as `shardwise run --config` reads it
    assert best == rows[0]["config"]
    validate(best, Cluster(nodes=1, devices_per_node=4))
    assert (tuned / "best_cmd.txt").read_text().startswith("shardwise run --nproc-per-node 4 --config ")
    assert "regret of its pick 1.00" in out and "best (throughput): trial 1" in out
    assert 'alt="predicted and measured"' in (tuned / "tune_report.html").read_text()
    trained = json.loads((tmp_path / "trained0.json").read_text())
    assert trained["steps"] == 3 and all(trained["config"].get(k) == v for k, v in best.items())
    accum = best.get("microbatches", 1)
    assert rows[0]["script_args"][-2:] == ["--accum", str(accum)] and trained["accum"] == accum
    assert "shardwise tune: running the best config: shardwise run --nproc-per-node 4 --config" in out
    assert main(["tune", "--model", "tiny_auto:build", "--results", "tuned", "x.py"]) == 2
    assert "trials.jsonl exists" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--autotuning", "tune"], "--autotuning needs --model MODEL"),
    (["--model", "gpt2"], "--model is read only with --autotuning"),
    (["--autotuning", "run", "--model", "gpt2", "--nproc-per-node", "2", "--include", "localhost:0"],
     "--include is not taken with --autotuning"),
    (["--autotuning", "tune", "--model", "gpt2", "--set", "microbatches=2"], "--set is not taken with --autotuning"),
    (["--autotuning", "tune", "--model", "gpt2"], "--autotuning needs --nproc-per-node N"),
])
def test_run_autotuning_refuses_what_it_cannot_honour(flags, says, capsys):
    assert main(["run", *flags, "train.py"]) == 2
    assert says in capsys.readouterr().err


def test_run_autotuning_passes_the_node_flags_on(monkeypatch):
    """`shardwise run --autotuning` across nodes is `shardwise tune` with the same node flags, on every node."""
    from shardwise.cli import tune as tune_cli

    seen = {}
    monkeypatch.setattr(tune_cli, "run", lambda args: seen.update(vars(args)) or 0)
    assert main(["run", "--autotuning", "tune", "--model", "gpt2", "--nproc-per-node", "2", "--nnodes", "2",
                 "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29611", "train.py"]) == 0
    assert (seen["nnodes"], seen["node_rank"], seen["master_addr"], seen["master_port"], seen["nproc_per_node"]) \
        == (2, 1, "10.0.0.1", 29611, 2)


def test_the_scripts_deepspeed_config_is_found_as_deepspeed_finds_it():
    from shardwise.cli.tune import deepspeed_config_arg

    assert deepspeed_config_arg(["--deepspeed", "--deepspeed_config", "ds.json"]) == "ds.json"
    assert deepspeed_config_arg(["--deepscale_config=old.json", "--lr", "1"]) == "old.json"
    assert deepspeed_config_arg(["--lr", "1"]) is None
