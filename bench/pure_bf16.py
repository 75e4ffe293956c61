"""Pure bf16's accuracy cost: one process trains the tests' tiny GPT-2 (2 layers, hidden 32) on the same batches in
fp32, in bf16 mixed precision (fp32 parameters, autocast) and in pure bf16 (bf16 parameters, gradients and SGD
momentum, as `bf16_master_weights_and_grads` trains), and prints each run's final loss and its parameters' drift
from the fp32 run. Run: python bench/pure_bf16.py [steps]."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import build, dataset, make_optimizer  # noqa: E402

ROWS = 8


def train(precision: str, steps: int) -> tuple[float, torch.Tensor]:
    """Final loss (mean of the last 10 steps) and the flattened parameters."""
    model = build("gpt2", freeze_key_bias=True)
    if precision == "pure":
        model.to(torch.bfloat16)
    optimizer = make_optimizer("sgd", model.parameters())
    data = dataset("gpt2", ROWS * 64)  # 64 batches, seen again each epoch
    losses = []
    for step in range(steps):
        batch = step % 64
        inputs, targets = data[batch * ROWS:(batch + 1) * ROWS]
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "mixed"):
            logits = model(inputs)["logits"]
        loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10, torch.cat([p.detach().float().flatten() for p in model.parameters()])


def main(steps: int) -> None:
    runs = {precision: train(precision, steps) for precision in ("fp32", "mixed", "pure")}
    base = runs["fp32"][1]
    for precision, (loss, params) in runs.items():
        drift = ((params - base).norm() / base.norm()).item()
        print(f"{precision:6s} steps {steps}: final loss {loss:.4f}, parameter drift from fp32 {drift:.2e}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
