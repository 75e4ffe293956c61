"""The `shardwise demo` training script: a small GPT-2 on learnable synthetic data."""

from pathlib import Path

# Run by path on every rank (`python -u train_gpt2.py`), like any user script.
SCRIPT = Path(__file__).with_name("train_gpt2.py")

__all__ = ["SCRIPT"]
