"""Config errors as values: every broken rule becomes one `Problem`, raised together."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Problem:
    """One broken rule: where (dotted key), what was given, the rule, and how to fix it."""

    path: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}={self.value!r}: {self.rule}; fix: {self.fix}"


class ConfigError(ValueError):
    """Raised once with every problem found, one line each, so users fix them in one pass."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        lines = [str(p) for p in self.problems]
        head = "invalid shardwise config: " if len(lines) == 1 else "invalid shardwise config:\n  "
        super().__init__(head + "\n  ".join(lines))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ' (did you mean X?)'-style hint, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""
