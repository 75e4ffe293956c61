"""DeepSpeed's autotuning block as shardwise tune reads it (each mapped key), what `shardwise run` says of it,
and how a base config's layout gives way to each candidate's. No launches."""

from __future__ import annotations

import json

import pytest

from shardwise.cli import build_parser, main
from shardwise.cli.tune import _settings
from shardwise.config import ConfigError
from shardwise.config.deepspeed import translate
from shardwise.config.deepspeed.autotuning import tune_settings
from shardwise.planner import cluster_preset, resolve_model
from shardwise.tune import candidates
from shardwise.tune.candidates import merged, micro_batch


def _block(**keys):
    return {"train_batch_size": 8, "autotuning": {"enabled": True, **keys}}


@pytest.mark.parametrize("key, value, setting, expected", [
    ("metric", "latency", "metric", "latency"),
    ("metric", "throughput", "metric", "throughput"),
    ("start_profile_step", 3, "warmup", 2),
    ("end_profile_step", 5, "steps", 5),
    ("tuner_type", "random", "order", "random"),
    ("tuner_type", "model_based", "order", "model_based"),
    ("tuner_early_stopping", 2, "early_stopping", 2),
    ("tuner_num_trials", 4, "trials", 4),
    ("results_dir", "tuned", "results", "tuned"),
    ("exps_dir", "exps", "runs_dir", "exps"),
    ("overwrite", True, "overwrite", True),
    ("num_tuning_micro_batch_sizes", 2, "micro_batch_sizes", 2),
    ("min_train_micro_batch_size_per_gpu", 2, "min_micro_batch", 2),
    ("max_train_micro_batch_size_per_gpu", 4, "max_micro_batch", 4),
    ("arg_mappings", {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}, "arg_mappings",
     {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}),
])
def test_each_mapped_key_sets_its_setting(key, value, setting, expected):
    assert tune_settings(_block(**{key: value})) == {setting: expected}


def test_fast_true_is_what_tune_does_and_false_is_refused():
    assert tune_settings(_block(fast=True)) == {}
    with pytest.raises(ConfigError, match="autotuning.fast"):
        tune_settings(_block(fast=False))


@pytest.mark.parametrize("keys, named", [
    ({"metric": "flops"}, "autotuning.metric='flops': is not built"),
    ({"metric": "speed"}, "is not one DeepSpeed accepts"),
    ({"tuner_type": "xgboost"}, "autotuning.tuner_type"),
    ({"tuner_num_trials": 0}, "autotuning.tuner_num_trials"),
    ({"start_profile_step": 6, "end_profile_step": 5}, "is after end_profile_step 5"),
    ({"tuner_num_trails": 3}, "unknown key"),
    ({"num_tuning_micro_batch_sizes": 0}, "autotuning.num_tuning_micro_batch_sizes"),
    ({"max_train_micro_batch_size_per_gpu": 0}, "autotuning.max_train_micro_batch_size_per_gpu"),
    ({"min_train_micro_batch_size_per_gpu": 4, "max_train_micro_batch_size_per_gpu": 2},
     "autotuning.min_train_micro_batch_size_per_gpu"),
    ({"arg_mappings": {"zero_optimization.stage": "--stage"}}, "autotuning.arg_mappings.zero_optimization.stage"),
    ({"arg_mappings": {"train_batch_size": "batch"}}, "must map config keys to the script's arguments"),
])
def test_values_tune_cannot_honour_are_one_error(keys, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("'", ".")):
        tune_settings(_block(**keys))


def test_a_block_switched_off_or_absent_sets_nothing():
    assert tune_settings({"autotuning": {"enabled": False, "metric": "latency"}}) == {}
    assert tune_settings({"train_batch_size": 8}) == {}


def test_run_notes_the_mapped_keys_and_lists_the_rest():
    t = translate(_block(metric="latency", tuner_num_trials=4, num_tuning_micro_batch_sizes=3,
                         arg_mappings={"train_micro_batch_size_per_gpu": "--batch"}, mp_size=2))
    notes, ignored = dict(t.notes), dict(t.ignored)
    assert notes["autotuning.metric"].startswith("read by shardwise tune --config as --metric")
    assert notes["autotuning.tuner_num_trials"] == "read by shardwise tune --config as --trials"
    assert notes["autotuning.arg_mappings"].startswith("read by shardwise tune --config as --arg-mapping")
    assert set(ignored) == {"autotuning.mp_size"}
    assert not t.problems


def test_flags_win_over_the_block_and_the_block_over_defaults(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_block(metric="latency", tuner_num_trials=4, end_profile_step=2)))
    parse = build_parser().parse_args
    args = parse(["tune", "--model", "gpt2", "--config", str(path), "--trials", "2", "train.py"])
    s = _settings(args)
    assert (s["trials"], s["metric"], s["steps"], s["warmup"], s["results"]) == (2, "latency", 2, 1, "tune_results")
    assert _settings(parse(["tune", "--model", "gpt2", "train.py"]))["trials"] == 3


def test_candidates_in_plan_order_or_shuffled_each_over_the_base_without_its_layout():
    spec = resolve_model("gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16")
    cluster = cluster_preset("local", devices_per_node=2)
    base = {"zero_stage": 3, "sharded_data_parallel_degree": 2, "gradient_clipping": 0.5}
    ordered = candidates(spec, cluster, base, limit=10, global_batch=4)
    assert [c.rank for c in ordered] == list(range(1, len(ordered) + 1)) and len(ordered) > 2
    assert len({json.dumps(c.config, sort_keys=True) for c in ordered}) == len(ordered)
    assert all(c.config["gradient_clipping"] == 0.5 for c in ordered)
    assert all(c.config == merged(base, c.evaluation.config) for c in ordered)
    assert any("zero_stage" not in c.config for c in ordered)  # the base's ZeRO-3 gave way
    shuffled = candidates(spec, cluster, base, limit=10, global_batch=4, shuffled=True)
    assert sorted(c.rank for c in shuffled) == [c.rank for c in ordered]
    assert [c.rank for c in shuffled] != [c.rank for c in ordered]


def test_micro_batch_sizes_try_more_microbatch_counts_of_each_layout():
    """The planner keeps each layout's best microbatch count; num_tuning_micro_batch_sizes (--micro-batch-sizes)
    adds that layout's next best counts that fit, up to that many, all in predicted order."""
    spec = resolve_model("gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16")
    cluster = cluster_preset("local", devices_per_node=2)

    def layouts(chosen):
        return [json.dumps({k: v for k, v in c.config.items() if k != "microbatches"}, sort_keys=True)
                for c in chosen]

    planned = candidates(spec, cluster, {}, limit=50, global_batch=8)
    two = candidates(spec, cluster, {}, limit=50, global_batch=8, micro_batch_sizes=2)
    assert len(set(layouts(planned))) == len(planned)          # one microbatch count per layout
    assert set(layouts(two)) == set(layouts(planned)) and max(layouts(two).count(k) for k in layouts(two)) == 2
    assert len(two) > len(planned) and two[0].config == planned[0].config
    times = [c.predicted_step_time_s for c in two]
    assert times == sorted(times) and [c.rank for c in two] == list(range(1, len(two) + 1))
    for c in two:
        values = c.batch_values(8)
        assert values["train_batch_size"] == 8 and values["gradient_accumulation_steps"] == \
            c.config.get("microbatches", 1)
        assert values["train_micro_batch_size_per_gpu"] * values["gradient_accumulation_steps"] == \
            c.evaluation.batch_size


def test_a_micro_batch_range_keeps_each_layouts_best_count_within_it(capsys):
    """DeepSpeed's min/max_train_micro_batch_size_per_gpu (--min-micro-batch, --max-micro-batch): every trial's
    micro batch per rank lies in the range; a layout whose planned count lies outside is tried at its best count
    inside; an empty range is one line."""
    spec = resolve_model("gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16")
    cluster = cluster_preset("local", devices_per_node=2)
    planned = candidates(spec, cluster, {}, limit=50, global_batch=16)
    assert any(micro_batch(c.evaluation) > 2 for c in planned)
    bounded = candidates(spec, cluster, {}, limit=50, global_batch=16, micro_batch_range=(None, 2))
    assert bounded and all(micro_batch(c.evaluation) <= 2 for c in bounded)
    layouts = {json.dumps({k: v for k, v in c.config.items() if k != "microbatches"}, sort_keys=True)
               for c in bounded}
    outside = [c for c in planned if micro_batch(c.evaluation) > 2]
    assert {json.dumps({k: v for k, v in c.config.items() if k != "microbatches"}, sort_keys=True)
            for c in outside} <= layouts
    assert all(micro_batch(c.evaluation) >= 4 for c in candidates(spec, cluster, {}, limit=50, global_batch=16,
                                                                    micro_batch_range=(4, None)))
    assert main(["tune", "--model", "gpt2", "--min-micro-batch", "4", "--max-micro-batch", "2", "train.py"]) == 2
    assert "the micro batch range 4 to 2 is empty" in capsys.readouterr().err


def test_arg_mapping_flags_are_checked(capsys):
    parse = build_parser().parse_args
    args = parse(["tune", "--model", "gpt2", "--arg-mapping", "train_micro_batch_size_per_gpu=--batch", "train.py"])
    assert _settings(args)["arg_mappings"] == {"train_micro_batch_size_per_gpu": "--batch"}
    with pytest.raises(SystemExit):
        parse(["tune", "--model", "gpt2", "--arg-mapping", "lr=--lr", "train.py"])
    assert "write KEY=--FLAG with KEY one of train_micro_batch_size_per_gpu" in capsys.readouterr().err


def test_overwrite_clears_an_earlier_run_and_its_trials_or_refuses_them(tmp_path, capsys):
    from shardwise.cli.tune import _clear

    (tmp_path / "trial1" / "metrics").mkdir(parents=True)
    for name in ("trials.jsonl", "trial1.config.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    assert not _clear(tmp_path, tmp_path, overwrite=False)
    assert "trials.jsonl exists; pass another --results, or --overwrite" in capsys.readouterr().err
    assert _clear(tmp_path, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_base_configs_layout_keys_give_way_to_the_planned_layout():
    """Every layout key the planner searches, context and expert parallelism included, comes from the plan: a
    base config's `context_parallel_degree` does not survive into a planned layout without it."""
    base = {"context_parallel_degree": 2, "context_parallel_mode": "all_to_all", "expert_parallel_degree": 2,
            "zero_stage": 3, "bf16": True}
    assert merged(base, {"tensor_parallel_degree": 2}) == {"bf16": True, "tensor_parallel_degree": 2}
