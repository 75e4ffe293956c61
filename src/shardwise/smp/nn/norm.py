"""`FusedLayerNorm`: SMP's stand-in for apex's fused layer norm, here torch's own."""

from __future__ import annotations

from torch import nn


class FusedLayerNorm(nn.LayerNorm):
    """apex's `FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)`: layer normalisation, the
    math of `torch.nn.LayerNorm` (whose arguments it takes), run by torch's `F.layer_norm` kernel for the
    device — a fused one on accelerators; apex is not needed."""
