"""Shared pytest setup for shardwise's tests."""

import sys

from shardwise.testing import preload

# What the distributed tests' ranks build, imported once in the process their workers are forked from.
preload("shardwise.api", "shardwise.parallel.compose",
        *(f"transformers.models.{name}.modeling_{name}" for name in (
            "gpt2", "llama", "bert", "roberta", "vit", "gptj", "mistral", "mixtral", "qwen2", "qwen2_moe",
            "qwen3_moe", "olmoe")))


def pytest_sessionfinish(session, exitstatus):
    """Stop the distributed test harness's worker pools so the session ends promptly."""
    testing = sys.modules.get("shardwise.testing")
    if testing is not None:
        testing.shutdown_pools()
