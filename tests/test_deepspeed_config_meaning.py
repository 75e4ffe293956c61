"""DeepSpeed configs read with DeepSpeed's meaning: one regression test per defect found by reading 50 public
configs, each checking the message a user sees, and the public configs of tests/data/deepspeed_configs read as
DeepSpeed reads them (or refused with the one "auto" error).

- MiCS (`mics_shard_size`) is partition groups; its hierarchical gather is honoured differently, and said how;
- the legacy offload keys (`cpu_offload`, `cpu_offload_param(s)`, `cpu_offload_use_pin_memory`) map as DeepSpeed
  maps them;
- "auto" never turns fp16/bf16 on, and is one error naming every key that holds it;
- optimizer and scheduler values are checked before launch; DeepSpeed's optimizer names in any case, Lamb with
  DeepSpeed's rule, Adam's adam_w_mode and bias_correction; unknown and 1-bit optimizers named by type;
- steps_per_print throttles the DeepSpeed engine's console line only, never metrics_interval;
- every key DeepSpeed reads is known (honoured, honoured differently, or listed), a truly unknown one an error;
- a metrics sink whose package is missing is refused before launch;
- SMP's `overlapping_allreduce` config key is accepted with its note;
- `shardwise plan --config` predicts a DeepSpeed config; hpZ reaches its shardwise key.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from shardwise.api.configured import DeepSpeedLamb, _torch_optimizer
from shardwise.cli import main
from shardwise.config import ConfigError, ineffective_settings, load_dict, parse_config
from shardwise.config.blocks import OptimizerBlock
from shardwise.config.deepspeed import Translation, auto_keys, describe, translate
from shardwise.config.deepspeed.keys import TOP_LEVEL
from shardwise.config.deepspeed.zero import OFFLOAD_OPTIMIZER_KEYS, OFFLOAD_PARAM_KEYS, ZERO_KEYS
from shardwise.config.schema import field_names
from shardwise.topology import Cluster
from shardwise.config.layout import validate

CONFIGS = Path(__file__).parent / "data" / "deepspeed_configs"
# What a config cannot honour is a warning at load (tested in test_deepspeed_config.py); here it is read from the
# translation.
pytestmark = pytest.mark.filterwarnings("ignore::shardwise.config.effects.IneffectiveSettingsWarning")


def _error(data: dict, cluster: Cluster = Cluster(1, 4)) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        validate(load_dict(data), cluster)
    return error.value


def _check_config(capsys, tmp_path: Path, data: dict, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    code = main(["check-config", "--config", str(path), "--nproc-per-node", "4", *flags])
    out, err = capsys.readouterr()
    return code, out, err


# 1. MiCS


def test_mics_shard_size_makes_partition_groups(capsys, tmp_path):
    data = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 4,
                                                        "mics_hierarchical_params_gather": True}}
    config, layout = validate(load_dict(data), Cluster(2, 4))
    assert (config.sharded_data_parallel_degree, config.effective_zero_stage) == (4, 3)
    assert (layout.dp_replicate, layout.dp_shard) == (2, 4)
    code, out, _ = _check_config(capsys, tmp_path, data, "--nnodes", "2")
    assert code == 0
    assert "sharded_data_parallel_degree = 4    <- zero_optimization.mics_shard_size" in out
    assert ("honoured differently:\n  zero_optimization.mics_hierarchical_params_gather: each partition group's "
            "parameters are all-gathered by one torch collective over the group, which stays inside a node when the "
            "group fits in one") in out
    assert "MiCS / ZeRO-2D (ZeRO-3 in partition groups of 4, 2 replicas)" in out


def test_mics_off_and_outside_stage_3_as_deepspeed_reads_it():
    off = translate({"zero_optimization": {"stage": 3, "mics_shard_size": -1}})  # DeepSpeed's default: no MiCS
    assert "sharded_data_parallel_degree" not in off.config and not off.ignored
    stage2 = translate({"zero_optimization": {"stage": 2, "mics_shard_size": 4,
                                              "mics_hierarchical_params_gather": True}})
    assert "sharded_data_parallel_degree" not in stage2.config
    assert dict(stage2.ignored) == {
        "zero_optimization.mics_shard_size": "DeepSpeed builds MiCS under stage 3 only, and ignores it under stage 2",
        "zero_optimization.mics_hierarchical_params_gather": "needs MiCS (mics_shard_size > 0, stage 3)"}


# 2. Legacy offload keys


def test_legacy_cpu_offload_keys_offload_as_deepspeed_maps_them():
    legacy = translate({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    assert legacy.config["offload_optimizer_state"] is True
    assert legacy.origin["offload_optimizer_state"] == "zero_optimization.cpu_offload"
    assert not legacy.ignored and not legacy.problems
    params = translate({"zero_optimization": {"stage": 3, "cpu_offload_params": True}})
    assert params.origin["offload_optimizer_state"] == "zero_optimization.cpu_offload_params"
    assert dict(params.notes)["zero_optimization.cpu_offload_params"].startswith(
        "FSDP2's CPUOffloadPolicy keeps the parameter shards, their gradients and the optimizer state in host memory")
    assert dict(translate({"zero_optimization": {"stage": 2, "cpu_offload_param": True}}).ignored) == {
        "zero_optimization.cpu_offload_param": "DeepSpeed offloads parameters under stage 3 only, and ignores it "
                                               "under stage 2"}
    unpinned = translate({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": False}})
    assert "zero_optimization.cpu_offload_use_pin_memory" in dict(unpinned.ignored)
    both = _error({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    assert ("zero_optimization.cpu_offload=True: is the old spelling of offload_optimizer, which is given too "
            "(DeepSpeed refuses both together); fix: keep offload_optimizer only") in str(both)


# 3. fp16/bf16 "auto"


def test_auto_precision_turns_nothing_on():
    error = _error({"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
    assert len(error.problems) == 1
    assert str(error).startswith("invalid shardwise config: fp16.enabled, bf16.enabled='auto': \"auto\" is the "
                                 "Hugging Face Trainer's placeholder")
    assert "cannot both be on" not in str(error)
    t = translate({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
    assert "fp16" not in t.config and "bf16" not in t.config
    # bf16 as DeepSpeed 0.19 has it: a step with inf/nan gradients is skipped (check_grad_overflow, default true)
    clip = {"gradient_clipping": 1.0}  # DeepSpeed 0.19's default when the key is absent
    assert translate({"bf16": {"enabled": True}}).config == {"bf16": True, "non_finite_gradients": "skip", **clip}
    assert translate({"bf16": {"enabled": True, "check_grad_overflow": False}}).config == {"bf16": True, **clip}
    assert translate({"bf16": {"enabled": True}, "non_finite_gradients": "stop"}).config["non_finite_gradients"] == "stop"


# 4. Optimizer and scheduler values


def test_optimizer_and_scheduler_values_are_checked_before_launch(capsys, tmp_path):
    data = {"train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": "0.001", "betas": [0.9], "weight_decay": -1}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0, "warmup_type": "cosine"}}}
    code, _, err = _check_config(capsys, tmp_path, data)
    assert code == 2
    assert err.splitlines()[1:] == [
        "  optimizer.params.lr='0.001': must be a number; fix: write a number, without quotes",
        "  optimizer.params.betas=[0.9]: must be two numbers; fix: write e.g. [0.9, 0.999]",
        "  optimizer.params.weight_decay=-1: must be >= 0; fix: use a value >= 0",
        "  scheduler.params.warmup_num_steps=0: must be >= 1; fix: use a value >= 1",
        "  scheduler.params.warmup_type='cosine': must be one of 'log', 'linear'; fix: use one of log, linear",
        "  scheduler.params.total_num_steps=None: is required by WarmupDecayLR; fix: give it a value"]
    assert "optimizer.params.lr='1e-3': must be a number; fix: write a number (YAML reads 1e-3 without a dot as " \
           "text: write e.g. 1.0e-03)" in str(_error({"optimizer": {"type": "Adam", "params": {"lr": "1e-3"}}}))
    # "auto" in the optimizer (the reported defect) is the one "auto" error, before any rank starts
    assert str(_error({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}})
               ).startswith("invalid shardwise config: optimizer.params.lr='auto': \"auto\" is the Hugging Face")


# 5. steps_per_print


def test_gradient_clipping_defaults_to_deepspeeds_one():
    """DeepSpeed 0.19 clips at 1.0 when the key is absent; 0 turns clipping off, as in DeepSpeed."""
    assert translate({"train_batch_size": 8}).config["gradient_clipping"] == 1.0
    assert "gradient_clipping" not in translate({"train_batch_size": 8, "gradient_clipping": 0}).config
    assert translate({"train_batch_size": 8, "gradient_clipping": 0.5}).config["gradient_clipping"] == 0.5


def test_steps_per_print_throttles_the_console_line_only():
    assert "metrics_interval" not in translate({"steps_per_print": 2000}).config
    assert translate({"steps_per_print": 2000}).config["steps_per_print"] == 2000
    config, _ = validate(load_dict({"train_batch_size": 8, "steps_per_print": 2000}), Cluster(1, 4))
    assert (config.steps_per_print, config.metrics_interval) == (2000, 1)  # metrics still every step
    assert "console progress line" in type(config).model_fields["steps_per_print"].description
    assert type(config).model_fields["steps_per_print"].default is None  # DeepSpeed 0.19's: no line
    assert "steps_per_print=0: input should be greater than or equal to 1; fix: use 1 or more" in str(
        _error({"train_batch_size": 8, "steps_per_print": 0}))


# 6. "auto" anywhere


def test_auto_is_one_error_naming_every_key_and_the_trainer():
    data = json.loads((CONFIGS / "hf_transformers_ds_config_zero2.json").read_text())
    assert auto_keys(data) == [
        "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
        "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
        "train_micro_batch_size_per_gpu"]
    error = _error(data)
    assert len(error.problems) == 1
    assert str(error) == (
        "invalid shardwise config: fp16.enabled, bf16.enabled, optimizer.params.lr, optimizer.params.betas, "
        "optimizer.params.eps, optimizer.params.weight_decay, scheduler.params.warmup_min_lr, "
        "scheduler.params.warmup_max_lr, scheduler.params.warmup_num_steps, gradient_accumulation_steps, "
        "gradient_clipping, train_batch_size, train_micro_batch_size_per_gpu='auto': \"auto\" is the Hugging Face "
        "Trainer's placeholder, which the Trainer fills in from its TrainingArguments (and the model) before "
        "DeepSpeed reads the config; outside the Trainer nothing fills it in, and it turns nothing on; fix: write "
        "the values themselves (a number; true or false for fp16.enabled and bf16.enabled), or run the script "
        "through the Hugging Face Trainer with this config")
    assert "microbatches" not in str(error)  # DeepSpeed's names, never shardwise's
    # DeepSpeed's own "auto" values (ZenFlow's intervals) are not the Trainer's
    assert auto_keys({"zero_optimization": {"zenflow": {"select_interval": "auto"}}}) == []


# 7. Every key DeepSpeed reads is known


def test_real_deepspeed_keys_are_never_unknown():
    data = {"train_batch_size": 8, "data_types": {"grad_accum_dtype": "fp32"}, "tensor_parallel": {"autotp_size": 2},
            "zero_force_ds_cpu_optimizer": False, "sparse_attention": {"mode": "fixed"},
            "checkpoint": {"tag_validation": "Warn"}, "compile": {"deepcompile": True},
            "zero_optimization": {"stage": 3, "round_robin_gradients": True, "ignore_unused_parameters": True,
                                  "elastic_checkpoint": True, "sub_group_size": 1e9, "memory_efficient_linear": True,
                                  "stage3_gather_16bit_weights_on_model_save": True, "zero_quantized_weights": True,
                                  "offload_param": {"device": "cpu", "buffer_size": 1e8, "max_in_cpu": 1e9}}}
    t = translate(data)
    assert not t.problems
    assert t.config["tensor_parallel_degree"] == 2
    listed = {**dict(t.notes), **dict(t.ignored)}
    assert listed["data_types.grad_accum_dtype"].startswith("gradients add up in fp32")
    assert listed["sparse_attention"] == ("removed from DeepSpeed (0.19 refuses the key); attention runs as the "
                                          "model computes it")
    assert listed["compile"].startswith("DeepCompile's passes are not built")
    assert listed["checkpoint"].startswith("shardwise writes its own sharded checkpoints")
    assert listed["zero_force_ds_cpu_optimizer"].startswith("there is no DeepSpeed CPU Adam")
    assert listed["zero_optimization.zero_quantized_weights"].startswith("ZeRO++'s quantized communication is not built")
    assert listed["tensor_parallel.autotp_size"].startswith("shardwise splits layers by its own plans")
    validate(load_dict(data), Cluster(1, 4))


def test_truly_unknown_keys_are_errors_with_the_closest_name():
    error = str(_error({"train_batch_size": 8, "zero_optimisation": {"stage": 2}, "tensorbaord": {"enabled": True},
                        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_siz": 5e8}}))
    assert ("zero_optimisation={'stage': 2}: unknown key: DeepSpeed reads no such key at the top level, and it is no "
            "shardwise key either; fix: did you mean 'zero_optimization'?") in error
    assert "tensorbaord={'enabled': True}: unknown key" in error and "did you mean 'tensorboard'?" in error
    assert ("zero_optimization.stage3_prefetch_bucket_siz=500000000.0: unknown key: DeepSpeed reads no such key in "
            "zero_optimization; fix: did you mean 'stage3_prefetch_bucket_size'?") in error
    # values DeepSpeed refuses, and one that would change the update
    assert "communication_data_type='bfp16': is not one DeepSpeed accepts: fp16, bf16, fp32" in str(
        _error({"train_batch_size": 8, "communication_data_type": "bfp16"}))
    assert ("gradient_allreduce_op='sum': sums gradients over the data-parallel ranks, and shardwise averages them "
            "(a different update)") in str(_error({"train_batch_size": 8, "gradient_allreduce_op": "sum"}))


def test_the_key_lists_hold_every_key_of_deepspeeds_own_configs():
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    fields = zero_config.DeepSpeedZeroConfig.model_fields
    assert {alias for name, f in fields.items() for alias in (name, f.alias) if alias} <= set(ZERO_KEYS)
    assert set(ds_config._REMOVED_ZERO_CONFIG_KEYS) <= set(ZERO_KEYS)
    assert set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS) <= set(TOP_LEVEL)
    assert set(offload.DeepSpeedZeroOffloadParamConfig.model_fields) == set(OFFLOAD_PARAM_KEYS)
    assert set(offload.DeepSpeedZeroOffloadOptimizerConfig.model_fields) == set(OFFLOAD_OPTIMIZER_KEYS)


# 8. Optimizers


def test_deepspeed_optimizer_names_in_any_case_and_their_parameters():
    assert OptimizerBlock(type="lamb").type == "Lamb" and OptimizerBlock(type="ADAMW").type == "AdamW"
    param = [torch.nn.Parameter(torch.ones(2))]
    adam_l2 = _torch_optimizer(OptimizerBlock(type="adam", params={"adam_w_mode": False, "bias_correction": True,
                                                                   "torch_adam": True, "weight_decay": 0.1}), param)
    assert type(adam_l2) is torch.optim.Adam and adam_l2.defaults["weight_decay"] == 0.1
    assert type(_torch_optimizer(OptimizerBlock(type="Adam"), param)) is torch.optim.AdamW
    assert type(_torch_optimizer(OptimizerBlock(type="LAMB", params={"max_coeff": 0.3}), param)) is DeepSpeedLamb
    assert type(_torch_optimizer(OptimizerBlock(type="adagrad"), param)) is torch.optim.Adagrad
    assert ("optimizer.params.bias_correction=False: torch's Adam always corrects the moments' bias; fix: set it to "
            "true or drop it") in str(_error({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}))


def test_unknown_and_compressed_optimizers_are_named_by_type():
    unknown = str(_error({"optimizer": {"type": "Adafactor", "params": {"lr": 0.1, "scale_parameter": True}}}))
    assert ("optimizer.type='Adafactor': is not an optimizer shardwise builds from a config: it builds Adam, AdamW, "
            "Lamb, Adagrad (DeepSpeed's names, in any case) or SGD (torch.optim's); fix: use one of them, or build "
            "the optimizer in the script and wrap it: sw.DistributedOptimizer(torch.optim.X(model.parameters(), "
            "...))") in unknown
    assert "scale_parameter" not in unknown  # the type alone, not the whole block
    assert "did you mean 'SGD'? (torch.optim's names keep their case, in DeepSpeed too)" in str(
        _error({"optimizer": {"type": "sgd"}}))
    assert ("optimizer.type='OneBitAdam': is DeepSpeed's 1-bit Adam, which compresses the gradients it communicates "
            "to 1 bit with error feedback: a different algorithm from Adam on the same data; shardwise reduces "
            "gradients uncompressed; fix: use Adam") in str(_error({"optimizer": {"type": "OneBitAdam"}}))
    assert "optimizer.params.max_grad_norm=1.0: is not an optimizer parameter in DeepSpeed (it refuses it); fix: " \
           "use the top-level gradient_clipping" in str(_error({"optimizer": {"type": "Lamb",
                                                                               "params": {"max_grad_norm": 1.0}}}))


def _deepspeed_lamb_reference(param, grads, lr, betas, eps, decay, bias_correction, eps_inside_sqrt, low, high):
    """DeepSpeed's fused_lamb_cuda_kernel.cu, one tensor at a time, in float64."""
    p, m, v = param.double().clone(), torch.zeros_like(param, dtype=torch.float64), torch.zeros_like(
        param, dtype=torch.float64)
    for step, grad in enumerate(grads, 1):
        g = grad.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        update = m / ((v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps) + decay * p
        w, u = p.norm().item(), update.norm().item()
        coeff = min(max(w / u, low), high) if w and u else 1.0
        size = lr * math.sqrt(1 - betas[1] ** step) / (1 - betas[0] ** step) if bias_correction else lr
        p = p - size * coeff * update
    return p


@pytest.mark.parametrize("options", [{}, {"bias_correction": False, "weight_decay": 0.01, "max_coeff": 0.3},
                                     {"eps_inside_sqrt": True, "weight_decay": 0.1, "min_coeff": 2.0}])
def test_lamb_steps_by_deepspeeds_rule(options):
    torch.manual_seed(0)
    start, grads = torch.randn(6, 4), [torch.randn(6, 4) for _ in range(4)]
    param = torch.nn.Parameter(start.clone())
    optimizer = _torch_optimizer(OptimizerBlock(type="lamb", params={"lr": 0.01, **options}), [param])
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    args = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "decay": options.get("weight_decay", 0.0),
            "bias_correction": options.get("bias_correction", True),
            "eps_inside_sqrt": options.get("eps_inside_sqrt", False), "low": options.get("min_coeff", 0.01),
            "high": options.get("max_coeff", 10.0)}
    torch.testing.assert_close(param.detach().double(), _deepspeed_lamb_reference(start, grads, **args))


# 9. Metrics sinks' packages


def test_missing_sink_package_is_refused_before_launch(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("shardwise.config.packages.installed", lambda package: package != "tensorboard")
    data = {"train_batch_size": 8, "tensorboard": {"enabled": True, "output_path": str(tmp_path)}}
    code, _, err = _check_config(capsys, tmp_path, data)
    assert code == 2
    assert err.strip() == ("shardwise check-config: invalid shardwise config: metrics_sinks=['tensorboard']: the "
                           "tensorboard sink needs the tensorboard package, which is not installed; fix: pip install "
                           "tensorboard, or drop tensorboard from metrics_sinks (in a DeepSpeed config: "
                           "tensorboard.enabled false)")
    with pytest.raises(ConfigError, match="the wandb sink needs the wandb package"):  # init's and run's validation
        monkeypatch.setattr("shardwise.config.packages.installed", lambda package: False)
        validate({"metrics_sinks": ["wandb", "csv"]}, Cluster(1, 1))
    validate({"metrics_sinks": ["wandb"], "metrics_interval": 0}, Cluster(1, 1))  # nothing recorded: no sink made


# 10. SMP's overlapping_allreduce


def test_smp_overlapping_allreduce_config_key_is_accepted_with_its_note():
    assert parse_config({"overlapping_allreduce": True}).overlapping_allreduce is True
    assert ineffective_settings(parse_config({"overlapping_allreduce": False})) == [
        ("overlapping_allreduce", "gradients are always reduced while backward runs; they come out the same")]


# shardwise plan --config, hpZ


@pytest.mark.parametrize("name,strategy,degrees", [
    ("zero2", "ZeRO-2", "1×16"), ("mics", "MiCS ZeRO-3/8", "2×8")])
def test_plan_predicts_a_deepspeed_config(tmp_path, capsys, name, strategy, degrees):
    zero = {"zero2": {"stage": 2, "overlap_comm": True}, "mics": {"stage": 3, "mics_shard_size": 8}}[name]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                                "bf16": {"enabled": True}, "zero_optimization": zero}))
    assert main(["plan", "--model", "gpt2", "--cluster", "2xp4d.24xlarge", "--seq", "512", "--config", str(path),
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["fits"] and row["step_time_s"] > 0 and row["memory_bytes"]["total"] > 0
    assert row["config"]["microbatches"] == 2 and row["config"]["bf16"] is True  # 64 = 2 x 2 x 16 ranks
    assert main(["plan", "--model", "gpt2", "--cluster", "2xp4d.24xlarge", "--seq", "512", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "global batch 64 × seq 512, bf16: 1 of 1 layouts fit" in out and strategy in out and degrees in out


def test_hpz_partition_size_reaches_its_shardwise_key():
    data = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}
    assert translate(data).config["zero_hpz_partition_size"] == 4
    assert validate(load_dict(data), Cluster(2, 4))[0].zero_hpz_partition_size == 4


def test_hpz_off_and_outside_stage_3_is_as_deepspeed_reads_it():
    """0 and 1 are no secondary partition; below stage 3 DeepSpeed does not use it, so it is listed, not refused."""
    for size in (0, 1):
        assert "zero_hpz_partition_size" not in translate({"zero_optimization": {"stage": 3,
                                                                                 "zero_hpz_partition_size": size}}).config
    t = translate({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 4}})
    assert "zero_hpz_partition_size" not in t.config
    assert ("zero_optimization.zero_hpz_partition_size", "4: only ZeRO-3 keeps a secondary partition of the "
            "parameters (DeepSpeed uses it at stage 3 only)") in t.ignored


def test_hpz_partition_size_is_translated():
    t = translate({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}})
    assert (t.config["zero_hpz_partition_size"], t.origin["zero_hpz_partition_size"]) == (
        4, "zero_optimization.zero_hpz_partition_size")
    assert "zero_hpz_partition_size" not in translate({"zero_optimization": {"zero_hpz_partition_size": 1}}).config


# Public configs (tests/data/deepspeed_configs/README.md): what each becomes on 2 nodes x 4 devices.

READ_AS = {
    "hf_transformers_ds_config_zero3.json": {"zero_stage": 3, "offload_optimizer_state": True, "fp16": True,
                                             "steps_per_print": 2000},
    "megatron_ds_config_gbs256_mbs8_log1_zero1.json": {"zero_stage": 1, "fp16": True, "gradient_clipping": 1.0,
                                                       "microbatches": 4},
    "deepspeed_chat_step1_zero3_offload_bf16.json": {"zero_stage": 3, "offload_optimizer_state": True, "bf16": True,
                                                     "non_finite_gradients": "skip", "metrics_sinks": ["tensorboard"],
                                                     "metrics_dir": "output/ds_tensorboard_logs/step1_model_tensorboard"},
    "deepspeed_test_mics_config.json": {"zero_stage": 3, "sharded_data_parallel_degree": 4, "fp16": True},
    "bing_bert_deepspeed_bsz64k_lamb_config_seq128.json": {"microbatches": 128, "fp16": True},
    "megatron_ds_universal_checkpointing_zero1_bf16.json": {"zero_stage": 1, "bf16": True,
                                                            "accumulate_gradients_locally": True},
}
# Configs written for another number of ranks than READ_AS's 2 nodes of 4 (their batch is one rank's).
CLUSTERS = {"megatron_ds_universal_checkpointing_zero1_bf16.json": Cluster(1, 1)}
REFUSED = {
    "hf_transformers_ds_config_zero2.json": ["fp16.enabled, bf16.enabled, optimizer.params.lr"],
    "accelerate_ds_config_zero2.json": ["zero_optimization.reduce_bucket_size, gradient_clipping, train_batch_size, "
                                        "train_micro_batch_size_per_gpu='auto': \"auto\" is the Hugging Face"],
    "megatron_ds_zero2_config_bf16.json": [
        "communication_data_type='bfp16': is not one DeepSpeed accepts: fp16, bf16, fp32",
        "bfloat16.loss_scale=1.0: unknown key: DeepSpeed reads no such key in bfloat16"],
    "bing_bert_deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json": ["optimizer.type='OneBitLamb': is DeepSpeed's "
                                                                      "1-bit LAMB"],
}


def test_every_public_config_is_covered():
    assert sorted(READ_AS.keys() | REFUSED.keys()) == sorted(p.name for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("name", sorted(READ_AS))
def test_public_configs_are_read_with_deepspeeds_meaning(name):
    config, _ = validate(load_dict(str(CONFIGS / name)), CLUSTERS.get(name, Cluster(2, 4)))
    for key, value in READ_AS[name].items():
        assert getattr(config, key) == value, key
    lamb = config.optimizer
    if lamb is not None and lamb.type == "Lamb":
        assert lamb.params == {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3,
                               "min_coeff": 0.01}
    text = describe(translate(json.loads((CONFIGS / name).read_text())))
    assert "unknown" not in text


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_public_configs_deepspeed_would_not_run_are_refused(name):
    with pytest.raises(ConfigError) as error:
        validate(load_dict(str(CONFIGS / name)), Cluster(2, 4))
    for part in REFUSED[name]:
        assert part in str(error.value)


# 11. data_types.grad_accum_dtype


def _accumulation(data_types: dict, **rest) -> Translation:
    return translate({"train_batch_size": 8, "data_types": data_types, **rest})


def test_fp32_accumulation_under_bf16_zero1_is_deepspeeds_bf16_optimizer():
    """bf16 + ZeRO-1 + fp32 accumulation selects DeepSpeed's BF16_Optimizer, which adds the microbatches up in fp32
    on every rank and reduces them once: accumulate_gradients_locally, whatever order the keys come in."""
    t = _accumulation({"grad_accum_dtype": "float32"}, bf16={"enabled": True}, zero_optimization={"stage": 1})
    assert t.config["accumulate_gradients_locally"] is True and not t.problems
    assert t.origin["accumulate_gradients_locally"] == "data_types.grad_accum_dtype"
    assert "accumulate_gradients_locally" not in _accumulation({"grad_accum_dtype": "bf16"}, bf16={"enabled": True},
                                                               zero_optimization={"stage": 1}).config


@pytest.mark.parametrize("rest, said", [
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, "gradients add up in fp32"),
    ({"zero_optimization": {"stage": 1}}, "gradients add up in fp32"),
])
def test_fp32_accumulation_elsewhere_is_what_shardwise_does_anyway(rest, said):
    t = _accumulation({"grad_accum_dtype": "fp32"}, **rest)
    assert dict(t.notes)["data_types.grad_accum_dtype"].startswith(said) and not t.problems
    assert "accumulate_gradients_locally" not in t.config


def test_half_accumulation_under_zero_is_honoured_more_exactly():
    t = _accumulation({"grad_accum_dtype": "fp16"}, fp16={"enabled": True}, zero_optimization={"stage": 1})
    assert "more exact than fp16" in dict(t.notes)["data_types.grad_accum_dtype"] and not t.problems


@pytest.mark.parametrize("data, message", [
    ({"grad_accum_dtype": "fp32", "bf16": {"enabled": True}},
     "data_types.grad_accum_dtype='fp32': differs from the model's dtype (bf16) without ZeRO, a mix DeepSpeed "
     "refuses; fix: use zero_optimization stage 1 (with bf16, fp32 accumulates on every rank), or bf16"),
    ({"grad_accum_dtype": "fp64"}, "data_types.grad_accum_dtype='fp64': is not a dtype DeepSpeed accumulates in; "
                                   "fix: use fp32, bf16 or fp16"),
    ({"grad_accum_type": "fp32"}, "data_types.grad_accum_type='fp32': unknown key"),
])
def test_accumulation_deepspeed_refuses_is_refused_in_one_line(data, message):
    precision = {"bf16": data.pop("bf16")} if "bf16" in data else {}
    error = str(_error({"train_batch_size": 8, "data_types": data, **precision}))
    assert message in error and "\n" not in error.strip()


def test_local_accumulation_without_fp32_masters_is_refused_in_one_line():
    error = str(_error({"accumulate_gradients_locally": True, "bf16": True, "zero_stage": 2,
                        "sharded_data_parallel_degree": 4}))
    assert ("accumulate_gradients_locally=True: accumulates ZeRO-1's gradients for its fp32 master weights, which "
            "this config does not keep") in error and "\n" not in error.strip()


def test_the_guide_has_a_row_for_every_key():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "deepspeed.md").read_text()
    start = guide.index("## Config keys")
    section = guide[start:guide.index("\n## ", start + 1)]
    named = {name for line in section.splitlines() if line.startswith("| `")
             for name in re.findall(r"`([^`]+)`", line.split(" | ")[0])}
    assert set(TOP_LEVEL) - named == set()
    assert {f"zero_optimization.{key}" for key in ZERO_KEYS} - named == set()


def test_torch_adam_builds_torchs_adamw_with_its_default_decay():
    """DeepSpeed with `torch_adam` builds torch's AdamW, whose weight decay defaults to 0.01; its fused Adam's to 0."""
    import torch

    from shardwise.api.configured import _torch_optimizer
    from shardwise.config.blocks import OptimizerBlock

    params = [torch.nn.Parameter(torch.zeros(2))]
    built = [_torch_optimizer(OptimizerBlock(type="Adam", params={"lr": 1e-3, **flag}), params)
             for flag in ({}, {"torch_adam": True})]
    assert [opt.defaults["weight_decay"] for opt in built] == [0.0, 0.01]
    given = _torch_optimizer(OptimizerBlock(type="Adam", params={"torch_adam": True, "weight_decay": 0.0}), params)
    assert given.defaults["weight_decay"] == 0.0
