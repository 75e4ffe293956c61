"""`shardwise.hf.Seq2SeqTrainer`: an encoder-decoder (a tiny BART) trains, evaluates and predicts with
`generate` under ZeRO-3 as transformers' own Seq2SeqTrainer does on the same 2 ranks (its DDP, `use_cpu=True`).

The reference is transformers' multi-process Trainer rather than one process because BART takes the Trainer's
`num_items_in_batch` and ignores it: transformers then scales the loss by the number of processes (its loss is
per rank), and shardwise.hf keeps transformers' behaviour. Under ZeRO-3 `generate` gathers the root's shards (the
shared embedding the encoder reads), as transformers' Trainer does under FSDP2.
"""

from __future__ import annotations

import json
import os

import pytest

from shardwise.testing import run_distributed


def run_seq2seq(kind: str, out: str) -> dict:
    import torch
    import transformers
    from transformers import BartConfig, BartForConditionalGeneration

    if kind == "plain":
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    else:
        from shardwise.hf import Seq2SeqTrainer, Seq2SeqTrainingArguments

        path = os.path.join(out, f"layout-{torch.distributed.get_rank()}.json")
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as file:
            json.dump({"sharded_data_parallel_degree": 2}, file)
        os.environ["SHARDWISE_CONFIG"] = path
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": torch.randint(3, 64, (8,), generator=g), "labels": torch.randint(3, 64, (6,), generator=g)}
            for _ in range(32)]
    args = Seq2SeqTrainingArguments(
        output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        seed=3, predict_with_generate=True, generation_max_length=6, log_level="error", use_cpu=kind == "plain")
    trainer = Seq2SeqTrainer(model=BartForConditionalGeneration(config), args=args, train_dataset=rows,
                             eval_dataset=rows[:8])
    trainer.train()
    predicted = trainer.predict(rows[:8])
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "predictions": predicted.predictions.tolist(), "test_loss": predicted.metrics["test_loss"]}


def test_seq2seq_trainer_under_zero3_trains_and_generates_as_transformers_does(tmp_path):
    want = run_distributed(run_seq2seq, 2, "plain", str(tmp_path / "plain"), timeout=300)[0]
    got = run_distributed(run_seq2seq, 2, "shardwise", str(tmp_path / "sharded"), timeout=300)[0]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-5)
    assert got["predictions"] == want["predictions"]
