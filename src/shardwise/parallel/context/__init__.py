"""Context parallelism: every sequence split over the `cp` mesh axis, attention by ring or all-to-all.

`shard_batch` splits whole rows (load-balanced, with positions, packed documents and shifted labels worked out
first), `apply_context_parallel` splits a model's attention over a group, and `sequence_loss` is the mean over the
whole sequence. See docs/context_parallel.md.
"""

from shardwise.parallel.context.hooks import (
    ContextSettings,
    apply_context_parallel,
    attention,
    context_parallel_attention,
    unsplittable_reason,
)
from shardwise.parallel.context.loss import sequence_loss, shift_labels
from shardwise.parallel.context.sharding import shard, shard_batch, unshard

__all__ = ["ContextSettings", "apply_context_parallel", "attention", "context_parallel_attention", "sequence_loss",
           "shard", "shard_batch", "shift_labels", "unshard", "unsplittable_reason"]
