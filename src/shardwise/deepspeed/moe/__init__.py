"""`deepspeed.moe`: only what a dense model's script calls (shardwise has no mixture-of-experts layers yet)."""

from . import utils  # reached as an attribute too, as in DeepSpeed

__all__ = ["utils"]
