"""Tensor-parallel rules, checked on the unsplit model before any collective runs.

A TP degree that does not divide the heads splits a head across ranks and
computes wrong attention; one that does not divide a split weight cannot be laid
out evenly. Both must fail before `parallelize_module` starts scattering weights,
with one line per problem naming key, value, rule and fix. (Power of two and
≤ devices per node are topology rules, checked by `layout_for`.)

Pure: no process group is needed, so `check-config` and the planner can run it
on a model built on the meta device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

from torch import nn

from ...errors import ConfigError, Problem
from .plan import PLAN_KEY, Entry, TensorParallelPlan, assignments, resolve
from .styles import is_conv1d, make_style, style_chunks, style_splits

TP_KEY = "tensor_parallel_degree"
VOCAB_STYLES = ("vocab", "vocab_head")


def check_tensor_parallel(model: nn.Module, tp: int, plan: TensorParallelPlan) -> list[str]:
    """Raise one ConfigError listing every broken rule; return notes to report (uneven vocabulary)."""
    entries = assignments(model, plan)
    problems, notes = _split_problems(model, entries, tp)
    named = list(_named_dim_problems(plan, tp))
    # Named sizes explain a problem in the config's words; the weight-level lines would repeat it.
    problems = named or problems + list(_local_attr_problems(model, plan, tp))
    problems += _tie_problems(model, entries)
    if problems:
        raise ConfigError(problems)
    return sorted(set(notes))


def _fix(value: int) -> str:
    fits = [d for d in (1 << k for k in range(value.bit_length())) if value % d == 0]
    return f"use a {TP_KEY} that divides {value} ({', '.join(map(str, fits))}), or resize the model"


def _problem(tp: int, what: str, value: int) -> Problem:
    return Problem(TP_KEY, tp, f"must divide {what} ({value})", _fix(value))


def _named_dim_problems(plan: TensorParallelPlan, tp: int) -> Iterable[Problem]:
    for name, value in plan.dims.items():
        if value % tp:
            yield _problem(tp, f"the model's {name}", value)


def _local_attr_problems(model: nn.Module, plan: TensorParallelPlan, tp: int) -> Iterable[Problem]:
    seen = set()
    for pattern, paths in resolve(model, plan.local_attrs).items():
        for path in paths:
            module = model.get_submodule(path)
            for attr in plan.local_attrs[pattern]:
                value = getattr(module, attr, None)
                if isinstance(value, int) and value % tp and (pattern, attr) not in seen:
                    seen.add((pattern, attr))
                    yield _problem(tp, f"{attr} of {pattern}", value)


def _vocab_note(rows: int, tp: int) -> str:
    """Uneven vocabulary split, as DTensor lays it out (torch.chunk sizes)."""
    chunk = -(-rows // tp)
    sizes = [max(0, min(chunk, rows - i * chunk)) for i in range(tp)]
    return (f"vocabulary of {rows} rows is not divisible by {TP_KEY}={tp}: shards hold "
            f"{', '.join(map(str, sizes))} rows; DTensor pads the short shards in collectives")


def _split_problems(model: nn.Module, entries: dict[str, Entry], tp: int) -> tuple[list[Problem], list[str]]:
    """Every split weight dim must divide by tp — a vocabulary may be uneven, and is noted."""
    problems: dict[tuple, Problem] = {}
    notes = []
    for path, (pattern, spec) in entries.items():
        module = model.get_submodule(path)
        style = make_style(spec, loss_parallel=True)
        try:
            splits = style_splits(style, module)
        except TypeError:
            problems[(pattern,)] = Problem(f"{PLAN_KEY}[{pattern!r}]", spec,
                                           f"this style cannot split {type(module).__name__} {path!r}",
                                           "give it a style made for its type, or leave it out of the plan")
            continue
        chunks = style_chunks(style)
        for pname, dim in splits.items():
            param = getattr(module, pname, None)
            if param is None:
                continue
            size = param.shape[dim] // chunks
            if spec in VOCAB_STYLES:
                notes += [_vocab_note(size, tp)] if size % tp else []
            elif size % tp and (pattern, size) not in problems:  # a bias repeats its weight's line
                what = f"dim {dim} of {pname} in {pattern}"
                what = f"each of the {chunks} packed chunks of {what}" if chunks > 1 else what
                problems[(pattern, size)] = _problem(tp, what, size)
    return list(problems.values()), notes


def _split_of(model: nn.Module, entries: dict[str, Entry], name: str) -> Optional[str]:
    """How parameter `name` ends up split; None when it sits on a container module (e.g. the
    `bias` BERT's LM head keeps only to tie to its decoder), which may simply not use it."""
    path, _, pname = name.rpartition(".")
    module = model.get_submodule(path)
    if path not in entries:
        return "unsplit" if isinstance(module, (nn.Linear, nn.Embedding)) or is_conv1d(module) else None
    try:
        dim = style_splits(make_style(entries[path].spec, loss_parallel=True), module).get(pname)
    except TypeError:  # a style that cannot split this module, reported by _split_problems
        return None
    return "replicated" if dim is None else f"split on dim {dim}"


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of names that share one Parameter object (e.g. GPT-2's wte and lm_head)."""
    groups = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups[id(param)].append(name)
    return [names for names in groups.values() if len(names) > 1]


def _tie_problems(model: nn.Module, entries: dict[str, Entry]) -> list[Problem]:
    problems = []
    for names in tied_parameters(model):
        splits = {n: _split_of(model, entries, n) for n in names}
        if len({s for s in splits.values() if s is not None}) > 1:
            shown = ", ".join(f"{n} {s}" for n, s in splits.items() if s is not None)
            problems.append(Problem(PLAN_KEY, names, f"tied parameters must be split alike, got {shown}",
                                    "give the tied modules matching styles (e.g. 'vocab' and 'vocab_head'), "
                                    "or split neither"))
    return problems
