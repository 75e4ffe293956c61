"""trl's SFTTrainer on shardwise in one line: `SFTTrainer = shardwise_trainer(trl.SFTTrainer)`.

The same supervised fine-tuning script (a tiny GPT-2, a local word-level tokenizer, texts of different
lengths padded and masked by trl's collator, gradient accumulation 2) trains under ZeRO-3 on 2 ranks with the
losses trl's own SFTTrainer logs in one process with the ranks' batches together.
"""

from __future__ import annotations

import json
import os

import pytest

from hf_trainer_cases import WORDS, tiny_tokenizer
from shardwise.testing import run_distributed

pytest.importorskip("trl")


def run_sft(kind: str, out: str, micro: int, tokenizer_dir: str) -> list[float]:
    import torch
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tiny_models import build

    if kind == "shardwise":
        from shardwise.hf import shardwise_trainer

        SFTTrainer = shardwise_trainer(SFTTrainer)  # noqa: N806 (the script's own name for it)
        path = os.path.join(out, f"layout-{torch.distributed.get_rank()}.json")
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as file:
            json.dump({"sharded_data_parallel_degree": 2}, file)
        os.environ["SHARDWISE_CONFIG"] = path  # what `shardwise run --set sharded_data_parallel_degree=2` sets
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
