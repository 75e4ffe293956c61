"""DeepSpeed's layer specifications: a module's type and arguments, built when the PipelineModule is.

    LayerSpec(nn.Linear, 16, 32, bias=False).build()   # nn.Linear(16, 32, bias=False)
    TiedLayerSpec("embed", nn.Embedding, 100, 16, forward_fn=lambda emb, x: x @ emb.weight.t())

Every `TiedLayerSpec` with one `key` stands for one module, built at the first
of them; the others run it again (through `forward_fn(module, x)` when given).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import nn


class LayerSpec:
    """`typename(*module_args, **module_kwargs)`, built by `build()`; `typename` must be an nn.Module class."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}; fix: pass a "
                               "module class (put a plain function straight into the layers instead)")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """A new module from the stored specification."""
        if log:
            print(f"RANK={self.global_rank} building {self!r}", flush=True)
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer sharing one module with every other `TiedLayerSpec` of the same `key`.

    `forward_fn(module, x)`, when given, is what this use runs (e.g. an embedding's
    weight as an output projection); else `module(x)`. `tied_weight_attr` names the
    weights DeepSpeed keeps equal across stages (a string or a list of dotted names);
    shardwise ties the whole module, so every parameter of it is one weight on
    every stage, as it is in one process.
    """

    def __init__(self, key: Any, typename: type, *module_args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Any = ["weight"], **module_kwargs: Any):  # noqa: B006 (DeepSpeed's default)
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
