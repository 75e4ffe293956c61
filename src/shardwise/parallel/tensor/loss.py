"""Vocabulary-parallel loss: cross-entropy on logits that stay sharded over the vocabulary.

When it applies: the plan splits the output head with "vocab_head" (the built-in
GPT-2, Llama/Mistral and BERT masked-LM plans do) and `apply_tensor_parallel`
ran with `loss_parallel=True` (the default). The head then returns its logits
as a DTensor sharded on the last dim, rows × vocab/tp per rank, and under torch's
`loss_parallel()` `F.cross_entropy` (class-index targets, `ignore_index`, mean or
sum; no label smoothing) — also inside HF's own LM loss when `labels=` is passed
— works out the log-softmax with per-row all-reduces of a max and a sum. No rank
ever holds rows × vocab. The backward must run under the same context, so the
runtime wraps the whole step (forward, loss, backward) in `loss_context(model)`.

Other uses of the logits (argmax, a custom loss) still work through DTensor but
may gather the vocabulary; `loss_parallel=False` returns plain full logits instead.
With `prescaled_batch` off, `TensorParallelBatch.split` turns the vocab-sharded
logits into each rank's own rows with the full vocabulary (one all-to-all), which
is again 1/tp of the group's logits per rank, and any loss works on them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

# Set on the root module by apply_tensor_parallel when its output is vocab-sharded logits.
VOCAB_SHARDED_OUTPUT = "_shardwise_vocab_sharded_output"


def loss_context(model: nn.Module) -> AbstractContextManager:
    """`loss_parallel()` for a model whose logits are vocab-sharded, else a no-op context."""
    return loss_parallel() if getattr(model, VOCAB_SHARDED_OUTPUT, False) else nullcontext()
