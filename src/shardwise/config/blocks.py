"""DeepSpeed's `optimizer` and `scheduler` blocks: their types, their parameters, and each parameter's rule.

    {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "weight_decay": 0.01}}

`sw.configured_optimizer` / `sw.configured_scheduler` build them (api/configured.py);
here every name and value is checked before a rank starts, so a bad one is a
config error naming its key rather than a TypeError inside torch at the first
step. The types are DeepSpeed's names: its own optimizers case-insensitively
(`adam`, `AdamW`, `LAMB`, as DeepSpeed lower-cases the names it ships) and
torch.optim's `SGD` as torch spells it. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import Problem, did_you_mean


@dataclass(frozen=True)
class Param:
    """A parameter's rule: `kind` number, int, bool, pair (two numbers, e.g. betas) or choice; bounds inclusive
    unless `below` (exclusive upper bound); `null` allows None."""

    kind: str
    low: Optional[float] = None
    below: Optional[float] = None
    choices: tuple[str, ...] = ()
    null: bool = False
    only: Any = None          # the one value accepted, with `why` the others are not
    why: str = ""

    def problem(self, value: Any) -> Optional[tuple[str, str]]:
        """(rule, fix) when `value` breaks the rule, else None."""
        if value is None and self.null:
            return None
        if self.kind == "bool":
            if not isinstance(value, bool):
                return "must be true or false", "write true or false"
        elif self.kind == "choice":
            if value not in self.choices:
                return f"must be one of {', '.join(map(repr, self.choices))}", f"use one of {', '.join(self.choices)}"
        elif self.kind == "pair":
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_is_number, value))):
                return "must be two numbers", "write e.g. [0.9, 0.999]"
            broken = next((v for v in value if self._out_of_range(v)), None)
            if broken is not None:
                return f"each must be {self._range()}", f"use numbers {self._range()}"
        else:
            if not (_is_number(value) and (self.kind == "number" or float(value).is_integer())):
                what = "a whole number" if self.kind == "int" else "a number"
                hint = _text_number_hint(value) if isinstance(value, str) and _looks_numeric(value) else ""
                return f"must be {what}", f"write {what}{hint}"
            if self._out_of_range(value):
                return f"must be {self._range()}", f"use a value {self._range()}"
        if self.only is not None and value != self.only:
            return self.why, f"set it to {str(self.only).lower()} or drop it"
        return None

    def _out_of_range(self, value: float) -> bool:
        return (self.low is not None and value < self.low) or (self.below is not None and value >= self.below)

    def _range(self) -> str:
        parts = ([f">= {self.low:g}"] if self.low is not None else []) + (
            [f"< {self.below:g}"] if self.below is not None else [])
        return " and ".join(parts)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text_number_hint(text: str) -> str:
    if "e" in text.lower() and "." not in text:
        return f" (YAML reads {text} without a dot as text: write e.g. {float(text):.1e})"
    return ", without quotes"


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_RATE, _COUNT, _FLAG = Param("number", low=0), Param("int", low=0), Param("bool")
_BETAS = Param("pair", low=0, below=1)
_TORCH_FLAG = Param("bool", null=True)  # torch's foreach / fused: None lets torch choose
_ADAM = {"lr": _RATE, "betas": _BETAS, "eps": _RATE, "weight_decay": _RATE, "amsgrad": _FLAG,
         "bias_correction": Param("bool", only=True, why="torch's Adam always corrects the moments' bias"),
         "torch_adam": _FLAG, "fp32_optimizer_states": _FLAG, "foreach": _TORCH_FLAG, "fused": _TORCH_FLAG}

# Each type's parameters (DeepSpeed's names and rules); api/configured.py builds them on torch.optim and
# shardwise.optimizers.
OPTIMIZERS: dict[str, dict[str, Param]] = {
    "Adam": {**_ADAM, "adam_w_mode": _FLAG},
    "AdamW": {**_ADAM, "adam_w_mode": _FLAG},  # DeepSpeed takes it for AdamW too, which decouples either way
    "Lamb": {"lr": _RATE, "bias_correction": _FLAG, "betas": _BETAS, "eps": _RATE, "weight_decay": _RATE,
             "eps_inside_sqrt": _FLAG, "max_coeff": Param("number", low=0), "min_coeff": Param("number", low=0),
             "amsgrad": Param("bool", only=False, why="LAMB has no AMSGrad variant (DeepSpeed's FusedLamb refuses "
                                                      "it too)")},
    "Adagrad": {"lr": _RATE, "lr_decay": _RATE, "weight_decay": _RATE, "initial_accumulator_value": _RATE,
                "eps": _RATE, "foreach": _TORCH_FLAG, "maximize": _FLAG},
    "SGD": {"lr": _RATE, "momentum": _RATE, "dampening": Param("number"), "weight_decay": _RATE,
            "nesterov": _FLAG, "maximize": _FLAG, "foreach": _TORCH_FLAG},
}
# DeepSpeed's own names, matched without case (its config lower-cases them); torch.optim's keep their case.
_DEEPSPEED_NAMES = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "adagrad": "Adagrad"}
_COMPRESSED = ("DeepSpeed's {name}, which compresses the gradients it communicates to 1 bit with error feedback: a "
               "different algorithm from {base} on the same data; shardwise reduces gradients uncompressed")
# DeepSpeed optimizers shardwise does not build: what they are, and what to use instead.
REFUSED_OPTIMIZERS = {
    "onebitadam": (_COMPRESSED.format(name="1-bit Adam", base="Adam"), "Adam"),
    "zerooneadam": (_COMPRESSED.format(name="0/1 Adam", base="Adam"), "Adam"),
    "onebitlamb": (_COMPRESSED.format(name="1-bit LAMB", base="LAMB"), "Lamb"),
    "lion": ("DeepSpeed's FusedLion; torch has no Lion and shardwise builds none", None),
    "muon": ("DeepSpeed's Muon, with an Adam for the parameters Muon does not take; shardwise builds neither", None),
    "muadam": ("the mup package's μP Adam", None), "muadamw": ("the mup package's μP AdamW", None),
    "musgd": ("the mup package's μP SGD", None),
}

_WARMUP = {"warmup_min_lr": _RATE, "warmup_max_lr": _RATE, "warmup_num_steps": Param("int", low=1),
           "warmup_type": Param("choice", choices=("log", "linear")), "last_batch_iteration": Param("int", low=-1)}
_STEPS = Param("int", low=1)
SCHEDULERS: dict[str, dict[str, Param]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {"total_num_steps": _STEPS, **_WARMUP},
    "OneCycle": {"cycle_min_lr": _RATE, "cycle_max_lr": _RATE, "decay_lr_rate": _RATE,
                 "cycle_first_step_size": _STEPS, "cycle_second_step_size": Param("int", low=1, null=True),
                 "cycle_first_stair_count": _COUNT, "cycle_second_stair_count": Param("int", low=0, null=True),
                 "decay_step_size": _COUNT, "cycle_momentum": _FLAG, "cycle_min_mom": Param("number", low=0, below=1),
                 "cycle_max_mom": Param("number", low=0, below=1), "decay_mom_rate": _RATE,
                 "last_batch_iteration": Param("int", low=-1)},
}
REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "OneCycle": ("cycle_min_lr", "cycle_max_lr")}

# The parameters each type takes, by name (validate.py and the docs list them).
OPTIMIZER_PARAMS = {name: tuple(params) for name, params in OPTIMIZERS.items()}
SCHEDULER_PARAMS = {name: tuple(params) for name, params in SCHEDULERS.items()}


def optimizer_type(name: Any) -> Any:
    """DeepSpeed's optimizer name as shardwise spells it (`adamw` -> `AdamW`); anything else unchanged."""
    return _DEEPSPEED_NAMES.get(name.lower(), name) if isinstance(name, str) else name


class OptimizerBlock(BaseModel):
    """DeepSpeed's `optimizer` block: the optimizer `sw.configured_optimizer` builds."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["Adam", "AdamW", "Lamb", "Adagrad", "SGD"]
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _deepspeed_name(cls, name: Any) -> Any:
        return optimizer_type(name)


class SchedulerBlock(BaseModel):
    """DeepSpeed's `scheduler` block: the learning-rate schedule `sw.configured_scheduler` builds."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["WarmupLR", "WarmupDecayLR", "OneCycle"]
    params: dict[str, Any] = Field(default_factory=dict)


def _known_optimizers() -> str:
    return "Adam, AdamW, Lamb, Adagrad (DeepSpeed's names, in any case) or SGD (torch.optim's)"


def _type_problem(key: str, name: Any) -> Optional[Problem]:
    """The problem with the block's `type`, or None when shardwise builds it."""
    path = f"{key}.type"
    if key == "optimizer":
        if optimizer_type(name) in OPTIMIZERS:
            return None
        lowered = name.lower() if isinstance(name, str) else None
        if lowered in REFUSED_OPTIMIZERS:
            why, instead = REFUSED_OPTIMIZERS[lowered]
            fix = f"use {instead}" if instead else "build it in the script and wrap it in sw.DistributedOptimizer"
            return Problem(path, name, f"is {why}", fix + f"; shardwise builds {_known_optimizers()}")
        close = next((known for known in OPTIMIZERS if isinstance(name, str) and known.lower() == lowered), None)
        hint = (f"did you mean '{close}'? (torch.optim's names keep their case, in DeepSpeed too)" if close
                else did_you_mean(str(name), OPTIMIZERS))
        return Problem(path, name, f"is not an optimizer shardwise builds from a config: it builds {_known_optimizers()}",
                       hint or "use one of them, or build the optimizer in the script and wrap it: "
                       "sw.DistributedOptimizer(torch.optim.X(model.parameters(), ...))")
    if name in SCHEDULERS:
        return None
    return Problem(path, name, f"is not a schedule shardwise builds from a config: it builds {', '.join(SCHEDULERS)}",
                   did_you_mean(str(name), SCHEDULERS) or "use one of them, or build a torch LRScheduler in the "
                   "script and step it after every optimizer step")


def block_problems(key: str, block: Any) -> list[Problem]:
    """Every problem of the `optimizer` or `scheduler` block `block`: its shape, type, parameter names and values."""
    if not isinstance(block, Mapping):
        return [Problem(key, block, "must be a dict with type and params", f'write e.g. "{key}": {{"type": ..., '
                        '"params": {...}}')]
    problems = [Problem(f"{key}.{name}", value, "is not a key of the block", "keep type and params only")
                for name, value in block.items() if name not in ("type", "params")]
    if "type" not in block:
        return problems + [Problem(f"{key}.type", None, "is missing", "name the type, e.g. AdamW")]
    found = _type_problem(key, block["type"])
    if found:
        return problems + [found]
    name = optimizer_type(block["type"]) if key == "optimizer" else block["type"]
    rules = (OPTIMIZERS if key == "optimizer" else SCHEDULERS)[name]
    params = block.get("params", {})
    if not isinstance(params, Mapping):
        return problems + [Problem(f"{key}.params", params, "must be a dict of the type's parameters",
                                   f"write e.g. {{\"{next(iter(rules))}\": ...}}")]
    for param, value in params.items():
        path = f"{key}.params.{param}"
        if param == "max_grad_norm":
            problems.append(Problem(path, value, "is not an optimizer parameter in DeepSpeed (it refuses it)",
                                    "use the top-level gradient_clipping"))
        elif param not in rules:
            problems.append(Problem(path, value, f"is not a parameter of {name}",
                                    did_you_mean(param, rules) or f"use {', '.join(rules)}"))
        elif (broken := rules[param].problem(value)) is not None:
            problems.append(Problem(path, value, *broken))
    problems += [Problem(f"{key}.params.{param}", None, f"is required by {name}", "give it a value")
                 for param in REQUIRED.get(name, ()) if param not in params]
    return problems
