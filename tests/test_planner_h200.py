"""The memory planner against the CUDA tier's measurements on an H200, kept so every CPU run holds it to them.

tests/planner_h200_measured.json records what tests/test_cuda_planner.py measured
on one H200 (the second AdamW step of its GPT-2 and Llama at five layouts, each in a
process of its own): MemTracker's categories and the caching allocator's peak, less
what the allocator held for no tensor (cuBLAS's workspaces, in the planner's runtime
reserve). The same tolerances as on the device: model states ±10 %, activations
±25 %, the tensors' peak at most the predicted tensor total and within 25 % of it,
reserved bytes under the predicted total. A case the planner misses is listed
with its measured error, strictly, so a fix shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.config import parse_config
from shardwise.config.layout import layout_for
from shardwise.planner import predict_memory, spec_from_hf
from shardwise.topology import Cluster
from test_cuda_planner import BATCH, GPU, LAYOUTS, MISSED, MODELS, SEQ

MEASURED = json.loads((Path(__file__).parent / "planner_h200_measured.json").read_text())["cases"]
MIB = 2 ** 20


def _predicted(case: str):
    family, name = case.split(" ", 1)
    config = parse_config(LAYOUTS[name])
    return predict_memory(spec_from_hf(MODELS[family][1].to_dict(), family), config,
                          layout_for(config, Cluster(1, 1)), BATCH, SEQ, device=GPU)


def test_every_case_of_the_cuda_tier_was_measured():
    assert set(MEASURED) == {f"{family} {name}" for family in MODELS for name in LAYOUTS}


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_the_planner_matches_the_h200(case):
    measured, predicted = MEASURED[case], _predicted(case)
    categories = measured["memtracker_mib"]
    detail = predicted.detail()
    for category in ("parameters", "gradients", "optimizer"):
        assert detail[category] / MIB == pytest.approx(categories[category], rel=0.10, abs=0.1), category
    assert detail["activations"] / MIB == pytest.approx(categories["activations"], rel=0.25)
    tensors = measured["allocated_mib"] - measured["untracked_mib"]
    assert measured["reserved_mib"] <= predicted.total / MIB
    within = tensors <= predicted.tensors / MIB <= 1.25 * tensors
    assert within != (case in MISSED), f"{case}: {predicted.tensors / MIB:,.1f} predicted, {tensors:,.1f} MiB measured"
