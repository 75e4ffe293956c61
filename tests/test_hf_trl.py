"""trl's trainers on shardwise in one line: `SFTTrainer = shardwise_trainer(trl.SFTTrainer)`, and DPOTrainer alike.

The same fine-tuning scripts (a tiny GPT-2, a local word-level tokenizer, texts of different lengths padded and
masked by trl's collators, gradient accumulation 2) train under ZeRO-3 on 2 ranks with the losses trl's own
trainers log in one process with the ranks' batches together. DPO keeps a second model, the frozen reference:
trl prepares it for evaluation through the accelerator, so each rank holds it whole (not sharded) and scores its
own rows with it, while the policy trains in shards.
"""

from __future__ import annotations

import json
import os

import pytest

from hf_trainer_cases import WORDS, tiny_tokenizer
from shardwise.testing import run_distributed

pytest.importorskip("trl")


def _trainer_class(kind: str, trainer_class: type, out: str) -> type:
    """trl's class as the script names it: itself, or on shardwise under ZeRO-3 over 2 ranks."""
    import torch

    if kind != "shardwise":
        return trainer_class
    from shardwise.hf import shardwise_trainer

    path = os.path.join(out, f"layout-{torch.distributed.get_rank()}.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as file:
        json.dump({"sharded_data_parallel_degree": 2}, file)
    os.environ["SHARDWISE_CONFIG"] = path  # what `shardwise run --set sharded_data_parallel_degree=2` sets
    return shardwise_trainer(trainer_class)


def run_sft(kind: str, out: str, micro: int, tokenizer_dir: str) -> list[float]:
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tiny_models import build

    SFTTrainer = _trainer_class(kind, SFTTrainer, out)  # noqa: N806 (the script's own name for it)
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(2 + i % 6)) for i in range(48)]
    model = build("gpt2", freeze_key_bias=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    args = SFTConfig(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=2, max_steps=3,
                     learning_rate=1e-3, adam_epsilon=1e-6, logging_steps=1, report_to=[], save_strategy="no",
                     disable_tqdm=True, seed=11, max_length=8, bf16=False, gradient_checkpointing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_sft_trainer_under_zero3_trains_as_one_process(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer")
    want = run_distributed(run_sft, 1, "plain", str(tmp_path / "plain"), 4, tokenizer, timeout=300)[0]
    ranks = run_distributed(run_sft, 2, "shardwise", str(tmp_path / "sharded"), 2, tokenizer, timeout=300)
    assert len(want) == 3
    for got in ranks:
        assert got == pytest.approx(want, rel=1e-5)


def run_dpo(kind: str, out: str, micro: int, tokenizer_dir: str) -> dict:
    """DPO on preference pairs (a prompt, a chosen and a rejected completion), the reference a copy of the model."""
    import copy

    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from tiny_models import build

    DPOTrainer = _trainer_class(kind, DPOTrainer, out)  # noqa: N806 (the script's own name for it)
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)

    def words(start: int, count: int) -> str:
        return " ".join(WORDS[(start + j) % len(WORDS)] for j in range(count))

    pairs = {"prompt": [words(3 * i, 2) for i in range(32)], "chosen": [words(5 * i, 1 + i % 3) for i in range(32)],
             "rejected": [words(5 * i + 7, 1 + (i + 1) % 3) for i in range(32)]}
    model = build("gpt2", freeze_key_bias=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    reference = copy.deepcopy(model)
    args = DPOConfig(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=2, max_steps=3,
                     learning_rate=1e-3, adam_epsilon=1e-6, logging_steps=1, report_to=[], save_strategy="no",
                     disable_tqdm=True, seed=11, max_length=8, bf16=False, beta=0.5)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_dict(pairs),
                         processing_class=tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {name: [entry[name] for entry in logged] for name in ("loss", "grad_norm", "rewards/margins")}


def test_dpo_trainer_under_zero3_trains_as_one_process(tmp_path):
    """The policy's losses, gradient norms and reward margins as trl's DPOTrainer gives them in one process (the
    margins need the reference model's log-probabilities, so they check it scores the same rows)."""
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer")
    want = run_distributed(run_dpo, 1, "plain", str(tmp_path / "plain"), 4, tokenizer, timeout=300)[0]
    ranks = run_distributed(run_dpo, 2, "shardwise", str(tmp_path / "sharded"), 2, tokenizer, timeout=300)
    assert len(want["loss"]) == 3 and want["rewards/margins"][-1] != 0
    for got in ranks:
        for name, values in want.items():
            assert got[name] == pytest.approx(values, rel=1e-5, abs=1e-6), name
