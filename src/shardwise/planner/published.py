"""The planner held against published, measured training runs: each run's mapping to a shardwise config, its
prediction, and the comparison (error per run, mean absolute error, rank correlation of MFU, fits).

A run is a plain dict (tests/planner_published_runs.yaml holds them, each with its source): the model as a
Hugging Face config, the cluster as a preset with overrides, the shardwise config that expresses the run's
layout, its checkpointing, global batch and sequence, and what was measured — tokens/s per device, or
TFLOP/s per device with the convention its authors counted FLOPs in, turned into tokens/s here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from .families import spec_from_hf
from .hardware import GB, GiB, ClusterSpec, cluster_preset
from .search import Evaluation, evaluate
from .spec import ModelSpec
from .statistics import spearman

# Cluster values a run may set beside its preset, in the units the data file writes them.
_CLUSTER_UNITS = {"nodes": 1, "devices_per_node": 1, "device_memory_gib": GiB, "device_memory_bandwidth_gbs": GB,
                  "intra_node_gbs": GB, "inter_node_gbs": GB, "power_limit_watts": 1, "clock_mhz": 1}
_CLUSTER_KEYS = {"device_memory_gib": "device_memory_bytes", "device_memory_bandwidth_gbs": "memory_bandwidth",
                 "intra_node_gbs": "intra_node_bandwidth", "inter_node_gbs": "inter_node_bandwidth"}
# The run's kernels (hardware.Kernels), as its source states them.
_KERNEL_KEYS = ("flash_attention", "fused_rmsnorm", "fused_cross_entropy", "triton_flash_attention", "complex_rotary",
                "repeated_kv_copies")


def megatron_flops_per_token(spec: ModelSpec, seq: int) -> float:
    """FLOPs per token as Narayanan et al. (2021, eq. 3) count them for a GPT with full recompute:
    96·l·h²·(1 + s/6h + V/16lh) per token, four passes through the blocks and three through the head."""
    l, h = spec.layers, spec.hidden
    return 96 * l * h * h * (1 + seq / (6 * h) + spec.vocab / (16 * l * h))


def megatron_core_flops_per_token(spec: ModelSpec, seq: int) -> float:
    """FLOPs per token as Megatron-LM counts them since 2024 (`num_floating_point_operations` in
    megatron/training/training.py): model FLOPs without recompute, attention over the whole sequence, the logits
    once, 12·l·h²·((1 + g/a + s/h)·q + f/h·(3/2 if gated) + V/2lh) with g key/value heads of a, q the query width
    over h, f the MLP width."""
    l, h = spec.layers, spec.hidden
    query = spec.heads * (h // spec.heads) / h
    attention = (1 + spec.kv_heads / spec.heads + seq / h) * query
    mlp = spec.ffn / h * (1.5 if spec.gated_mlp else 1.0)
    return 12 * l * h * h * (attention + mlp + spec.vocab / (2 * l * h))


_CONVENTIONS = {"megatron": megatron_flops_per_token, "megatron-core": megatron_core_flops_per_token,
                "6N+12lhs": lambda spec, seq: spec.flops_per_token(seq)}


@dataclass(frozen=True)
class Comparison:
    """One run: what was measured, what the planner predicts for its mapping, and whether it fits."""

    name: str
    measured_tokens_per_s: float    # per device
    predicted_tokens_per_s: float   # per device
    measured_mfu: float
    predicted_mfu: float
    fits: bool
    trained: bool
    evaluation: Evaluation

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted − measured) / measured."""
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1


def run_cluster(run: Mapping[str, Any]) -> ClusterSpec:
    """The run's cluster: its preset with the values it overrides, and its device's kernels as the run had them."""
    given = dict(run["cluster"])
    preset = given.pop("preset")
    unknown = set(given) - set(_CLUSTER_UNITS) - set(_KERNEL_KEYS)
    if unknown:
        raise ValueError(f"run {run['name']!r}: unknown cluster keys {sorted(unknown)}; use "
                         f"{sorted([*_CLUSTER_UNITS, *_KERNEL_KEYS])}")
    kernels = {k: given.pop(k) for k in _KERNEL_KEYS if k in given}
    overrides = {_CLUSTER_KEYS.get(k, k): v * _CLUSTER_UNITS[k] for k, v in given.items()}
    bandwidth = overrides.pop("memory_bandwidth", None)
    cluster = cluster_preset(preset, **overrides)
    device = cluster.device
    if bandwidth is not None:
        device = replace(device, memory_bandwidth=bandwidth)
    if kernels:
        device = replace(device, kernels=replace(device.kernels, **kernels))
    return replace(cluster, device=device)


def compare(run: Mapping[str, Any]) -> Comparison:
    """Predict one published run through `evaluate` and set it beside its measurement."""
    spec = spec_from_hf(run["model"], run["name"])
    cluster = run_cluster(run)
    seq = run["seq"]
    e = evaluate(spec, cluster, run["config"], global_batch=run["global_batch"], seq=seq,
                 checkpointing=run.get("checkpointing", "none"))
    measured = run["measured"]
    if "tokens_per_s_per_device" in measured:
        tokens = measured["tokens_per_s_per_device"]
    else:
        tokens = measured["tflops_per_device"] * 1e12 / _CONVENTIONS[measured["convention"]](spec, seq)
    dtype = "bf16" if e.config.get("bf16") else "fp16" if e.config.get("fp16") else "fp32"
    peak = cluster.device.peak_flops[dtype]
    flops = spec.flops_per_token(seq)
    predicted = e.time.tokens_per_s / cluster.world_size if e.time else 0.0
    return Comparison(run["name"], tokens, predicted, tokens * flops / peak, predicted * flops / peak, e.fits,
                      bool(run.get("trained", True)), e)


@dataclass(frozen=True)
class Summary:
    comparisons: tuple[Comparison, ...]

    @property
    def mean_absolute_error(self) -> float:
        return sum(abs(c.error) for c in self.comparisons) / len(self.comparisons)

    @property
    def mfu_rank_correlation(self) -> float:
        rho = spearman([c.measured_mfu for c in self.comparisons], [c.predicted_mfu for c in self.comparisons])
        return 0.0 if rho is None else rho

    def within(self, bound: float) -> int:
        return sum(abs(c.error) <= bound for c in self.comparisons)

    @property
    def trained_but_predicted_not_to_fit(self) -> list[str]:
        return [c.name for c in self.comparisons if c.trained and not c.fits]

    def table(self) -> str:
        """A markdown table, one row per run, and the summary line."""
        rows = ["| run | measured tokens/s/device | predicted | error | measured MFU | predicted MFU "
                "| fits (per rank) |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for c in self.comparisons:
            rows.append(f"| {c.name} | {c.measured_tokens_per_s:,.0f} | {c.predicted_tokens_per_s:,.0f} | "
                        f"{c.error:+.0%} | {c.measured_mfu:.1%} | {c.predicted_mfu:.1%} | "
                        f"{_fits(c)} |")
        rows.append(f"\n{len(self.comparisons)} runs: {self.within(0.15)} within ±15 %, {self.within(0.25)} within "
                    f"±25 %; mean absolute error {self.mean_absolute_error:.1%}; Spearman ρ on MFU "
                    f"{self.mfu_rank_correlation:.2f}; trained runs predicted not to fit: "
                    f"{len(self.trained_but_predicted_not_to_fit)}")
        return "\n".join(rows)


def _fits(c: Comparison) -> str:
    memory = c.evaluation.memory
    shown = f"{memory.total / GiB:.1f} GiB" if memory else "-"
    return f"yes ({shown})" if c.fits else f"**no** ({shown})"


def summarize(runs: Sequence[Mapping[str, Any]]) -> Summary:
    return Summary(tuple(compare(run) for run in runs))
