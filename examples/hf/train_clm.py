"""Causal language modelling with the Hugging Face Trainer, as transformers' run_clm.py does it, on shardwise.

A Trainer script of the usual shape (HfArgumentParser, a model from a config or a checkpoint, a tokenizer, a text
file cut into blocks, `trainer.train()`, `evaluate()`, `save_model()`) with the one shardwise line: the import of
`Trainer` and `TrainingArguments` from `shardwise.hf`. Nothing is downloaded: the tokenizer and the text are
local files, and a model without `--model_name_or_path` is built from `--model_type` and `--config_overrides`.

    shardwise run --nproc-per-node 2 --set sharded_data_parallel_degree=2 examples/hf/train_clm.py \\
        --tokenizer_name TOKENIZER_DIR --train_file train.txt --output_dir out --do_train --do_eval \\
        --model_type gpt2 --config_overrides n_layer=2,n_embd=32,n_head=2 --block_size 16
    torchrun --nproc-per-node 2 examples/hf/train_clm.py ... --deepspeed ds_config_zero2.json
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, default_data_collator, set_seed

from shardwise.hf import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "A local checkpoint to start from."})
    model_type: str = field(default="gpt2", metadata={"help": "The architecture to build without a checkpoint."})
    config_overrides: Optional[str] = field(default=None, metadata={"help": "e.g. n_layer=2,n_embd=32"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "A local tokenizer directory."})


@dataclass
class DataArguments:
    train_file: str = field(default=None, metadata={"help": "A text file, one document per line."})
    validation_split_percentage: int = field(default=10, metadata={"help": "Blocks kept for evaluation."})
    block_size: int = field(default=16, metadata={"help": "Tokens per training row."})


class Blocks(torch.utils.data.Dataset):
    """The file's tokens end to end, cut into rows of `block_size` (the remainder dropped), labels = inputs."""

    def __init__(self, ids: list[int], block_size: int):
        rows = len(ids) // block_size
        self.rows = torch.tensor(ids[:rows * block_size]).view(rows, block_size)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index].clone()}


def build_model(args: ModelArguments, tokenizer) -> torch.nn.Module:
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    config = AutoConfig.for_model(args.model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    return AutoModelForCausalLM.from_config(config)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    with open(data_args.train_file, encoding="utf-8") as file:
        ids = [token for line in file if line.strip()
               for token in tokenizer(line.strip())["input_ids"] + [tokenizer.eos_token_id]]
    blocks = Blocks(ids, data_args.block_size)
    held_out = max(1, len(blocks) * data_args.validation_split_percentage // 100)
    train, evaluation = torch.utils.data.random_split(
        blocks, [len(blocks) - held_out, held_out], generator=torch.Generator().manual_seed(training_args.seed))

    model = build_model(model_args, tokenizer)
    trainer = Trainer(model=model, args=training_args, train_dataset=train if training_args.do_train else None,
                      eval_dataset=evaluation if training_args.do_eval else None, processing_class=tokenizer,
                      data_collator=default_data_collator)
    metrics: dict = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trained = dict(result.metrics, train_samples=len(train))
        trainer.log_metrics("train", trained)
        trainer.save_metrics("train", trained)
        trainer.save_state()
        metrics.update(trained)
    if training_args.do_eval:
        evaluated = trainer.evaluate()
        evaluated["perplexity"] = math.exp(evaluated["eval_loss"]) if evaluated["eval_loss"] < 100 else float("inf")
        evaluated["eval_samples"] = len(evaluation)
        metrics.update(evaluated)
        trainer.log_metrics("eval", evaluated)
        trainer.save_metrics("eval", evaluated)
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
