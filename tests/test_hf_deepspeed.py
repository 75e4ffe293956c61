"""`TrainingArguments(deepspeed=...)` on shardwise: Hugging Face-world DeepSpeed configs, "auto" and all.

transformers' Trainer fills a config's "auto" values from the TrainingArguments and the model, then DeepSpeed
builds the optimizer and schedule its blocks name. `shardwise.hf` fills them the same way (test_hf_auto.py, key
by key) and runs the config on shardwise: the public config transformers' own tests use trains on 2 ranks as
one process with the optimizer and schedule DeepSpeed builds from it, and ZeRO-3's bucket sizes are filled from
the model's hidden size. A config the Trainer refuses is refused with the same reasons, one line each.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hf_trainer_cases import assert_same, run
from shardwise.testing import run_distributed

CONFIGS = Path(__file__).parent / "data" / "deepspeed_configs"
HF_ZERO2 = CONFIGS / "hf_transformers_ds_config_zero2.json"
MICRO, WARMUP = 2, 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_distributed(run, 1, "plain", str(tmp_path_factory.mktemp("plain")), 2 * MICRO,
                           deepspeed_reference=True, warmup_steps=WARMUP, timeout=300)[0]


def test_transformers_zero2_config_trains_as_one_process(reference, tmp_path):
    """transformers' tests/deepspeed/ds_config_zero2.json as it is: ZeRO-2 with the optimizer state on the host,
    13 "auto" values (batch sizes, accumulation, clipping, AdamW's values, WarmupLR's, fp16 and bf16 off)."""
    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO, deepspeed=str(HF_ZERO2),
                            warmup_steps=WARMUP, timeout=300)
    assert_same(ranks, reference)
    assert ranks[0]["layout"] == {"zero_stage": 2, "offload": True, "clipping": 1.0}


def test_zero3_bucket_sizes_come_from_the_model(reference, tmp_path):
    """The same config at ZeRO-3 with its stage-3 keys "auto", as transformers' documentation writes it, passed
    as a dict."""
    config = json.loads(HF_ZERO2.read_text())
    config["zero_optimization"] = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                   "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                   "stage3_param_persistence_threshold": "auto",
                                   "stage3_gather_16bit_weights_on_model_save": True}
    ranks = run_distributed(run, 2, "shardwise", str(tmp_path), MICRO, deepspeed=config, warmup_steps=WARMUP,
                            timeout=300)
    assert_same(ranks, reference)
    assert ranks[0]["layout"]["zero_stage"] == 3


@pytest.mark.deepspeed
def test_transformers_own_training_arguments_with_deepspeed_installed(reference, tmp_path):
    """transformers' TrainingArguments(deepspeed=...) builds DeepSpeed's integration as they are made (DeepSpeed
    installed); shardwise.hf's Trainer sets it aside and runs the config on shardwise all the same."""
    pytest.importorskip("deepspeed")
    ranks = run_distributed(run, 2, "transformers-arguments", str(tmp_path), MICRO, deepspeed=str(HF_ZERO2),
                            warmup_steps=WARMUP, timeout=300)
    assert_same(ranks, reference)
    assert ranks[0]["layout"]["zero_stage"] == 2


def _refusal(out: str, config: dict, **more) -> str:
    try:
        run("shardwise", out, MICRO, deepspeed=config, evaluate=False, **more)
    except ValueError as error:
        return str(error)
    return "trained"


def test_values_the_training_arguments_differ_from_are_refused_before_training(tmp_path):
    config = json.loads(HF_ZERO2.read_text())
    config["optimizer"]["params"]["lr"] = 3e-5
    config["gradient_accumulation_steps"] = 4
    message = run_distributed(_refusal, 1, str(tmp_path), config, timeout=120)[0]
    assert message.splitlines()[1:] == [
        "  gradient_accumulation_steps=4: differs from the Trainer's gradient_accumulation_steps=2, and the Hugging "
        "Face Trainer refuses a DeepSpeed config whose values differ from its TrainingArguments; fix: set it to "
        "\"auto\" (the Trainer fills it in) or to 2, or change gradient_accumulation_steps",
        "  optimizer.params.lr=3e-05: differs from the Trainer's learning_rate=0.001, and the Hugging Face Trainer "
        "refuses a DeepSpeed config whose values differ from its TrainingArguments; fix: set it to \"auto\" (the "
        "Trainer fills it in) or to 0.001, or change learning_rate"]


def test_an_auto_the_trainer_does_not_fill_is_refused_when_training_starts(tmp_path):
    config = copy.deepcopy(json.loads(HF_ZERO2.read_text()))
    config["scheduler"]["params"]["warmup_type"] = "auto"
    message = run_distributed(_refusal, 1, str(tmp_path), config, timeout=120)[0]
    assert message.startswith("invalid shardwise config: scheduler.params.warmup_type='auto': is no key the Hugging "
                              "Face Trainer fills in")
