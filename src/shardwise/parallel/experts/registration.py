"""Which modules are experts modules: the built-in Hugging Face ones and those a user registers.

An experts module holds `num_experts` experts with every parameter stacked along
dim 0 (expert e's weights are `parameter[e]`) and is called as

    experts(hidden_states, top_k_index, top_k_weights) -> output

with `hidden_states` (tokens × hidden), `top_k_index` (tokens × k, the experts each
token goes to) and `top_k_weights` (tokens × k): the output is Σ_k weight · expert(token),
shaped like `hidden_states`. That is how transformers (≥ 5) calls the experts of
Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, which are registered by class path (nothing
imports transformers early). A plain `nn.Module` MoE layer whose router calls such a
module joins with

    @sw.register_experts(num_experts="num_experts")
    class MyExperts(nn.Module): ...

after which expert parallelism splits every instance over the `ep` ranks.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from torch import nn

# class path -> the attribute holding the number of experts
_BUILT_IN = {
    f"transformers.models.{family}.modeling_{family}.{name}": "num_experts"
    for family, name in (("mixtral", "MixtralExperts"), ("qwen2_moe", "Qwen2MoeExperts"),
                         ("qwen3_moe", "Qwen3MoeExperts"), ("olmoe", "OlmoeExperts"))
}
_registered: dict[type, str] = {}


def register_experts_with_module(cls: type, num_experts: str = "num_experts") -> None:
    """Mark `cls` as an experts module (see module docstring) whose instances hold their count in `num_experts`."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_experts: expected an nn.Module class, got {cls!r}; pass the experts class itself")
    if not isinstance(num_experts, str) or not num_experts:
        raise TypeError(f"register_experts: num_experts must name the attribute holding the expert count, got "
                        f"{num_experts!r}; e.g. num_experts='num_experts'")
    _registered[cls] = num_experts


def register_experts(num_experts: str = "num_experts") -> Callable[[type], type]:
    """Class decorator: `register_experts_with_module(cls, num_experts)`."""

    def register(cls: type) -> type:
        register_experts_with_module(cls, num_experts)
        return cls

    return register


def count_attribute(module: nn.Module) -> Optional[str]:
    """The attribute holding `module`'s number of experts, if it is an experts module; else None."""
    cls = type(module)
    for klass in cls.__mro__:  # FSDP2 and friends subclass the module's class
        if klass in _registered:
            return _registered[klass]
        found = _BUILT_IN.get(f"{klass.__module__}.{klass.__qualname__}")
        if found:
            return found
    return None


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(path, module, count attribute) of every experts module in `model`, outermost only."""
    stack = [("", model)]
    while stack:
        path, module = stack.pop()
        attribute = count_attribute(module)
        if attribute is not None:
            yield path, module, attribute
            continue
        stack.extend((f"{path}.{name}" if path else name, child)
                     for name, child in reversed(list(module.named_children())))


def has_experts(model: nn.Module) -> bool:
    """Whether `model` holds an experts module that expert parallelism can split."""
    return next(experts_modules(model), None) is not None
