"""`DistributedLinear` and `DistributedEmbedding`: torch's layers that tensor parallelism splits standing alone.

Each takes and returns whole activations, so it drops into any model: the weight
is split over its output features (the linear layer's rows, the embedding's
columns, as SMP's embedding: "only supports splitting across the embedding_dim"),
each rank computes its slice, and the slices are all-gathered (`colwise_gather`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...parallel.tensor.styles import StyleSpec
from .module import DistributedModule, note_ineffective

class DistributedLinear(DistributedModule, nn.Linear):
    """SMP's `DistributedLinear(in_features, out_features)`: an `nn.Linear` (same arguments, same math);
    `in_features` and `out_features` are the whole layer's, across the tensor-parallel ranks."""

    def _styles(self) -> dict[str, StyleSpec]:
        return {"": "colwise_gather"}


class DistributedEmbedding(DistributedModule, nn.Embedding):
    """SMP's `DistributedEmbedding`: an `nn.Embedding` (same arguments, same math) initialised from
    normal(0, `initializer_range`), split over `embedding_dim`.

    With `max_norm` (which renormalises whole rows in place) or `sparse` gradients it
    is left whole, as SMP leaves modules whose settings do not allow a split.
    `_skip_allgather` and `_skip_scatter_and_merge` steered SMP's own batch
    exchange; shardwise gathers the batch once per model, so they change nothing.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Optional[torch.Tensor] = None, initializer_range: float = 0.02,
                 _skip_allgather: bool = False, _skip_scatter_and_merge: bool = False):
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, _weight)
        self.initializer_range = initializer_range
        self.use_normal_initialization = _weight is None
        if _weight is None:
            self._init_weights(self)
        note_ineffective(type(self).__name__, {
            name: "shardwise gathers the batch once per model" for name, value in
            (("_skip_allgather", _skip_allgather), ("_skip_scatter_and_merge", _skip_scatter_and_merge)) if value})

    def _styles(self) -> dict[str, StyleSpec]:
        return {} if self.max_norm is not None or self.sparse else {"": "colwise_gather"}
