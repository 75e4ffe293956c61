"""The tuning loop's choices without launches: the best by each metric, early stopping, the time budget. Trials are
replaced by the results a launch would give (measured or failed), so each rule is checked on its own."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shardwise.planner import cluster_preset, resolve_model
from shardwise.tune import TrialResult, TuneSettings, candidates, tune
from shardwise.tune import tuner
from shardwise.tune.bound import cannot_win
from shardwise.tune.results import write_results
from shardwise.tune.measure import Measurement


@pytest.fixture(scope="module")
def chosen():
    spec = resolve_model("gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16")
    return candidates(spec, cluster_preset("local", devices_per_node=2), {}, limit=4, global_batch=4)


def _trials(monkeypatch, outcomes, clock=None):
    """Trial N ends as outcomes[N-1]: (step time, samples/s, peak bytes), or a failure kind."""
    calls = []

    def run_trial(config, script, args, *, run_dir, **_):
        calls.append(run_dir.name)
        outcome = outcomes[len(calls) - 1]
        if clock is not None:
            clock[0] += 10.0
        if isinstance(outcome, str):
            return TrialResult(run_dir, 1, 1.0, failure=outcome, message=outcome)
        step, rate, peak = outcome
        return TrialResult(run_dir, 0, 1.0, Measurement(3, 2, step, rate, None, {0: peak, 1: peak // 2}))

    monkeypatch.setattr(tuner, "run_trial", run_trial)
    if clock is not None:
        monkeypatch.setattr(tuner.time, "monotonic", lambda: clock[0])
    return calls


OUTCOMES = [(0.3, 10.0, 500), "crash", (0.2, 12.0, 700), (0.25, 14.0, 400)]


@pytest.mark.parametrize("metric, best", [("latency", 3), ("throughput", 4), ("memory", 4)])
def test_the_best_by_each_metric(monkeypatch, tmp_path, chosen, metric, best):
    _trials(monkeypatch, OUTCOMES)
    result = tune(chosen, TuneSettings(script="x.py", metric=metric, bound_margin=None, results=tmp_path))
    assert result.best["trial"] == best and len(result.rows) == 4
    assert (tmp_path / "trials.jsonl").read_text().count("\n") == 4


def test_a_run_that_cannot_go_on_stops_before_its_next_trial(tmp_path, chosen):
    """Across nodes a node that stopped answering halts the run (tune/nodes.py): no further launch would meet."""
    ran = []

    def runner(config, run_dir, script_args):
        ran.append(run_dir.name)
        return TrialResult(run_dir, 1, 1.0, failure="crash", message="node 1 sent no report")

    result = tune(chosen, TuneSettings(script="x.py", bound_margin=None, results=tmp_path), runner=runner,
                  halted=lambda: "node 1 stopped answering" if ran else None)
    assert ran == ["trial1"] and result.stopped == "node 1 stopped answering" and len(result.rows) == 1


def test_arg_mappings_pass_each_trials_batch_to_the_script(tmp_path, chosen):
    """DeepSpeed's arg_mappings: the trial's micro batch and microbatch count replace the script's own arguments
    (or are added), and the best trial's arguments are in best_cmd.txt."""
    seen = []

    def runner(config, run_dir, script_args):
        seen.append(script_args)
        return TrialResult(run_dir, 0, 1.0, Measurement(3, 2, 0.1 * len(seen), 10.0, None, {0: 1}))

    settings = TuneSettings(script="x.py", script_args=("--per_device_train_batch_size", "99", "--lr=1"),
                            bound_margin=None, results=tmp_path, planning={"global_batch": 4},
                            arg_mappings={"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                                          "gradient_accumulation_steps": "--gradient_accumulation_steps"})
    result = tune(chosen, settings, runner=runner)
    for candidate, args in zip(chosen, seen):
        values = candidate.batch_values(4)
        assert args == ("--per_device_train_batch_size", str(values["train_micro_batch_size_per_gpu"]), "--lr=1",
                        "--gradient_accumulation_steps", str(values["gradient_accumulation_steps"]))
    assert result.rows[0]["script_args"] == list(seen[0])
    write_results(result, settings)
    assert (tmp_path / "best_cmd.txt").read_text().rstrip().endswith("x.py " + " ".join(seen[0]))


def test_with_arguments_sets_a_flag_where_it_is_given_or_adds_it():
    from shardwise.tune.tuner import with_arguments

    assert with_arguments(["--a", "1", "--b=2", "pos"], {"--a": "5", "--b": "6", "--c": "7"}) == \
        ("--a", "5", "--b=6", "pos", "--c", "7")
    assert with_arguments([], {}) == ()


def test_early_stopping_after_trials_that_do_not_beat_the_best(monkeypatch, tmp_path, chosen):
    calls = _trials(monkeypatch, [(0.2, 12.0, 500), "crash", (0.3, 10.0, 500), (0.1, 20.0, 500)])
    result = tune(chosen, TuneSettings(script="x.py", early_stopping=2, results=tmp_path))
    assert calls == ["trial1", "trial2", "trial3"] and result.best["trial"] == 1
    assert "2 trials in a row did not beat the best" in result.stopped


def test_no_trial_starts_after_the_time_budget(monkeypatch, tmp_path, chosen):
    calls = _trials(monkeypatch, OUTCOMES, clock=[0.0])  # each trial takes 10 s on this clock
    result = tune(chosen, TuneSettings(script="x.py", time_budget_s=15, results=tmp_path))
    assert calls == ["trial1", "trial2"] and "time budget of 15 s was spent after 2 trials" in result.stopped


def test_runs_go_to_their_own_directory(monkeypatch, tmp_path, chosen):
    seen = []
    monkeypatch.setattr(tuner, "run_trial", lambda *a, run_dir, **k: seen.append(run_dir) or TrialResult(
        run_dir, 1, 1.0, failure="crash", message="x"))
    result = tune(chosen[:1], TuneSettings(script="x.py", results=tmp_path / "r", runs=tmp_path / "exps"))
    assert seen == [Path(tmp_path / "exps" / "trial1")] and result.best is None


def test_the_report_shows_each_trial_and_its_plot_loads(monkeypatch, tmp_path, chosen):
    pytest.importorskip("matplotlib")
    from test_observe_report import _BROWSER, images_in_browser

    from shardwise.tune.report import write_tune_report

    _trials(monkeypatch, OUTCOMES)
    settings = TuneSettings(script="x.py", metric="latency", bound_margin=None, results=tmp_path / "results")
    page = write_tune_report(tune(chosen, settings), settings)
    html = page.read_text()
    assert html.count("<tr><td class=\"n\">") == 4 and "crash" in html and "trial 3" in html
    assert "regret of the planner&#39;s pick</th><td>1.50" in html  # plan #1: 0.3 s, the best: 0.2 s
    if _BROWSER is None:
        pytest.skip("no Chromium to open the report in (Debian: apt-get install -y chromium)")
    assert images_in_browser(page, tmp_path) == {"predicted and measured": "yes"}


def _predicting(chosen, step_times):
    """The candidates with the planner's step time set to `step_times` (their compute part moved to fit)."""
    out = []
    for c, t in zip(chosen, step_times):
        time = replace(c.evaluation.time, compute=c.evaluation.time.compute + t - c.evaluation.step_time)
        out.append(replace(c, evaluation=replace(c.evaluation, time=time)))
    return out


def test_the_planners_bound_stops_when_no_remaining_candidate_can_win(monkeypatch, tmp_path, chosen):
    # Measured 2.0 and 2.27 × the prediction: the best case of a candidate predicted 0.30 s is 0.30 × 2.0 × 0.9.
    calls = _trials(monkeypatch, [(0.2, 12.0, 500), (0.25, 10.0, 500), (0.1, 20.0, 500), (0.1, 20.0, 500)])
    result = tune(_predicting(chosen, [0.10, 0.11, 0.30, 0.40]), TuneSettings(script="x.py", metric="latency",
                                                                              results=tmp_path))
    assert calls == ["trial1", "trial2"] and result.best["trial"] == 1
    assert result.stopped.startswith("the 2 remaining candidates cannot beat trial 1 by the planner's bound")
    assert "measured/predicted 2 and a 10% margin is 0.54 s/step, the measured best 0.2 s/step" in result.stopped
    write_results(result, TuneSettings(script="x.py", metric="latency", results=tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"] == result.stopped


def test_the_bound_lets_a_candidate_run_while_its_best_case_can_win(monkeypatch, tmp_path, chosen):
    # After two trials 0.105 × 2.0 × 0.9 = 0.189 s could beat 0.2 s, so trial 3 runs; then 0.40 s cannot.
    calls = _trials(monkeypatch, [(0.2, 12.0, 500), (0.25, 10.0, 500), (0.21, 11.0, 500), (0.1, 20.0, 500)])
    predicted = _predicting(chosen, [0.10, 0.11, 0.105, 0.40])
    result = tune(predicted, TuneSettings(script="x.py", metric="latency", results=tmp_path))
    assert calls == ["trial1", "trial2", "trial3"] and "1 remaining candidates cannot beat" in result.stopped
    calls = _trials(monkeypatch, [(0.2, 12.0, 500), (0.25, 10.0, 500), (0.21, 11.0, 500), (0.1, 20.0, 500)])
    result = tune(predicted, TuneSettings(script="x.py", metric="latency", bound_margin=None, results=tmp_path / "b"))
    assert len(calls) == 4 and result.best["trial"] == 4 and result.stopped == "every candidate was tried"


def test_the_bound_on_throughput_and_what_it_needs(chosen):
    rows = [{"trial": 1, "samples_per_s": 10.0}, {"trial": 2, "samples_per_s": 8.0}, {"trial": 3, "failure": "crash"}]
    slow = _predicting(chosen, [1.0, 1.0, 4.0, 4.0])  # 4 sequences planned per step: 4 and 1 samples/s predicted
    tried = list(zip(slow[:3], rows))
    bound = cannot_win("throughput", True, "samples_per_s", tried, slow[3:], rows[0], 0.1)
    assert bound and bound.ratio == pytest.approx(2.5) and bound.best_case == pytest.approx(1 * 2.5 * 1.1)
    assert cannot_win("throughput", True, "samples_per_s", tried[:1], slow[3:], rows[0], 0.1) is None  # one ratio
    assert cannot_win("throughput", True, "samples_per_s", tried, slow[:1], rows[0], 0.1) is None  # 11 > 10
