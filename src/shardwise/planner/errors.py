"""The planner's one error type: bad input (unknown preset, unreadable model source), one line each."""

from __future__ import annotations

from typing import Iterable

from ..errors import did_you_mean


class PlanError(ValueError):
    """Bad planner input. The message is one line that names the input and how to fix it."""


def unknown(kind: str, value: str, choices: Iterable[str], forms: str = "") -> PlanError:
    """'unknown model preset 'x' (did you mean 'y'?)' followed by the valid choices or forms."""
    choices = sorted(choices)
    hint = did_you_mean(value, choices)
    listing = forms or "choose one of " + ", ".join(choices)
    return PlanError(f"unknown {kind} {value!r}" + (f" ({hint})" if hint else "") + f"; {listing}")
