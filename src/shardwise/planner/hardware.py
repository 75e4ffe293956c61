"""Cluster specs: what a device can hold and compute, and how fast its links are.

Presets carry vendor data-sheet figures (nominal, per direction); the fraction of
them a training step achieves is an assumption of the time model (`timing.py`),
stated in docs/planner.md. `16xp4d.24xlarge` means 16 nodes of that instance type.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from ..topology import Cluster
from . import assumptions as A
from .errors import PlanError, unknown

GiB = 1024 ** 3
GB = 1e9


@dataclass(frozen=True)
class Kernels:
    """Kernel facts that change what the backward pass keeps.

    GPUs keep dropout masks as bool (1 byte) and run flash attention with dropout;
    PyTorch's CPU kernels keep masks in the activation dtype and fall back to the
    math attention path (which keeps the s × s probabilities) when attention dropout
    is on, and that path computes bf16/fp16 inputs in fp32.
    """

    dropout_mask_bytes: Optional[int] = 1   # None: same as the activation dtype
    flash_attention: bool = True
    flash_attention_dropout: bool = True
    math_attention_bytes: int = 0           # least bytes per element the math attention path keeps
    # An RMSNorm kernel that keeps its input and rstd only (torchtitan's Triton `fused_rmsnorm`, apex's
    # FusedRMSNorm), not the normalised product Hugging Face's RMSNorm also keeps.
    fused_rmsnorm: bool = False
    # A fused cross-entropy kernel (flash-attn's `losses.cross_entropy`, llm-foundry's default `loss_fn`) keeps the
    # logits as the head produced them and one fp32 log-sum-exp per token, no fp32 log-softmax.
    fused_cross_entropy: bool = False
    # The FlashAttention repository's Triton kernel (flash_attn_triton.py, Triton 2.0 before its MLIR backend), which
    # llm-foundry's `attn_impl: triton` runs: flash attention's memory, at FlashAttention-2's rate over
    # assumptions.TRITON_FLASH_ATTENTION_SLOWDOWN.
    triton_flash_attention: bool = False
    # Rotary embedding as products of complex fp32 numbers (torchtitan's `apply_rotary_emb`: upcast, multiply, cast
    # back), where Hugging Face's `rotate_half` negates and concatenates halves (planner/eager_ops.py).
    complex_rotary: bool = False
    # Key and value heads copied out for each query head before attention (torchtitan's `repeat_kv`), where Hugging
    # Face's SDPA path passes grouped heads to the kernel (`enable_gqa`).
    repeated_kv_copies: bool = False


@dataclass(frozen=True)
class KernelRates:
    """Shares of a device's peak FLOP/s its kernels sustain, measured by microbenchmarks (efficiency.py).

    `matmul`: the best large GEMM (the "maximum achievable matmul FLOPS", MAMF); `attention`: the fused flash
    kernel forward and backward, causal, head dim 128, in its authors' FLOP accounting; `memory`: the share
    of the memory bandwidth a streaming (elementwise) kernel reaches.
    """

    matmul: float
    attention: float
    sms: int                  # streaming multiprocessors: the tiles of one wave
    memory: float = A.STREAMING_EFFICIENCY


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: Mapping[str, float]      # per dtype name: fp32, bf16, fp16
    memory_bandwidth: float              # bytes/s, for the optimizer step
    host_bandwidth: float                # bytes/s to host memory, for activation offload
    runtime_reserve_bytes: float = 0.0   # CUDA context, library workspaces (a CPU: the process): never for tensors
    kernels: Kernels = field(default_factory=Kernels)
    memory_is_host: bool = False         # a CPU: offloading to host memory moves nothing and saves nothing
    fixed_mmap_threshold: bool = False   # a CPU whose ranks run with MALLOC_MMAP_THRESHOLD_ set: glibc keeps no freed
                                         # large blocks (planner.md; off by default, it costs step time)
    rates: Optional[KernelRates] = None  # kernel by kernel (efficiency.py); None: one achievable share of peak
    peak_clock_mhz: Optional[float] = None    # the clock the data sheet's peak is computed at
    tdp_watts: Optional[float] = None         # the board power the data sheet's peak assumes
    clock_fraction: float = 1.0               # sustained clock / peak_clock_mhz (a capped or down-clocked part)

    def supports(self, dtype: str) -> bool:
        return dtype in self.peak_flops

    def sustained_flops(self, dtype: str) -> float:
        """Peak FLOP/s at the clock the part runs at (MFU stays against the data sheet's peak, as published)."""
        return self.peak_flops[dtype] * self.clock_fraction

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel moves."""
        return self.memory_bandwidth * (self.rates.memory if self.rates else 1.0)

    def clocked(self, clock_mhz: Optional[float] = None, power_limit_watts: Optional[float] = None) -> "DeviceSpec":
        """This device at a sustained clock, or under a board power limit: dynamic power goes as f·V² and the
        voltage with the clock, so the clock as the cube root of the power (first order; memory bandwidth,
        clocked apart, stays)."""
        fraction = self.clock_fraction
        if clock_mhz is not None:
            if not self.peak_clock_mhz:
                raise PlanError(f"{self.name} has no clock its peak is computed at; give --peak-tflops instead")
            fraction = min(1.0, clock_mhz / self.peak_clock_mhz)
        if power_limit_watts is not None:
            if not self.tdp_watts:
                raise PlanError(f"{self.name} has no rated board power to scale from; give --peak-tflops instead")
            fraction = min(fraction, (min(power_limit_watts, self.tdp_watts) / self.tdp_watts) ** (1 / 3))
        return replace(self, clock_fraction=fraction)


@dataclass(frozen=True)
class ClusterSpec:
    """`nodes` × `devices_per_node` devices and the two link levels between them."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node_bandwidth: float   # bytes/s per device, per direction (NVLink, PCIe)
    intra_node_latency: float     # seconds per collective step inside a node
    inter_node_bandwidth: float   # bytes/s per node, per direction (all NICs together)
    inter_node_latency: float     # seconds per collective step between nodes
    flat_rings: bool = False      # gloo: one ring over a group's ranks, reduce-scatter as a whole all-reduce
    link_efficiency: float = A.LINK_EFFICIENCY  # share of a link's bandwidth a collective's bytes get
    # Host seconds each communication op a rank waits on before it computes on (tensor- and context-parallel
    # collectives, expert all-to-alls, pipeline sends and receives) costs beyond its link time: its dispatch, and on
    # CPU ranks gloo's copies and the wake-up of a rank that shares its core. The presets charge none (an
    # accelerator's host issues its ops ahead of the device); calibration fits it from the trials (tune/calibrate.py).
    critical_op_seconds: float = 0.0

    @property
    def topology(self) -> Cluster:
        return Cluster(nodes=self.nodes, devices_per_node=self.devices_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def default_precision(self) -> str:
        """The fastest precision the device has: a low precision only where it beats fp32
        (tensor cores), bf16 before fp16 when both do. CPUs therefore plan in fp32."""
        flops = self.device.peak_flops
        faster = [d for d in ("bf16", "fp16") if flops.get(d, 0) > flops["fp32"]]
        return max(faster, key=lambda d: flops[d]) if faster else "fp32"


# Kernel rates (docs/planner.md, "Assumptions"): matmul, the MAMF table of Bekman's ml-engineering
# (compute/accelerator/README.md: A100 SXM 267.9 of 312 TFLOP/s, H100 SXM 792.1 of 989, bf16, CUDA 12.1);
# attention, FlashAttention-2 (Dao, 2023, arXiv:2307.08691, section 4.1: forward + backward, causal, head dim
# 128, long sequences: about 200 TFLOP/s on A100 80GB SXM4 and 335 on H100 SXM5).
# SMs: the data sheets' 108 (A100) and 132 (H100 SXM5). Clocks: the ones the data sheets' peaks are computed at,
# 1410 MHz (A100) and 1830 MHz (H100 SXM5: 132 SMs x 4 tensor cores x 1024 FLOPs a clock = 989.4 TFLOP/s; the
# 1980 MHz once widely published would give 1070; ml-engineering compute/accelerator/README.md).
A100_RATES = KernelRates(matmul=267.9 / 312, attention=200 / 312, sms=108)
H100_RATES = KernelRates(matmul=792.1 / 989, attention=335 / 989, sms=132)
A100_40GB = DeviceSpec("A100-SXM4-40GB", 40 * GiB, {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
                       1555 * GB, 25 * GB, runtime_reserve_bytes=1 * GiB, rates=A100_RATES, peak_clock_mhz=1410,
                       tdp_watts=400)
A100_80GB = replace(A100_40GB, name="A100-SXM4-80GB", memory_bytes=80 * GiB, memory_bandwidth=2039 * GB)
H100_80GB = DeviceSpec("H100-SXM5-80GB", 80 * GiB, {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12},
                       3350 * GB, 50 * GB, runtime_reserve_bytes=1 * GiB, rates=H100_RATES, peak_clock_mhz=1830,
                       tdp_watts=700)
DEVICES = {d.name: d for d in (A100_40GB, A100_80GB, H100_80GB)}
T4_16GB = DeviceSpec("T4-16GB", 15 * GiB, {"fp32": 8.1e12, "fp16": 65e12}, 320 * GB, 12 * GB,
                     runtime_reserve_bytes=0.5 * GiB)
A10G_24GB = DeviceSpec("A10G-24GB", 22 * GiB, {"fp32": 31.2e12, "bf16": 125e12, "fp16": 125e12},
                       600 * GB, 25 * GB, runtime_reserve_bytes=0.5 * GiB)

_NODES: dict[str, dict] = {
    "p4d.24xlarge": dict(devices_per_node=8, device=A100_40GB, intra_node_bandwidth=300 * GB,
                         intra_node_latency=5e-6, inter_node_bandwidth=50 * GB, inter_node_latency=15e-6),
    "p4de.24xlarge": dict(devices_per_node=8, device=A100_80GB, intra_node_bandwidth=300 * GB,
                          intra_node_latency=5e-6, inter_node_bandwidth=50 * GB, inter_node_latency=15e-6),
    "p5.48xlarge": dict(devices_per_node=8, device=H100_80GB, intra_node_bandwidth=450 * GB,
                        intra_node_latency=5e-6, inter_node_bandwidth=400 * GB, inter_node_latency=15e-6),
    "dgx-h100": dict(devices_per_node=8, device=H100_80GB, intra_node_bandwidth=450 * GB,
                     intra_node_latency=5e-6, inter_node_bandwidth=400 * GB, inter_node_latency=5e-6),
    "g4dn.12xlarge": dict(devices_per_node=4, device=T4_16GB, intra_node_bandwidth=12 * GB,
                          intra_node_latency=10e-6, inter_node_bandwidth=6.25 * GB, inter_node_latency=30e-6),
    "g5.48xlarge": dict(devices_per_node=8, device=A10G_24GB, intra_node_bandwidth=25 * GB,
                        intra_node_latency=10e-6, inter_node_bandwidth=12.5 * GB, inter_node_latency=30e-6),
}
# Single-core CPU throughput (AVX2 FMA at ~3 GHz, sustained) and DRAM bandwidth are rough;
# the local preset exists to plan test runs, not to predict their speed.
_CPU_CORE_FLOPS = 50e9


def local_node(processes: Optional[int] = None) -> dict:
    """This machine as one node of `processes` CPU ranks (default: one per core), memory split evenly, its
    collectives gloo's; each rank's process reserves what it holds before its model."""
    processes = processes or os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = DeviceSpec("CPU", ram / processes, {"fp32": _CPU_CORE_FLOPS, "bf16": _CPU_CORE_FLOPS},
                     20 * GB / processes, 20 * GB / processes, runtime_reserve_bytes=A.HOST_PROCESS_BYTES,
                     kernels=Kernels(dropout_mask_bytes=None, flash_attention=True, flash_attention_dropout=False,
                                     math_attention_bytes=4), memory_is_host=True)
    return dict(devices_per_node=processes, device=cpu, intra_node_bandwidth=5 * GB,
                intra_node_latency=50e-6, inter_node_bandwidth=1.25 * GB, inter_node_latency=100e-6, flat_rings=True,
                link_efficiency=A.TCP_LINK_EFFICIENCY)


PRESETS = sorted([*_NODES, "local"])
_FORM = re.compile(r"^(?:(\d+)\s*[x×]\s*)?([A-Za-z0-9.\-]+)$")


def cluster_preset(text: str, **overrides) -> ClusterSpec:
    """Parse `[N x]preset` (e.g. `16xp4d.24xlarge`, `p5.48xlarge`, `local`) into a ClusterSpec.

    `overrides` replace any field (nodes, devices_per_node, bandwidths, ...); None means keep.
    `device_memory_bytes` replaces the device's memory, `peak_flops` its peak for every precision it has,
    `fixed_mmap_threshold` says whether CPU ranks run with a fixed glibc mmap threshold.
    """
    match = _FORM.match(text.strip())
    name = match.group(2).removeprefix("ml.") if match else text
    if not match or name not in PRESETS:
        raise unknown("cluster preset", name, PRESETS,
                      "write [NODES x]PRESET, e.g. 16xp4d.24xlarge; presets: " + ", ".join(PRESETS))
    nodes = overrides.pop("nodes", None) or int(match.group(1) or 1)
    if nodes < 1:
        raise PlanError(f"cluster {text!r}: the node count must be 1 or more")
    node = local_node(overrides.pop("devices_per_node", None)) if name == "local" else dict(_NODES[name])
    device = _device_overrides(node.pop("device"), overrides)
    fields = {**node, **{k: v for k, v in overrides.items() if v is not None}, "nodes": nodes}
    return ClusterSpec(name=f"{fields['nodes']}x{name}", device=device, **fields)


def _device_overrides(device: DeviceSpec, overrides: dict) -> DeviceSpec:
    memory = overrides.pop("device_memory_bytes", None)
    flops = overrides.pop("peak_flops", None)
    device = device.clocked(overrides.pop("clock_mhz", None), overrides.pop("power_limit_watts", None))
    fixed_mmap_threshold = overrides.pop("fixed_mmap_threshold", None)
    if memory is not None:
        device = replace(device, memory_bytes=memory)
    if flops is not None:
        device = replace(device, peak_flops={dtype: flops for dtype in device.peak_flops})
    if fixed_mmap_threshold is not None:
        device = replace(device, fixed_mmap_threshold=fixed_mmap_threshold)
    return device


# What a custom cluster assumes for the values its flags do not give.
CUSTOM_DEFAULTS = dict(memory_bandwidth=1500 * GB, host_bandwidth=25 * GB, intra_node_latency=5e-6,
                       inter_node_latency=15e-6)


def custom_cluster(*, nodes: int, devices_per_node: int, device_memory_bytes: float, peak_flops: float,
                   intra_node_bandwidth: float, inter_node_bandwidth: float,
                   intra_node_latency: Optional[float] = None,
                   inter_node_latency: Optional[float] = None,
                   link_efficiency: Optional[float] = None) -> ClusterSpec:
    """A cluster described value by value; `peak_flops` applies to every precision."""
    defaults = CUSTOM_DEFAULTS
    device = DeviceSpec("custom device", device_memory_bytes, {d: peak_flops for d in ("fp32", "bf16", "fp16")},
                        defaults["memory_bandwidth"], defaults["host_bandwidth"])
    return ClusterSpec(name=f"{nodes}xcustom", nodes=nodes, devices_per_node=devices_per_node, device=device,
                       intra_node_bandwidth=intra_node_bandwidth,
                       intra_node_latency=intra_node_latency or defaults["intra_node_latency"],
                       inter_node_bandwidth=inter_node_bandwidth,
                       inter_node_latency=inter_node_latency or defaults["inter_node_latency"],
                       link_efficiency=link_efficiency or A.LINK_EFFICIENCY)
