"""Hugging Face's Trainer on shardwise: change the import, keep the script.

    from shardwise.hf import Trainer, TrainingArguments      # was: from transformers import ...

The layout comes from the config given to `shardwise run` (or the script's `sw.init`), or from
`TrainingArguments(deepspeed=...)`, whose "auto" values are filled from the TrainingArguments and the model as
transformers fills them. `shardwise_trainer(cls)` does the same for any Trainer subclass (trl's SFTTrainer).
See docs/hf.md.
"""

from .arguments import Seq2SeqTrainingArguments, TrainingArguments
from .trainer import Seq2SeqTrainer, ShardwiseTrainerMixin, Trainer, shardwise_trainer

__all__ = ["Seq2SeqTrainer", "Seq2SeqTrainingArguments", "ShardwiseTrainerMixin", "Trainer", "TrainingArguments",
           "shardwise_trainer"]
