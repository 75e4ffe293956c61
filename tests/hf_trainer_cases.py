"""Shared by tests/test_hf_*.py: a tiny GPT-2 Trainer run, on shardwise.hf or on transformers itself.

Each row's labels hide a random share of its tokens (-100), so ranks and micro-steps count different numbers
of label tokens and the Trainer's loss normalisation (`num_items_in_batch`, gathered over every rank) matters.
A run returns what the Trainer logged (loss, grad_norm, learning rate per step), the evaluation metrics and
rank 0's whole parameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import torch

from tiny_models import SEQ, VOCAB, build, relative_error

ROWS = 48
WORDS = "the a model trains on many devices by changing a config not the loop one process or four".split()
MICRO_DEFAULT = 2  # per rank; one process takes the ranks' micro batches together


def tiny_tokenizer(folder: Any) -> str:
    """A word-level tokenizer over WORDS, saved where transformers' AutoTokenizer loads it (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<unk>", "<eos>", *dict.fromkeys(WORDS)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", bos_token="<eos>",
                            pad_token="<eos>").save_pretrained(folder)
    return str(folder)


def rows(count: int = ROWS, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(count, SEQ, generator=g) < 0.3] = -100
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]


def arguments(cls: Any, out: str, micro: int, **more: Any) -> Any:
    settings = dict(output_dir=out, per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
                    gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, adam_epsilon=1e-6,
                    weight_decay=0.01, warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[],
                    disable_tqdm=True, seed=11, log_level="error")
    settings.update(more)
    if "activation_checkpointing" not in {field.name for field in dataclasses.fields(cls)}:  # before 5.20
        settings["gradient_checkpointing"] = settings.pop("activation_checkpointing", False)
    return cls(**settings)


def losses(history: list[dict]) -> list[float]:
    return [entry["loss"] for entry in history if "loss" in entry]


class StepCounter:
    """A Trainer callback counting the optimizer steps this `train()` call ran (a resumed run runs fewer)."""

    def __init__(self):
        self.steps = 0

    def __getattr__(self, name: str) -> Any:  # every other event: nothing
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.steps += 1


def token_accuracy(prediction: Any) -> dict:
    """compute_metrics: how often the logits' top token is the next label (masked labels left out)."""
    guesses = prediction.predictions[:, :-1].argmax(-1)
    targets = prediction.label_ids[:, 1:]
    kept = targets != -100
    return {"accuracy": float((guesses == targets)[kept].mean())}


def deepspeed_optimizers(model: torch.nn.Module, warmup_steps: int, lr: float = 1e-3) -> tuple:
    """What DeepSpeed builds from the Hugging Face configs' AdamW and WarmupLR blocks once the Trainer filled them
    (`run`'s arguments): torch's AdamW over the trainable parameters in one group, and DeepSpeed's WarmupLR (log
    warm-up from 0, as shardwise.api.configured computes it)."""
    from shardwise.api.configured import WarmupLR

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    return optimizer, WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=lr, warmup_num_steps=max(1, warmup_steps))


def run(kind: str, out: str, micro: int, layout: Optional[dict] = None, evaluate: bool = True,
        resume: Any = None, deepspeed_reference: bool = False, save_to: Optional[str] = None, predict: bool = False,
        **more: Any) -> dict:
    """One rank: train (and evaluate) a tiny GPT-2 with `kind` "plain" (transformers.Trainer), "shardwise"
    (shardwise.hf.Trainer under the shardwise config `layout`, as `shardwise run --config` gives it) or
    "transformers-arguments" (shardwise.hf.Trainer given transformers' own TrainingArguments).
    `deepspeed_reference`: the plain Trainer with the optimizer and schedule DeepSpeed builds from a Hugging Face
    config (`deepspeed_optimizers`). `save_to`: then `save_model` there, and rank 0 loads it with `from_pretrained`
    (its state dict is returned as `loaded`). `predict`: evaluate with `token_accuracy` as compute_metrics, then
    `predict` the evaluation rows (rank 0's predictions are returned)."""
    import transformers

    if kind == "plain":
        from transformers import Trainer, TrainingArguments
    elif kind == "transformers-arguments":  # shardwise's Trainer with transformers' own TrainingArguments
        from transformers import TrainingArguments

        from shardwise.hf import Trainer
    else:
        from shardwise.hf import Trainer, TrainingArguments
        if layout is not None:
            path = os.path.join(out, f"layout-{torch.distributed.get_rank()}.json")
            os.makedirs(out, exist_ok=True)
            with open(path, "w") as file:
                json.dump(layout, file)
            os.environ["SHARDWISE_CONFIG"] = path  # what `shardwise run --config` sets
    transformers.logging.set_verbosity_error()
    model = build("gpt2", freeze_key_bias=True)
    args = arguments(TrainingArguments, out, micro, **more)
    optimizers = deepspeed_optimizers(model, args.warmup_steps) if deepspeed_reference else (None, None)
    counter = StepCounter()
    trainer = Trainer(model=model, args=args, train_dataset=rows(), eval_dataset=rows(16, seed=8),
                      optimizers=optimizers, callbacks=[counter], compute_metrics=token_accuracy if predict else None)
    output = trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate() if evaluate else {}
    predicted = trainer.predict(rows(16, seed=8)) if predict else None
    wrapped = trainer.model_wrapped
    state = trainer.model.state_dict() if kind == "plain" else wrapped.full_state_dict()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    loaded = None
    if save_to is not None:
        trainer.save_model(save_to)
        if rank == 0:
            loaded = {k: v.clone() for k, v in
                      transformers.AutoModelForCausalLM.from_pretrained(save_to).state_dict().items()}
    layout = {}
    if kind != "plain":
        from shardwise.runtime import state as runtime_state

        config = runtime_state.current().config
        layout = {"zero_stage": config.effective_zero_stage, "offload": config.offload_optimizer_state,
                  "clipping": config.gradient_clipping}
    return {"history": trainer.state.log_history, "losses": losses(trainer.state.log_history),
            "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
            "lrs": [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
            "eval_loss": metrics.get("eval_loss"), "eval_accuracy": metrics.get("eval_accuracy"),
            "predictions": torch.from_numpy(predicted.predictions) if predicted is not None and rank == 0 else None,
            "test_metrics": predicted.metrics if predicted is not None else None, "train_loss": output.training_loss,
            "global_step": trainer.state.global_step, "steps_run": counter.steps, "layout": layout, "loaded": loaded,
            "decays": sorted({group["weight_decay"] for group in trainer.optimizer.param_groups}),
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if rank == 0 else None}


def assert_same(ranks: list[dict], want: dict, tolerance: float = 1e-5, state_tolerance: Optional[float] = None) -> None:
    got = ranks[0]
    assert len(got["losses"]) == len(want["losses"])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(want["grad_norms"]), rtol=tolerance,
                               atol=tolerance)
    assert got["lrs"] == want["lrs"]
    assert got["decays"] == want["decays"]  # the Trainer's groups (no decay on biases and norms), or DeepSpeed's one
    if want["eval_loss"] is not None:
        assert abs(got["eval_loss"] - want["eval_loss"]) <= tolerance * max(1.0, abs(want["eval_loss"]))
    if want["predictions"] is not None and got["predictions"] is not None:  # compute_metrics and predict
        assert got["eval_accuracy"] == want["eval_accuracy"]
        torch.testing.assert_close(got["predictions"], want["predictions"], rtol=tolerance, atol=tolerance)
        for name in ("test_loss", "test_accuracy"):
            assert abs(got["test_metrics"][name] - want["test_metrics"][name]) <= tolerance, name
    for name, value in want["state"].items():  # relative to each tensor's norm, as tiny_models compares
        if name in got["state"]:
            assert relative_error(got["state"][name], value) <= (state_tolerance or tolerance), name
    assert set(got["state"]) <= set(want["state"])
    for other in ranks[1:]:  # every rank logs the same (the Trainer averages over ranks)
        assert other["losses"] == got["losses"]
