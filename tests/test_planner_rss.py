"""The planner's per-rank total against the resident memory (RSS) a CPU rank really reaches.

One fresh 4-rank gloo run of bench/memory_overhead.py (a small GPT-2 under ZeRO-3, delayed
initialisation, AdamW, one step plus one under MemTracker): the highest RSS any rank reached
must lie within 20 % of the planner's total, which counts the process before the model and
what glibc malloc keeps after frees (docs/benchmarks.md, "The largest model per layout").
The tensors alone fall well short of it: the RSS terms are what closes the gap.
"""

import sys
from pathlib import Path

import pytest

from shardwise.planner import assumptions as A

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from largest_model import Cell  # noqa: E402
from memory_overhead import measure  # noqa: E402

TOLERANCE = 0.20


@pytest.fixture(scope="module")
def zero3_run() -> dict:
    return measure("ZeRO-3", Cell(2, 256), "default", steps=1, seq=64, timeout=300)


def test_planner_total_is_within_tolerance_of_the_measured_rss_peak(zero3_run):
    assert zero3_run["planner_total"] == pytest.approx(zero3_run["peak"], rel=TOLERANCE)
    tensors_only = zero3_run["planner_total"] - zero3_run["planner"]["runtime"] - zero3_run["planner"]["retention"]
    assert tensors_only < (1 - TOLERANCE) * zero3_run["peak"]


def test_the_process_before_the_model_is_the_planners_reserve(zero3_run):
    assert zero3_run["before_model"] == pytest.approx(A.HOST_PROCESS_BYTES, rel=0.15)
