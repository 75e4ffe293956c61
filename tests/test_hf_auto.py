"""A DeepSpeed config's "auto" values, filled as the Hugging Face Trainer fills them (one test per key).

`fill_from_trainer` is transformers' `trainer_config_process` (from the TrainingArguments, when they are made),
`fill_from_model` its `trainer_config_finalize` (from the model and the run's steps, when training starts): each
fills the keys it owns where they are "auto", and a value the Trainer's differs from is a problem naming both.
Where DeepSpeed and transformers' integration are installed, the public Hugging Face configs are filled by
transformers itself too, and both must agree.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from shardwise.config import ConfigError
from shardwise.config.deepspeed.auto import (TRAINER_KEYS, TrainerArguments, auto_keys, fill_from_model,
                                             fill_from_trainer, unfilled_problem)

CONFIGS = Path(__file__).parent / "data" / "deepspeed_configs"
ARGS = TrainerArguments(world_size=4, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                        max_grad_norm=0.5, learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7,
                        weight_decay=0.1)


def nested(path: str, value) -> dict:
    """{"a": {"b": value}} for "a.b"."""
    *parents, key = path.split(".")
    data = {key: value}
    for name in reversed(parents):
        data = {name: data}
    return data


def read(data: dict, path: str):
    for name in path.split("."):
        data = data[name]
    return data


# (key, what the first pass fills it with, the TrainingArguments key named in a mismatch)
FIRST_PASS = [
    ("train_micro_batch_size_per_gpu", 3, "per_device_train_batch_size"),
    ("gradient_accumulation_steps", 2, "gradient_accumulation_steps"),
    ("train_batch_size", 4 * 3 * 2, "train_batch_size"),
    ("gradient_clipping", 0.5, "max_grad_norm"),
    ("optimizer.params.lr", 2e-4, "learning_rate"),
    ("optimizer.params.betas", [0.8, 0.95], "adam_beta1, adam_beta2"),
    ("optimizer.params.eps", 1e-7, "adam_epsilon"),
    ("optimizer.params.weight_decay", 0.1, "weight_decay"),
    ("scheduler.params.warmup_max_lr", 2e-4, "learning_rate"),
    ("fp16.enabled", False, "fp16"),
    ("bf16.enabled", False, "bf16"),
]


@pytest.mark.parametrize("path,value,_", FIRST_PASS, ids=[case[0] for case in FIRST_PASS])
def test_first_pass_fills_each_key_from_the_training_arguments(path, value, _):
    filled = fill_from_trainer(nested(path, "auto"), ARGS)
    assert filled.problems == [] and read(filled.data, path) == value


@pytest.mark.parametrize("path,value,trainer_key", FIRST_PASS, ids=[case[0] for case in FIRST_PASS])
def test_first_pass_refuses_each_value_the_training_arguments_differ_from(path, value, trainer_key):
    other = [9, 9] if isinstance(value, list) else (not value if isinstance(value, bool) else 99)
    problems = fill_from_trainer(nested(path, other), ARGS).problems
    assert len(problems) == 1 and problems[0].path == path and problems[0].value == other
    assert f"Trainer's {trainer_key}" in problems[0].rule.replace("[adam_beta1, adam_beta2]", "adam_beta1, adam_beta2")
    assert "auto" in problems[0].fix
    assert fill_from_trainer(nested(path, copy.deepcopy(value)), ARGS).problems == []  # an equal value is fine


def test_flags_count_the_full_evaluation_precisions():
    assert fill_from_trainer(nested("fp16.enabled", "auto"), TrainerArguments(fp16=True)).data["fp16"]["enabled"]
    assert fill_from_trainer(nested("bf16.enabled", "auto"), TrainerArguments(bf16=True)).data["bf16"]["enabled"]


def test_warmup_min_lr_is_zero_and_never_a_mismatch():
    assert fill_from_trainer(nested("scheduler.params.warmup_min_lr", "auto"), ARGS).data["scheduler"]["params"] == {
        "warmup_min_lr": 0}
    assert fill_from_trainer(nested("scheduler.params.warmup_min_lr", 1e-6), ARGS).problems == []


def test_a_batch_size_finder_fills_batch_sizes_without_mismatches():
    args = TrainerArguments(per_device_train_batch_size=3, auto_find_batch_size=True)
    config = {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 64, "gradient_accumulation_steps": 4}
    problems = fill_from_trainer(config, args).problems
    assert [p.path for p in problems] == ["gradient_accumulation_steps"]


def test_absent_sections_and_keys_stay_absent():
    assert fill_from_trainer({}, ARGS).data == {}
    assert fill_from_trainer({"optimizer": {"type": "AdamW"}}, ARGS).data == {"optimizer": {"type": "AdamW"}}


def test_save_on_each_node_asks_for_node_local_storage():
    data = fill_from_trainer({"checkpoint": {"tag_validation": "Warn"}}, TrainerArguments(save_on_each_node=True)).data
    assert data["checkpoint"] == {"tag_validation": "Warn", "use_node_local_storage": True}


def test_mixed_precision_turns_on_an_absent_section_and_refuses_the_other_one_on():
    assert fill_from_trainer({}, TrainerArguments(bf16=True, mixed_precision="bf16")).data == {"bf16": {"enabled": True}}
    full_eval_fp16 = TrainerArguments(bf16=True, fp16=True, mixed_precision="bf16")  # bf16 with fp16_full_eval
    problems = fill_from_trainer({"fp16": {"enabled": "auto"}}, full_eval_fp16).problems
    assert [p.path for p in problems] == ["fp16.enabled"] and "refuses both" in problems[0].rule
    problems = fill_from_trainer({"fp16": {"enabled": True}}, TrainerArguments(bf16=True, mixed_precision="bf16")
                                 ).problems
    assert [p.path for p in problems] == ["fp16.enabled"] and "Trainer's fp16" in problems[0].rule


def test_the_input_is_left_as_it_was():
    data = {"optimizer": {"params": {"lr": "auto"}}}
    fill_from_trainer(data, ARGS)
    assert data == {"optimizer": {"params": {"lr": "auto"}}}


# ----- the second pass -----

HIDDEN = 64
SECOND_PASS = [
    ("zero_optimization.reduce_bucket_size", 2, HIDDEN * HIDDEN),
    ("zero_optimization.reduce_bucket_size", 3, HIDDEN * HIDDEN),
    ("zero_optimization.stage3_prefetch_bucket_size", 3, int(0.9 * HIDDEN * HIDDEN)),
    ("zero_optimization.stage3_param_persistence_threshold", 3, 10 * HIDDEN),
]


@pytest.mark.parametrize("path,stage,value", SECOND_PASS)
def test_second_pass_fills_bucket_sizes_from_the_hidden_size(path, stage, value):
    data = nested(path, "auto")
    data["zero_optimization"]["stage"] = stage
    filled = fill_from_model(data, HIDDEN, 10, 2)
    assert filled.problems == [] and read(filled.data, path) == value


@pytest.mark.parametrize("path", ["zero_optimization.stage3_prefetch_bucket_size",
                                  "zero_optimization.stage3_param_persistence_threshold"])
def test_stage_3_bucket_sizes_stay_auto_below_stage_3(path):
    data = nested(path, "auto")
    data["zero_optimization"]["stage"] = 2
    assert auto_keys(fill_from_model(data, HIDDEN, 10, 2).data) == [path]


def test_bucket_sizes_need_a_hidden_size_only_where_auto():
    data = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    problems = fill_from_model(data, None, 10, 2).problems
    assert len(problems) == 1 and problems[0].path == "zero_optimization.reduce_bucket_size"
    assert "neither hidden_size nor hidden_sizes" in problems[0].rule
    assert fill_from_model({"zero_optimization": {"reduce_bucket_size": 5}}, None, 10, 2).problems == []


def test_second_pass_fills_the_schedule_steps():
    data = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    assert fill_from_model(data, None, 40, 4).data["scheduler"]["params"] == {"total_num_steps": 40,
                                                                                "warmup_num_steps": 4}


def test_no_warmup_is_one_warmup_step():
    data = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    assert fill_from_model(data, None, 40, 0).data["scheduler"]["params"]["warmup_num_steps"] == 1


@pytest.mark.parametrize("path,value,named", [("scheduler.params.total_num_steps", 39, "optimizer steps"),
                                              ("scheduler.params.warmup_num_steps", 3, "warmup_steps")])
def test_second_pass_refuses_schedule_steps_the_run_differs_from(path, value, named):
    problems = fill_from_model(nested(path, value), None, 40, 4).problems
    assert [p.path for p in problems] == [path] and named in problems[0].rule


def test_an_auto_the_trainer_does_not_own_is_named():
    problem = unfilled_problem(["zero_optimization.stage", "optimizer.params.amsgrad"])
    assert problem.path == "zero_optimization.stage, optimizer.params.amsgrad"
    assert "no key the Hugging Face Trainer fills" in str(ConfigError([problem]))


def test_every_auto_in_the_public_hugging_face_configs_is_a_trainer_key():
    for name in ("hf_transformers_ds_config_zero2.json", "accelerate_ds_config_zero2.json"):
        assert set(auto_keys(json.loads((CONFIGS / name).read_text()))) <= set(TRAINER_KEYS), name


# ----- against transformers' own integration -----

def _transformers_filled(data: dict, hidden: int, steps: int) -> dict:
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    class Model:  # what trainer_config_finalize reads of the model
        class config:
            hidden_size = hidden

    args = TrainingArguments("unused", per_device_train_batch_size=3, gradient_accumulation_steps=1,
                             max_grad_norm=0.5, learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95,
                             adam_epsilon=1e-7, weight_decay=0.1, warmup_steps=2, report_to=[])
    config = HfTrainerDeepSpeedConfig(copy.deepcopy(data))
    try:
        config.trainer_config_process(args)
        config.trainer_config_finalize(args, Model(), steps)
        return config.config
    finally:
        unset_hf_deepspeed_config()


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["hf_transformers_ds_config_zero2.json", "accelerate_ds_config_zero2.json"])
def test_public_configs_are_filled_as_transformers_fills_them(name):
    pytest.importorskip("deepspeed")
    data = json.loads((CONFIGS / name).read_text())
    data["zero_optimization"]["stage3_param_persistence_threshold"] = "auto"  # a stage-3 key at stage 2
    args = TrainerArguments(world_size=1, per_device_train_batch_size=3, gradient_accumulation_steps=1,
                            max_grad_norm=0.5, learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95,
                            adam_epsilon=1e-7, weight_decay=0.1)
    first = fill_from_trainer(data, args)
    ours = fill_from_model(first.data, HIDDEN, 40, 2)
    assert first.problems == [] and ours.problems == []
    assert ours.data == _transformers_filled(data, HIDDEN, 40)
