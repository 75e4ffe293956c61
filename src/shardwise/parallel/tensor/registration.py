"""SMP's `tp_register` / `tp_register_with_module`: a distributed module stands in for a module class.

    @sw.tp_register(sw.nn.DistributedTransformer, init_hook=lambda config: ((), config.to_dict()))
    class MyTransformer(nn.Module): ...

    with sw.tensor_parallelism():
        model = MyModel()                    # model.encoder is still a MyTransformer
    model = sw.DistributedModel(model)       # now a DistributedTransformer, split over the `tp` axis

Registering wraps the class's `__init__` so that each instance keeps the arguments
it was built with. When `DistributedModel` wraps a model (`replace_registered`),
every instance of a registered class marked on by `tensor_parallelism` or
`set_tensor_parallelism` is replaced by `dist_module(*args, **kwargs)` from
`init_hook` (default: the instance's own arguments), with the mark's keyword
arguments on top; `forward_hook` and `return_hook` translate the calls, so the
parent's code calls it as before. As in SMP the replacement is a new module with
its own initial weights: load a state dict after `DistributedModel`. It is built
on the original's device and in its dtype (on the meta device under delayed
initialisation), and whatever the tensor-parallel degree, so every layout trains
the same model. Only the outermost registered instance of a subtree is replaced, the
model itself included: a module without a mark of its own (a model whose own
parameters all live in submodules) takes the mark of its first marked submodule.

Built-in stand-ins (`register_stand_in`, SMP's Hugging Face ones in
`shardwise.nn.huggingface`) are named by class path, so nothing imports
transformers early, and take their arguments from the instance (`arguments`),
since the class was never wrapped to record them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch import nn

from .marks import mark_of

_ARGS = "_shardwise_init_args"
_TRANSLATION = "_shardwise_to_original"


class Registration(NamedTuple):
    dist_module: type
    init_hook: Optional[Callable]
    forward_hook: Optional[Callable]
    return_hook: Optional[Callable]
    arguments: Optional[Callable[[nn.Module], tuple[tuple, dict]]] = None  # (args, kwargs) read off an instance
    to_original: Optional[Callable[[dict], dict]] = None  # a state dict of the stand-in as the original's


def stood_in_for(module: nn.Module) -> Optional[Callable[[dict], dict]]:
    """How to translate a state dict of `module`, a built-in stand-in, to the model it replaced (else None)."""
    return getattr(module, _TRANSLATION, None)


_registry: dict[type, Registration] = {}
_stand_ins: dict[str, Callable[[], Registration]] = {}  # "module.QualName" -> its registration, built when used


def register_stand_in(class_path: str, registration: Callable[[], Registration]) -> None:
    """A built-in stand-in for the class at `class_path` ("package.module.Class"); `registration()` is called
    the first time an instance is met, so it may import the class's library then."""
    _stand_ins[class_path] = registration


def _registration_of(cls: type) -> Optional[Registration]:
    if cls in _registry:
        return _registry[cls]
    loader = _stand_ins.get(f"{cls.__module__}.{cls.__qualname__}")
    return None if loader is None else _registry.setdefault(cls, loader())


def tp_register_with_module(module_cls: type, dist_module: type, init_hook: Optional[Callable] = None,
                            forward_hook: Optional[Callable] = None, return_hook: Optional[Callable] = None) -> None:
    """Let `dist_module` (a `shardwise.nn` distributed module class) stand in for `module_cls`, whose
    instances built from now on are replaced when marked for tensor parallelism (see module docstring)."""
    for what, cls in (("module_cls", module_cls), ("dist_module", dist_module)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"tp_register: {what} must be an nn.Module class, got {cls!r}; "
                            "pass the class itself, e.g. sw.nn.DistributedTransformer")
    if module_cls not in _registry:
        _record_init_args(module_cls)
    _registry[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook)


def tp_register(dist_module: type, init_hook: Optional[Callable] = None, forward_hook: Optional[Callable] = None,
                return_hook: Optional[Callable] = None) -> Callable[[type], type]:
    """Class decorator: `tp_register_with_module(cls, dist_module, ...)` on the class it decorates."""

    def register(cls: type) -> type:
        tp_register_with_module(cls, dist_module, init_hook, forward_hook, return_hook)
        return cls

    return register


def _record_init_args(cls: type) -> None:
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if type(self) is cls:  # a subclass instance is not the registered class
            object.__setattr__(self, _ARGS, (args, kwargs))

    cls.__init__ = __init__


def replace_registered(model: nn.Module) -> nn.Module:
    """`model` with every marked-on instance of a registered class in it replaced (see module docstring): the
    submodules in place, and the model itself by the returned module."""
    replacement = _replaced(model, _root_mark(model))
    if replacement is model:
        _replace_below(model)
    return replacement


def _replace_below(model: nn.Module) -> None:
    for name, child in list(model.named_children()):
        replacement = _replaced(child, mark_of(child))
        if replacement is child:
            _replace_below(child)
        else:
            setattr(model, name, replacement)


def _replaced(module: nn.Module, mark: Any) -> nn.Module:
    registration = _registration_of(type(module))
    if registration is None or mark is None or not mark.enabled:
        return module
    return _replacement(module, registration, mark.options)


def _root_mark(model: nn.Module) -> Any:
    """The model's mark, else its first marked submodule's: a model is never assigned as a submodule, so one
    without parameters of its own is not marked while it is built inside a context."""
    return next((mark_of(sub) for sub in model.modules() if mark_of(sub) is not None), None)


def _replacement(original: nn.Module, registration: Registration, options: dict[str, Any]) -> nn.Module:
    recorded = getattr(original, _ARGS, None)
    if recorded is None and registration.arguments is not None:
        recorded = registration.arguments(original)
    if recorded is None:
        raise RuntimeError(f"{type(original).__name__} was built before it was registered with tp_register; "
                           "fix: register the class before building the model")
    args, kwargs = recorded
    if registration.init_hook is not None:
        args, kwargs = _pair(registration.init_hook(*args, **kwargs), "init_hook")
    taken = inspect.signature(registration.dist_module.__init__).parameters
    kwargs = {**kwargs, **{k: v for k, v in options.items()
                           if k in taken and taken[k].kind is not inspect.Parameter.VAR_KEYWORD}}
    with _built_like(original):
        replacement = registration.dist_module(*args, **kwargs)
    replacement.train(original.training)
    if registration.to_original is not None:
        object.__setattr__(replacement, _TRANSLATION, registration.to_original)
    forward_hook, return_hook = registration.forward_hook, registration.return_hook
    if forward_hook is not None:
        replacement.register_forward_pre_hook(lambda _, a, k: _pair(forward_hook(*a, **k), "forward_hook"),
                                              with_kwargs=True)
    if return_hook is not None:
        replacement.register_forward_hook(lambda _, __, output: return_hook(output))
    return replacement


def _pair(result: Any, hook: str) -> tuple[tuple, dict]:
    """A hook's (args, kwargs); anything else is the hook's error, named."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        raise TypeError(f"tp_register's {hook} must return (args, kwargs), an iterable and a dict, "
                        f"got {type(result).__name__}; fix the hook's return value")
    return tuple(result[0]), result[1]


@contextlib.contextmanager
def _built_like(original: nn.Module) -> Iterator[None]:
    """Build on the original's device and in its floating dtype (meta under delayed initialisation)."""
    tensor = next((t for t in [*original.parameters(), *original.buffers()] if t.is_floating_point()), None)
    if tensor is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(tensor.dtype)
    try:
        with torch.device(tensor.device):
            yield
    finally:
        torch.set_default_dtype(previous)
