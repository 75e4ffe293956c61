"""The module-graph pipeline cut in bf16: the same math as the same precision without a pipeline.

torch.export bakes the dtypes it sees into the captured graph, so the stages are captured in the dtype they
compute in (the parameters FSDP2's policy casts, or ZeRO-1 stores, in bf16). As in test_pipeline_features.py,
mixed precision has no fp32 reference at 1e-5: each run is held to a run without a pipeline in the same
precision and data-parallel mode (the same losses, parameters within the rounding of bf16 gradients).
"""

from __future__ import annotations

import pytest

from test_pipeline import PP2, assert_piped_trains_as_flat

MODES = {  # name: (data-parallel mode on both sides, kinds)
    "cast-zero2": ({"zero_stage": 2, "sharded_data_parallel_degree": 2}, ("cnn", "gpt2")),
    "stored-zero1": ({"shard_optimizer_state": True}, ("llama",)),
}


@pytest.mark.parametrize("mode", MODES)
def test_bf16_matches_bf16_without_a_pipeline(mode):
    extra, kinds = MODES[mode]
    common = {"bf16": True, "microbatches": 2, **extra}
    for per_kind, plain in assert_piped_trains_as_flat({**PP2, "pipeline_cut": "graph", **common}, common, kinds=kinds):
        stored = {name: t.dtype for name, t in plain["state"].items()}  # ZeRO-1 keeps bf16, its masters fp32
        assert all({name: t.dtype for name, t in r["state"].items()} == stored for r in per_kind)
