"""Cluster files: a preset with some of its values replaced by what was measured on the cluster (`shardwise tune
--calibrate` writes one), read back wherever `--cluster` takes a preset.

    {"cluster_file": 1, "preset": "local", "nodes": 1, "devices_per_node": 4,
     "values": {"peak_flops": {"fp32": 1.2e9, "bf16": 1.2e9}, "memory_bandwidth": 3e9, "intra_node_bandwidth": 2e8,
                "intra_node_latency": 4e-4},
     "calibration": {...}}

`values` are absolute (per device or per link, in the units ClusterSpec keeps); `peak_flops` is the rate per
precision (or one rate for all) to which the time model applies its own achievable share. Anything
else in the file (`calibration`: how the values were fitted) is for people and is not read.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import PlanError
from .hardware import ClusterSpec, cluster_preset

FORMAT = 1
# Values a cluster file may set: those of the device, then those of the cluster.
DEVICE_VALUES = ("peak_flops", "memory_bandwidth")
CLUSTER_VALUES = ("intra_node_bandwidth", "intra_node_latency", "inter_node_bandwidth", "inter_node_latency",
                  "link_efficiency", "critical_op_seconds")


def is_cluster_file(text: str) -> bool:
    """Whether `--cluster` names a file rather than a preset."""
    return text.endswith(".json") or Path(text).is_file()


def with_values(cluster: ClusterSpec, values: Mapping[str, Any]) -> ClusterSpec:
    """`cluster` with `values` (names of DEVICE_VALUES and CLUSTER_VALUES) replaced; `peak_flops` is one rate
    for every precision the device has, or a rate for each precision it names."""
    unknown = sorted(set(values) - set(DEVICE_VALUES) - set(CLUSTER_VALUES))
    if unknown:
        raise PlanError(f"cluster file value {unknown[0]!r} is not one a cluster file sets; use "
                        + ", ".join(DEVICE_VALUES + CLUSTER_VALUES))
    device = cluster.device
    if "peak_flops" in values:
        peak = values["peak_flops"]
        rates = peak if isinstance(peak, Mapping) else dict.fromkeys(device.peak_flops, peak)
        device = replace(device, peak_flops={**device.peak_flops, **{k: float(v) for k, v in rates.items()}})
    if "memory_bandwidth" in values:
        device = replace(device, memory_bandwidth=float(values["memory_bandwidth"]))
    return replace(cluster, device=device, **{k: float(v) for k, v in values.items() if k in CLUSTER_VALUES})


def read_cluster_file(path: str, **overrides: Any) -> ClusterSpec:
    """The cluster a file describes; `overrides` (as cluster_preset takes them; None keeps) win over its values."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PlanError(f"cluster file {path}: {err}; give a file `shardwise tune --calibrate` wrote, or a preset")
    if not isinstance(data, dict) or data.get("cluster_file") != FORMAT or "preset" not in data:
        raise PlanError(f"cluster file {path}: not a cluster file (no \"cluster_file\": {FORMAT} and \"preset\"); "
                        "give a file `shardwise tune --calibrate` wrote, or a preset")
    given = {k: v for k, v in overrides.items() if v is not None}
    shape = {"nodes": given.pop("nodes", data.get("nodes")),
             "devices_per_node": given.pop("devices_per_node", data.get("devices_per_node"))}
    values = {k: v for k, v in data.get("values", {}).items() if k not in given}
    if given.keys() & {"clock_mhz", "power_limit_watts"}:  # they scale the preset's peak, not the fitted one
        values.pop("peak_flops", None)
    return with_values(cluster_preset(data["preset"], **shape, **given), values)


def resolve_cluster(text: str, **overrides: Any) -> ClusterSpec:
    """`--cluster`'s value: a cluster file's path, or `[N x]PRESET` (hardware.cluster_preset)."""
    return read_cluster_file(text, **overrides) if is_cluster_file(text) else cluster_preset(text, **overrides)


def write_cluster_file(path: Path, preset: str, cluster: ClusterSpec, values: Mapping[str, Any],
                       calibration: Optional[Mapping[str, Any]] = None) -> Path:
    """Write `values` over `preset` for `cluster`'s shape (and how they were found, `calibration`)."""
    data = {"cluster_file": FORMAT, "preset": preset, "nodes": cluster.nodes,
            "devices_per_node": cluster.devices_per_node, "values": dict(values),
            "calibration": dict(calibration or {})}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path
