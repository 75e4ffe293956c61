"""Public SMP v1 example scripts train under `shardwise run` with their notebooks' configs.

Each script in examples/smp_v1/ (origin, commit and every edit in its README) is
launched as its notebook launched it: the estimator's `distribution` dict as
`--config`, the notebook's hyperparameters as command-line flags, shrunk only in
size and length. The loss falls, the partial checkpoint the script saves with
`smp.save_checkpoint` is written, and the script started again with its own
`--load_partial 1` resumes from it: it skips the batches it had trained and
gives the same losses for the steps both runs trained.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "smp_v1"
VOCAB = 256  # --vocab_size: the synthetic tokens' range
WIDTH = 32  # --max_context_width: every synthetic sequence is this long, so the scripts never crop one at random
# --checkpoint_freq, then --max_steps of each run. fp16 skips the steps whose gradients overflow while its
# dynamic loss scale comes down from SMP's initial 2**32: about fifteen here, so the runs are longer than that.
SAVED_AT, FIRST_STEPS, RESUMED_STEPS = 24, 28, 32
SHRUNK = {  # the same for every script: what makes a run of a few steps on CPU learn
    "lr": 1e-2, "lr_decay_iters": 40, "checkpoint_freq": SAVED_AT, "logging_freq": 1, "validation_freq": SAVED_AT,
    "validation_batches": 1, "max_context_width": WIDTH, "vocab_size": VOCAB, "num_layers": 2,
    # no dropout: the scripts reseed after resuming, so only a deterministic model repeats its losses
    "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0, "summary_first_pdrop": 0,
}


@dataclass(frozen=True)
class Example:
    """One script, how many ranks its shrunk config needs, and its notebook's hyperparameters."""

    folder: str
    script: str
    ranks: int
    hyperparameters: dict[str, Any]


GPT2_TENSOR_PARALLEL = Example(  # gpt2/smp-train-gpt-simple.ipynb, "gpt2-small", its flags for the openwebtext data
    "gpt2_tensor_parallel", "train_gpt_simple.py", 4, {
        "max_steps": 100, "seed": 12345, "fp16": 1, "lr": 2.0e-4, "lr_decay_iters": 125000, "min_lr": 0.00001,
        "lr-decay-style": "linear", "warmup": 0.01, "num_kept_checkpoints": 5, "checkpoint_freq": 200,
        "logging_freq": 1, "use_wiki_data": 0, "save_final_full_model": 0, "manual_partition": 1,
        "skip_full_optimizer": 1, "shard_optimizer_state": 1, "activation_checkpointing": 1,
        "activation_strategy": "each", "optimize": "speed", "zipped_data": 0, "validation_freq": 20,
        "max_context_width": 512, "hidden_width": 768, "num_layers": 12, "num_heads": 12,
        "tensor_parallel_degree": 4, "pipeline_parallel_degree": 1, "train_batch_size": 2, "val_batch_size": 4,
        "prescaled_batch": 0,
    } | SHRUNK | {"hidden_width": 64, "num_heads": 4, "tensor_parallel_degree": 2})

GPT2_SHARDED_DATA_PARALLEL = Example(  # gpt2/smp-train-gpt-sharded-data-parallel.ipynb, "gpt2-30b"
    "gpt2_sharded_data_parallel", "train.py", 2, {
        "max_steps": 100, "seed": 12345, "fp16": 0, "bf16": 1, "lr": 2.0e-4, "lr_decay_iters": 125000,
        "min_lr": 0.00001, "lr-decay-style": "linear", "warmup": 0.01, "num_kept_checkpoints": 5,
        "checkpoint_freq": 200, "logging_freq": 1, "save_final_full_model": 0, "delayed_param": 1,
        "use_distributed_transformer": 1, "offload_activations": 0, "activation_loading_horizon": 4,
        "gradient_accumulation": 1, "validation_freq": 200, "train_batch_size": 10, "val_batch_size": 4,
        "flash_attention": 1, "zipped_data": 0, "epochs": 100, "sharded_data_parallel_degree": 32,
        "max_context_width": 2048, "hidden_width": 7168, "num_layers": 48, "num_heads": 64,
    } | SHRUNK | {"hidden_width": 64, "num_heads": 4, "train_batch_size": 2, "val_batch_size": 2,
                  "sharded_data_parallel_degree": 2})

GPTJ_TENSOR_PARALLEL = Example(  # gpt-j/11_train_gptj_smp_tensor_parallel_notebook.ipynb, "gpt-j-xl"
    "gptj_tensor_parallel", "train_gptj_smp_tensor_parallel_script.py", 4, {
        "max_steps": 100, "seed": 12345, "fp16": 1, "lr": 2.0e-4, "lr_decay_iters": 125000, "min_lr": 0.00001,
        "lr-decay-style": "linear", "warmup": 0.01, "num_kept_checkpoints": 5, "checkpoint_freq": 200,
        "validation_freq": 1000, "logging_freq": 10, "save_final_full_model": 1, "manual_partition": 0,
        "skip_full_optimizer": 1, "shard_optimizer_state": 1, "activation_checkpointing": 1,
        "activation_strategy": "each", "optimize": "speed", "tensor_parallel_degree": 4,
        "pipeline_parallel_degree": 1, "train_batch_size": 8, "val_batch_size": 8, "prescaled_batch": 1,
        "hidden_width": 1600, "num_heads": 25, "num_layers": 48,
    } | SHRUNK | {"hidden_width": 256, "num_heads": 4, "train_batch_size": 2, "val_batch_size": 2})
# GPT-J's rotary embedding takes 64 dims of each head, so its heads stay 64 wide (256 / 4).


def write_token_file(path: Path, sequences: int, seed: int) -> None:
    """JSON lines of `input_ids` and `attention_mask`, the uncompressed GPT data the scripts' data_pipeline.py
    reads (`--zipped_data 0`). Each sequence counts up from a random token, so the next token can be learnt."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lines:
        for _ in range(sequences):
            start = rng.randrange(VOCAB)
            ids = [(start + i) % VOCAB for i in range(WIDTH)]
            lines.write(json.dumps({"input_ids": ids, "attention_mask": [1] * WIDTH}) + "\n")


def as_flags(hyperparameters: dict[str, Any]) -> list[str]:
    """The command line SageMaker gives a script for its estimator's hyperparameters."""
    return [item for key, value in hyperparameters.items() for item in (f"--{key}", str(value))]


def run_example(example: Example, tmp_path: Path, name: str, **overrides: Any) -> str:
    """Launch the script as its notebook did, shrunk, with `overrides` on top; rank 0's output (stdout, stderr)."""
    env = {**os.environ, "SM_NUM_GPUS": str(example.ranks), "SM_OUTPUT_DATA_DIR": str(tmp_path / "output"),
           "SM_MODEL_DIR": str(tmp_path / "model"), "SM_CHANNEL_TRAIN": str(tmp_path / "train"),
           "SM_CHANNEL_TEST": str(tmp_path / "test")}  # what SageMaker sets, read by the scripts' flag defaults
    command = shutil.which("shardwise", path=os.path.dirname(sys.executable)) or shutil.which("shardwise")
    folder = EXAMPLES / example.folder
    flags = as_flags(example.hyperparameters | overrides) + ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    result = subprocess.run(
        [command, "run", "--nproc-per-node", str(example.ranks), "--config", str(folder / "distribution.json"),
         "--run-dir", str(tmp_path / name), str(folder / example.script), *flags],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = tmp_path / name / "logs" / "rank0"
    return (logs / "stdout.log").read_text() + (logs / "stderr.log").read_text()


def batch_losses(output: str) -> dict[int, float]:
    """The training loss of every step, from the scripts' own log line `Batch <step> Loss: <loss>, Speed: ...`."""
    return {int(step): float(loss) for step, loss in re.findall(r"Batch (\d+) Loss: ([^,\s]+),", output)}


EXAMPLE_CASES = [
    pytest.param(GPT2_TENSOR_PARALLEL, id="gpt2-tensor-parallel-fp16-zero1"),
    pytest.param(GPT2_SHARDED_DATA_PARALLEL, id="gpt2-sharded-data-parallel-bf16-delayed-init"),
    pytest.param(GPTJ_TENSOR_PARALLEL, id="gptj-tensor-parallel-fp16-prescaled"),
]


@pytest.mark.parametrize("example", EXAMPLE_CASES)
def test_smp_example_trains_saves_and_resumes(example: Example, tmp_path: Path):
    write_token_file(tmp_path / "train" / "train_00.json", 320, seed=0)  # one file holds every step's batches
    write_token_file(tmp_path / "test" / "test_00.json", 32, seed=1)

    first = run_example(example, tmp_path, "first", max_steps=FIRST_STEPS)
    losses = batch_losses(first)
    assert sorted(losses) == list(range(FIRST_STEPS)), first[-3000:]
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    assert (losses[FIRST_STEPS - 2] + losses[FIRST_STEPS - 1]) / 2 < losses[0] - 0.5, losses
    assert re.search(r"Validation loss: \d", first), first[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "newest").read_text().strip() == f"total_steps{SAVED_AT}"
    assert (checkpoints / f"total_steps{SAVED_AT}").is_dir()
    if example.hyperparameters["save_final_full_model"]:  # the notebook also asks for the full model at the end
        assert (tmp_path / "model" / "fullmodel.pt").exists()

    # Checkpointing every 8 steps from 24, the resumed run saves once more, at its last step.
    second = run_example(example, tmp_path, "resumed", max_steps=RESUMED_STEPS, load_partial=1,
                         checkpoint_freq=RESUMED_STEPS - SAVED_AT)
    assert f"Resuming from saved batch index {SAVED_AT}" in second, second[-3000:]
    resumed = batch_losses(second)
    assert sorted(resumed) == list(range(SAVED_AT, RESUMED_STEPS)), second[-3000:]
    for step in range(SAVED_AT, FIRST_STEPS):
        assert math.isclose(resumed[step], losses[step], rel_tol=1e-4), (step, resumed, losses)
    assert (checkpoints / "newest").read_text().strip() == f"total_steps{RESUMED_STEPS}"
