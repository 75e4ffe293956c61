"""SMP v1's documented PyTorch surface, walked against shardwise.

The documented names and config keys are data (docs/smp_v1/documented_*.txt, copied from SMP v1's
documentation); docs/smp_v1.md has one table row per entry with its status here. A name is implemented
when `shardwise.<name>` resolves by attribute access, as `smp.<name>` does in an SMP script (an instance
attribute counts when its class declares it with an annotation); a key is implemented when every value
the data lists passes the one config validation (`topology.layout.validate`) on one node of 8 devices.
"""

from __future__ import annotations

import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import shardwise
from shardwise.config import ConfigError
from shardwise.topology import Cluster
from shardwise.config.layout import validate

DOCS = Path(__file__).resolve().parents[1] / "docs"
NAMES_FILE = DOCS / "smp_v1" / "documented_names.txt"
KEYS_FILE = DOCS / "smp_v1" / "documented_keys.txt"
GUIDE = DOCS / "smp_v1.md"
SOURCE_COMMIT = "f08be97eb494f99ba807969ee8e748a582f9833e"
CLUSTER = Cluster(nodes=1, devices_per_node=8)

MISSING = "missing"
ACCEPTED = "accepted without effect"
STATUSES = ("works", "works differently", ACCEPTED, MISSING)
KINDS = ("name", "key")  # the first header cell of the guide's two tables


def _data_rows(path: Path, columns: int) -> list[list[str]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            cells = [cell.strip() for cell in line.split("|")]
            assert len(cells) == columns, f"{path.name}:{number}: expected {columns} cells separated by |: {line!r}"
            rows.append(cells)
    return rows


def documented_names() -> list[str]:
    return [row[0] for row in _data_rows(NAMES_FILE, 3)]


@dataclass(frozen=True)
class DocumentedKey:
    key: str
    type: str
    default: str
    values: list[Any]
    context: dict[str, Any]


def documented_keys() -> list[DocumentedKey]:
    return [DocumentedKey(key, type_, default, json.loads(values), json.loads(context))
            for key, type_, default, values, context in _data_rows(KEYS_FILE, 5)]


@dataclass(frozen=True)
class Row:
    kind: str
    entry: str
    status: str
    how: str
    line: int


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_rows() -> list[Row]:
    """The rows of the guide's tables whose header is `| name | status | how / why |` or `| key | … |`."""
    rows, kind = [], None
    for number, line in enumerate(GUIDE.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("|"):
            kind = None
            continue
        cells = _cells(line)
        if cells[1:] == ["status", "how / why"] and cells[0] in KINDS:
            kind = cells[0]
        elif kind is not None and not set(line) <= set("|-: "):
            rows.append(Row(kind, cells[0].strip("`"), cells[1] if len(cells) > 1 else "",
                            "|".join(cells[2:]), number))
    return rows


def _rows_of(kind: str) -> dict[str, Row]:
    return {row.entry: row for row in table_rows() if row.kind == kind}


def _class_declares(cls: type, name: str) -> bool:
    return any(name in inspect.get_annotations(klass) for klass in cls.__mro__)


def unresolved(name: str) -> str | None:
    """Why `shardwise.<name>` does not resolve, or None when it does."""
    parts = name.split(".")
    value: Any = shardwise
    for depth, part in enumerate(parts, 1):
        try:
            value = getattr(value, part)
        except (AttributeError, ImportError) as err:
            if depth == len(parts) and isinstance(value, type) and _class_declares(value, part):
                return None  # an instance attribute its class declares
            return f"shardwise.{'.'.join(parts[:depth])}: {type(err).__name__}: {err}"
    return None


def rejected(documented: DocumentedKey) -> str | None:
    """Why one of the key's documented values fails validation, or None when all pass."""
    for value in documented.values:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                validate({**documented.context, documented.key: value}, CLUSTER)
        except ConfigError as err:
            return f"{documented.key}={value!r}: {err}"
    return None


def _implementation_problems() -> dict[tuple[str, str], str | None]:
    """(kind, entry) → why it is not implemented, or None."""
    found: dict[tuple[str, str], str | None] = {("name", name): unresolved(name) for name in documented_names()}
    found.update({("key", documented.key): rejected(documented) for documented in documented_keys()})
    return found


def _still_missing() -> int:
    return sum(row.status == MISSING for row in table_rows())


def test_data_files_name_their_source_and_hold_each_entry_once():
    for path, entries in ((NAMES_FILE, documented_names()), (KEYS_FILE, [k.key for k in documented_keys()])):
        header = "".join(line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#"))
        assert SOURCE_COMMIT in header and "aws/sagemaker-python-sdk" in header, path.name
        duplicates = sorted({entry for entry in entries if entries.count(entry) > 1})
        assert not duplicates, f"{path.name} lists these more than once: {duplicates}"
    assert (len(documented_names()), len(documented_keys())) == (110, 26)
    assert not [k.key for k in documented_keys() if not k.values], "every key needs at least one value to validate"


def test_table_rows_are_well_formed():
    problems = []
    seen: set[tuple[str, str]] = set()
    for row in table_rows():
        if row.status not in STATUSES:
            problems.append(f"line {row.line}: {row.entry}: status {row.status!r} is not one of {STATUSES}")
        if row.status in ("works differently", ACCEPTED) and not row.how:
            problems.append(f"line {row.line}: {row.entry}: status {row.status!r} needs a how / why")
        if (row.kind, row.entry) in seen:
            problems.append(f"line {row.line}: {row.entry}: a second row for the same {row.kind}")
        seen.add((row.kind, row.entry))
    assert not problems, "docs/smp_v1.md's tables:\n" + "\n".join(problems)


def test_every_table_row_names_a_documented_entry():
    documented = {"name": set(documented_names()), "key": {k.key for k in documented_keys()}}
    stale = [f"line {row.line}: {row.kind} {row.entry}" for row in table_rows() if row.entry not in documented[row.kind]]
    assert not stale, "rows for entries SMP v1 does not document:\n" + "\n".join(stale)


def test_every_documented_entry_has_a_row():
    absent = [f"name {name}" for name in documented_names() if name not in _rows_of("name")]
    absent += [f"key {k.key}" for k in documented_keys() if k.key not in _rows_of("key")]
    assert not absent, "docs/smp_v1.md has no row for:\n" + "\n".join(absent)


def test_rows_that_say_shardwise_takes_an_entry_are_true():
    """`works`, `works differently` and `accepted without effect` all say a script may use the entry: it must
    resolve (a name) or validate (a key)."""
    problems = _implementation_problems()
    false = [f"line {row.line}: {row.kind} {row.entry} ({row.status}): {problems[(row.kind, row.entry)]}"
             for row in table_rows()
             if row.status in STATUSES[:3] and problems.get((row.kind, row.entry)) is not None]
    assert not false, "docs/smp_v1.md claims these work, but:\n" + "\n".join(false)


@pytest.mark.xfail(condition=_still_missing() > 0, strict=False,
                   reason=f"{_still_missing()} documented SMP v1 entries are not implemented yet "
                          "(status `missing` in docs/smp_v1.md)")
def test_every_documented_entry_is_covered():
    """Each entry is implemented (resolves / validates) or accepted without effect, and no row says `missing`."""
    rows = {(row.kind, row.entry): row for row in table_rows()}
    uncovered = []
    for (kind, entry), problem in _implementation_problems().items():
        row = rows.get((kind, entry))
        marked_missing = row is not None and row.status == MISSING
        if marked_missing or (problem is not None and (row is None or row.status != ACCEPTED)):
            why = [problem or "resolves, but the row says missing", row.how if marked_missing else ""]
            uncovered.append(f"{kind} {entry}: " + "; ".join(text for text in why if text))
    assert not uncovered, f"{len(uncovered)} documented SMP v1 entries are not covered:\n" + "\n".join(uncovered)


def test_smp_import_paths_are_the_front_ends_modules():
    """`from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import ...` with only the package changed gets
    the SMP front end's own module (one object under both names, so registrations and isinstance agree)."""
    import importlib

    for path in ("nn", "nn.huggingface.gpt2", "nn.huggingface.gptj", "amp", "utils", "patches.checkpoint"):
        assert importlib.import_module(f"shardwise.{path}") is importlib.import_module(f"shardwise.smp.{path}")
    assert shardwise.nn.FusedLayerNorm is importlib.import_module("shardwise.smp.nn").FusedLayerNorm
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("shardwise.nn.no_such_module")
