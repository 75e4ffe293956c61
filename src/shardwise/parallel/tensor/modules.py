"""The plan a model gets from its marks and from the modules that say how they split themselves.

A module with a `tensor_parallel_plan()` method (the `shardwise.nn` distributed
modules, also as registered stand-ins) carries its own plan, written relative to
itself. `compose_plan` puts together, for a model:

* the base plan — the user's, else the built-in one when the model has no such
  module — without the modules marked off (marks.py);
* the plan of every outermost such module that is not marked off. As in SMP, one
  whose sizes the tensor-parallel degree does not divide is left whole, and named.

With no module marked off and none carrying a plan, the base plan is returned
unchanged, so models without marks split exactly as before.
"""

from __future__ import annotations

import logging
from typing import Iterator, Optional

from torch import nn

from ...errors import ConfigError
from .marks import marked_off
from .plan import TensorParallelPlan, assignments, resolve
from .rules import check_tensor_parallel

log = logging.getLogger(__name__)

PLAN_METHOD = "tensor_parallel_plan"


def carries_plan(module: nn.Module) -> bool:
    return callable(getattr(module, PLAN_METHOD, None))


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def carriers_below(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The outermost plan-carrying modules under `module` that are not marked off, by path."""
    for name, child in module.named_children():
        path = _join(prefix, name)
        if marked_off(child):
            continue
        if carries_plan(child):
            yield path, child
        else:
            yield from carriers_below(child, path)


def prefixed(plan: TensorParallelPlan, prefix: str) -> TensorParallelPlan:
    """`plan`, written for a submodule, with its patterns under the submodule's path `prefix`."""
    return TensorParallelPlan(
        {_join(prefix, p): s for p, s in plan.styles.items()},
        local_attrs={_join(prefix, p): a for p, a in plan.local_attrs.items()},
        dims=dict(plan.dims), name=f"{prefix} ({plan.name})" if prefix else plan.name)


def merged(plans: list[TensorParallelPlan], name: str) -> TensorParallelPlan:
    """One plan out of plans over disjoint modules; a named size that two plans give different values is kept
    under each plan's name."""
    styles, local_attrs, dims = {}, {}, {}
    for plan in plans:
        styles.update(plan.styles)
        local_attrs.update(plan.local_attrs)
        for key, value in plan.dims.items():
            dims[key if dims.get(key, value) == value else f"{key} of {plan.name}"] = value
    return TensorParallelPlan(styles, local_attrs=local_attrs, dims=dims, name=name)


def _without_marked_off(model: nn.Module, plan: TensorParallelPlan) -> TensorParallelPlan:
    """The base plan spelled out module by module, less the modules marked off and those below them."""
    off = [path for path, module in model.named_modules() if marked_off(module)]

    def kept(path: str) -> bool:
        return not any(not o or path == o or path.startswith(f"{o}.") for o in off)

    styles = {path: entry.spec for path, entry in assignments(model, plan).items() if kept(path)}
    local_attrs = {path: plan.local_attrs[pattern] for pattern, paths in resolve(model, plan.local_attrs).items()
                   for path in paths if kept(path)}
    return TensorParallelPlan(styles, local_attrs=local_attrs, dims=plan.dims, name=plan.name)


def carriers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost plan-carrying modules not marked off, by path (the model itself: path "")."""
    if marked_off(model):
        return []
    return [("", model)] if carries_plan(model) else list(carriers_below(model))


def compose_plan(model: nn.Module, base: Optional[TensorParallelPlan],
                 tp: Optional[int] = None) -> Optional[TensorParallelPlan]:
    """See the module docstring; None when nothing says how to split the model. `tp`, when known,
    leaves whole the plan-carrying modules it does not divide."""
    found = carriers(model)
    any_off = any(marked_off(module) for module in model.modules())
    if not found and not any_off:
        return base
    own = [prefixed(getattr(module, PLAN_METHOD)(), path) for path, module in found
           if tp is None or _divides(module, getattr(module, PLAN_METHOD)(), tp, path)]
    parts = ([_without_marked_off(model, base)] if base is not None else []) + own
    return merged(parts, base.name if base is not None else "modules")


def _divides(module: nn.Module, plan: TensorParallelPlan, tp: int, path: str) -> bool:
    try:
        check_tensor_parallel(module, tp, plan)
    except ConfigError as error:
        log.warning("tensor parallelism leaves %s (%s) whole: %s", path or "the model", type(module).__name__,
                    "; ".join(problem.rule for problem in error.problems))
        return False
    return True
