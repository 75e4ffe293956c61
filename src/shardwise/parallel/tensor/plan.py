"""A tensor-parallel plan: which modules to split, how, and what must become local.

Patterns are dotted module paths matched one component at a time (`*`, `?`,
`[ab]` as in fnmatch), so `h.*.attn.c_attn` matches every block's `c_attn` but
never a module one level deeper; `**` matches any number of components.
Every pattern must match some module: a typo would otherwise leave the model
silently unsplit, which is correct but tp times slower and larger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Mapping, NamedTuple, Optional

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ...errors import ConfigError, Problem, did_you_mean
from .styles import STYLE_NAMES, StyleSpec

PLAN_KEY = "tensor_parallel_plan"


@dataclass(frozen=True)
class SequencePlan:
    """Where sequence parallelism shards activations over the sequence dim (`sequence.py`).

    blocks: pattern of the transformer blocks, which the model body runs one after
        another; the sequence-sharded region runs from the first one's input to
        the last one's output, so the body itself only ever sees the full sequence.
    norms: patterns of the modules with weights that run on sequence shards inside
        the blocks (norms); their weights stay whole and their gradients are summed
        over the shards. Inside the blocks everything else between the tensor-parallel
        layers must work token by token (residual adds, dropouts).
    """

    blocks: str
    norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorParallelPlan:
    """How to split one model.

    styles: pattern -> style name (see `styles.STYLE_NAMES`) or a torch ParallelStyle.
    local_attrs: pattern -> attribute names on the matched modules (head counts,
        split sizes) that hold per-rank values after the split; each is divided by
        the TP degree, and must be divisible by it. Absent attributes are skipped,
        so one plan serves library versions that keep different attributes.
    dims: named model sizes the TP degree must divide (heads, hidden, MLP), so error
        messages speak the model config's language; when none is broken, the sizes
        of the split weights and of `local_attrs` are checked instead.
    sequence: where sequence parallelism may shard the residual stream (see
        `SequencePlan`); None if the plan does not support it.
    """

    styles: Mapping[str, StyleSpec]
    local_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    name: str = "user"
    sequence: Optional[SequencePlan] = None

    def __post_init__(self) -> None:
        problems = [
            Problem(f"{PLAN_KEY}[{pattern!r}]", spec, "unknown style",
                    did_you_mean(str(spec), STYLE_NAMES) or f"use one of {', '.join(STYLE_NAMES)}, or a ParallelStyle")
            for pattern, spec in self.styles.items()
            if not isinstance(spec, ParallelStyle) and spec not in STYLE_NAMES
        ]
        if problems:
            raise ConfigError(problems)


def match(pattern: str, path: str) -> bool:
    """Whether module path `path` matches `pattern` (see the module docstring); "" is the root module."""
    return _match_parts(pattern.split(".") if pattern else [], path.split(".") if path else [])


def _match_parts(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_parts(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], head) and _match_parts(rest, parts[1:])


def resolve(model: nn.Module, patterns: Mapping[str, object]) -> dict[str, list[str]]:
    """Module paths matched by each pattern; a ConfigError names every pattern that matches nothing."""
    names = [name for name, _ in model.named_modules()]
    found = {pattern: [n for n in names if match(pattern, n)] for pattern in patterns}
    problems = [
        Problem(f"{PLAN_KEY}[{pattern!r}]", patterns[pattern], f"matches no module of {type(model).__name__}",
                did_you_mean(pattern, names) or "write the path as model.named_modules() spells it")
        for pattern, hits in found.items() if not hits
    ]
    if problems:
        raise ConfigError(problems)
    return found


class Entry(NamedTuple):
    pattern: str
    spec: StyleSpec


def assignments(model: nn.Module, plan: TensorParallelPlan) -> dict[str, Entry]:
    """Module path -> (matching pattern, style spec); one module matched twice is a plan error."""
    result: dict[str, Entry] = {}
    problems = []
    for pattern, paths in resolve(model, plan.styles).items():
        for path in paths:
            if path in result:
                problems.append(Problem(f"{PLAN_KEY}[{pattern!r}]", plan.styles[pattern],
                                        f"module {path!r} already has style {result[path].spec!r}",
                                        "make the patterns match disjoint modules"))
            else:
                result[path] = Entry(pattern, plan.styles[pattern])
    if problems:
        raise ConfigError(problems)
    return result
