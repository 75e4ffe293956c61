"""examples/hf/train_clm.py, a run_clm-shaped Trainer script with only the import changed, launched for real.

`shardwise run --nproc-per-node 2` starts it on 2 CPU ranks with transformers' own ZeRO-2 DeepSpeed test config
(its "auto" values filled from the script's arguments): the ranks train one model together, as one process
running the same script with their batches together does (the same training and evaluation losses, dropout
off), and the
saved model loads with from_pretrained. The TrainingArguments are made before any process group exists, as in
any script under a launcher.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_trainer_cases import WORDS, tiny_tokenizer
from shardwise.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hf" / "train_clm.py"
ZERO2 = ROOT / "tests" / "data" / "deepspeed_configs" / "hf_transformers_ds_config_zero2.json"


def _text(path: Path) -> str:
    lines = [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(5 + i % 7)) for i in range(160)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("clm")
    return {"tokenizer": tiny_tokenizer(tmp / "tokenizer"), "text": _text(tmp / "train.txt")}


def _arguments(inputs: dict, out: Path, micro: int) -> list[str]:
    return ["--tokenizer_name", inputs["tokenizer"], "--train_file", inputs["text"], "--output_dir", str(out),
            "--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=32,n_head=2,n_positions=16,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
            "--block_size", "16", "--do_train", "--do_eval", "--max_steps", "3", "--gradient_accumulation_steps", "2",
            "--per_device_train_batch_size", str(micro), "--per_device_eval_batch_size", str(micro),
            "--learning_rate", "1e-3", "--warmup_steps", "2", "--logging_steps", "1", "--report_to", "none",
            "--save_strategy", "no", "--seed", "3", "--deepspeed", str(ZERO2), "--disable_tqdm", "true"]


def _results(out: Path) -> dict:
    return json.loads((out / "all_results.json").read_text())


def test_train_clm_on_two_ranks_trains_as_one_process(inputs, tmp_path):
    alone, launched = tmp_path / "alone", tmp_path / "launched"
    done = subprocess.run([sys.executable, str(SCRIPT), *_arguments(inputs, alone, 4)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    code = main(["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), str(SCRIPT),
                 *_arguments(inputs, launched, 2)])
    assert code == 0
    want, got = _results(alone), _results(launched)
    assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert got["train_samples"] == want["train_samples"] and got["eval_samples"] == want["eval_samples"]
    state = json.loads((launched / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["train_batch_size"] == 2

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(launched).config.n_layer == 2
