"""Every rank must run the same config: compare a hash at init instead of hanging later."""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from ..config.schema import ShardwiseConfig


class ConfigMismatchError(RuntimeError):
    pass


def config_digest(config: ShardwiseConfig) -> int:
    text = json.dumps(config.model_dump(), sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def check_same_config(config: ShardwiseConfig, device: torch.device) -> None:
    """All-gather a config digest; on a mismatch every rank raises the same one-line error."""
    world = dist.get_world_size()
    if world == 1:
        return
    mine = torch.tensor([config_digest(config)], dtype=torch.int64, device=device)
    digests = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(digests, mine)
    values = [int(d.item()) for d in digests]
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if differing:
        raise ConfigMismatchError(
            f"shardwise config differs across ranks: ranks {differing} disagree with rank 0; "
            "pass the same config (file and --set overrides) to every rank, e.g. through `shardwise run --config`")
