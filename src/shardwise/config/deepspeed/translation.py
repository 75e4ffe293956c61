"""What a translation collects: the shardwise keys, where each came from, and what is honoured otherwise or not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ...errors import Problem, did_you_mean

_TRUE_TEXT = ("true", "1", "yes", "on")  # what DeepSpeed's pydantic reads as true in a string


@dataclass
class Translation:
    """The shardwise keys and their origins; the DeepSpeed keys honoured in another way (how), the ones not
    honoured (why), and the problems that stop the config (an unknown key, "auto", a value DeepSpeed refuses)."""

    config: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    notes: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def set(self, key: str, value: Any, origin: str) -> None:
        self.config[key] = value
        self.origin[key] = origin

    def note(self, key: str, how: str) -> None:
        """`key` is honoured, in the way `how` says."""
        self.notes.append((key, how))

    def ignore(self, key: str, why: str) -> None:
        self.ignored.append((key, why))

    def problem(self, path: str, value: Any, rule: str, fix: str) -> None:
        self.problems.append(Problem(path, value, rule, fix))

    def always(self, key: str, value: Any, expected: Any, why: str) -> None:
        """A key honoured because shardwise always behaves as `expected`; any other value is listed."""
        if value != expected:
            self.ignore(key, f"{why}; {value!r} cannot be honoured")

    def unknown(self, path: str, value: Any, known: Iterable[str], where: str) -> None:
        """A key DeepSpeed does not read in `where`: an error with the closest one."""
        self.problem(path, value, f"unknown key: DeepSpeed reads no such key {where}",
                     did_you_mean(path.rsplit(".", 1)[-1], known) or "remove it, or correct its name")


def enabled(section: Any) -> bool:
    """A section's `enabled` (or the value itself), read as DeepSpeed's pydantic reads a bool."""
    value = section.get("enabled", False) if isinstance(section, Mapping) else section
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_TEXT
    return bool(value)


def switched_off(value: Any) -> bool:
    """A section written with `enabled: false`: it asks for nothing, so there is nothing to honour."""
    return isinstance(value, Mapping) and "enabled" in value and not enabled(value)


def rest(t: Translation, name: str, section: Mapping[str, Any], used: Iterable[str], why: str) -> None:
    """List the keys of `section` not in `used` with one reason."""
    used = set(used)
    for key in section:
        if key not in used:
            t.ignore(f"{name}.{key}", why)


def check_keys(t: Translation, name: str, section: Mapping[str, Any], known: Iterable[str]) -> bool:
    """An unknown-key problem for each key of `section` DeepSpeed refuses there; True when there were none."""
    known = tuple(known)
    before = len(t.problems)
    for key, value in section.items():
        if key not in known:
            t.unknown(f"{name}.{key}", value, known, f"in {name}")
    return len(t.problems) == before
