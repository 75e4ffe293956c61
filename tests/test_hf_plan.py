"""`shardwise plan --training-args`: a Trainer script's TrainingArguments as the planner's inputs.

The script's flags (or its arguments' JSON file) give each replica's rows per micro-step, the precision, the
activation checkpointing and, with `--deepspeed`, the one layout that config runs once its "auto" values are
filled for the planned cluster; the plan printed is the planner's own for those inputs.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from shardwise.cli import main
from shardwise.config.sources import read_deepspeed
from shardwise.hf.plan import TrainerRun, trainer_run
from shardwise.planner import cluster_preset, evaluate, plan, resolve_model, to_json

CLUSTER = "2xp4d.24xlarge"  # 16 devices
MODEL = "gpt2-10b"
DEEPSPEED = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "train_batch_size": "auto",
             "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
             "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}


def _plan_json(*flags: str) -> tuple[int, list, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", "--model", MODEL, "--cluster", CLUSTER, "--json", *flags])
    return code, json.loads(out.getvalue()) if code == 0 else [], err.getvalue()


def test_the_script_flags_give_batch_precision_and_checkpointing():
    flags = ("--model_name_or_path gpt2 --output_dir out --per_device_train_batch_size 8 "
             "--gradient_accumulation_steps 2 --bf16 --gradient_checkpointing --block_size 512")
    assert trainer_run(flags, 16) == TrainerRun(8, 2, "bf16", "each")
    assert trainer_run("--per_device_train_batch_size 2 --fp16", 4) == TrainerRun(2, 1, "fp16", "none")


def test_a_deepspeed_config_among_them_is_filled_for_the_planned_world(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(DEEPSPEED))
    args = {"output_dir": "out", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "bf16": True,
            "deepspeed": str(tmp_path / "ds.json"), "model_name_or_path": "gpt2"}  # the script's own key too
    (tmp_path / "args.json").write_text(json.dumps(args))
    run = trainer_run(str(tmp_path / "args.json"), 16)
    assert (run.per_device_batch, run.accumulation, run.precision) == (2, 4, "bf16")
    # the Trainer drives the batch keys itself, and the schedule's and buckets' "auto" wait for the model
    assert run.deepspeed == {"bf16": {"enabled": True}, "fp16": {"enabled": False}, "gradient_clipping": 1.0,
                             "zero_optimization": {"stage": 3},
                             "optimizer": {"type": "AdamW", "params": {"lr": 5e-05}}}


def test_plan_ranks_the_layouts_for_the_trainer_run():
    code, rows, err = _plan_json("--training-args=--per_device_train_batch_size 4 --bf16 --gradient_checkpointing")
    assert code == 0, err
    spec, cluster = resolve_model(MODEL), cluster_preset(CLUSTER)
    want = plan(spec, cluster, global_batch=4 * 16, precision="bf16")
    each = [e for e in want.considered if e.checkpointing == "each" or e.memory is None]
    assert rows == json.loads(json.dumps(to_json(type(want)(spec, cluster, 64, want.seq, "bf16", each))))
    assert {row["activation_checkpointing"] for row in rows if row["memory_bytes"]} == {"each"}
    best = next(row for row in rows if row["fits"])
    assert f"per_device_train_batch_size {best['batch_size']} (each of the " in err


def test_plan_with_the_deepspeed_config_predicts_its_layout(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(DEEPSPEED))
    code, rows, err = _plan_json(f"--training-args=--per_device_train_batch_size 2 --bf16 --deepspeed "
                                 f"{tmp_path / 'ds.json'}")
    assert code == 0, err
    data = read_deepspeed(trainer_run(f"--per_device_train_batch_size 2 --bf16 --deepspeed {tmp_path / 'ds.json'}",
                                      16).deepspeed)
    want = evaluate(resolve_model(MODEL), cluster_preset(CLUSTER), data, global_batch=2 * 16)
    assert len(rows) == 1 and rows[0]["layout"] == want.layout.degrees() and rows[0]["batch_size"] == 2
    assert rows[0]["memory_bytes"] == want.memory.summary() and rows[0]["step_time_s"] == want.time.total


@pytest.mark.parametrize("flag", [["--precision", "fp32"], ["--global-batch", "32"], ["--checkpointing", "each"]])
def test_flags_the_arguments_set_are_refused_beside_them(flag):
    code, _, err = _plan_json("--training-args=--per_device_train_batch_size 4", *flag)
    assert code == 2
    assert err.strip() == (f"shardwise plan: {flag[0]} does not go with --training-args: the TrainingArguments set "
                           f"it; drop {flag[0]}")


def test_a_deepspeed_value_the_arguments_contradict_is_one_error(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({**DEEPSPEED, "train_micro_batch_size_per_gpu": 4}))
    code, _, err = _plan_json(f"--training-args=--per_device_train_batch_size 2 --deepspeed {tmp_path / 'ds.json'}")
    assert code == 2
    assert "train_micro_batch_size_per_gpu" in err and "per_device_train_batch_size" in err
