"""Every number the planner assumes rather than derives, in one place (docs/planner.md explains each)."""

# Fraction of a device's peak FLOP/s that transformer training kernels sustain
# (large GEMMs reach 60-80 %; norms, softmax, elementwise ops and launches pull the step to ~50 %).
# Devices with a kernel table (hardware.KernelRates) are modelled kernel by kernel instead (efficiency.py).
ACHIEVABLE_FLOPS_FRACTION = 0.5

# Share of the memory bandwidth a streaming (elementwise) kernel reaches: a device-to-device copy or a
# read-read-write kernel measures 90-91 % of the data sheet's HBM bandwidth on Hopper parts.
STREAMING_EFFICIENCY = 0.9

# How much slower the FlashAttention repository's Triton kernel (flash_attn_triton.py) runs than FlashAttention-2:
# Dao (2023, arXiv:2307.08691, section 4.1) measures FlashAttention-2 "1.3-2.5x faster than FlashAttention in
# Triton" over its sequence lengths and head dimensions; the geometric mean of that range.
TRITON_FLASH_ATTENTION_SLOWDOWN = (1.3 * 2.5) ** 0.5

# Fraction of a link's nominal per-direction bandwidth a collective achieves (NCCL bus bandwidth
# on NVLink/EFA/InfiniBand measures 75-85 % of nominal). A cluster may give its own (ClusterSpec.link_efficiency).
LINK_EFFICIENCY = 0.8

# gloo's collectives are TCP streams: a saturated stream carries its payload at the line rate less the
# frames' headers (1448 payload bytes per 1514-byte Ethernet frame at MTU 1500, 0.956). bench/link.py's
# shaped link measured this (docs/benchmarks.md); 0.8 predicted every configuration 6-30 % slow there.
TCP_LINK_EFFICIENCY = 0.95

# While a collective overlaps compute, both slow each other (shared SMs and memory bandwidth):
# this fraction of the overlapped interval is hidden, the rest is paid twice.
OVERLAP_EFFICIENCY = 0.8

# Allocator fragmentation and transient tensors not modelled one by one, as a share of the
# bytes the model accounts for.
FRAGMENTATION_MARGIN = 0.10

# A CPU rank's process before its model (bench/memory_overhead.py, docs/benchmarks.md): Python, torch and
# transformers imported and a gloo process group: 0.32-0.33 GiB resident on Linux, torch 2.13 (0.39 GiB in a fresh
# virtualenv: it depends on the installed packages' versions).
HOST_PROCESS_BYTES = 0.33 * 2 ** 30

# Freed memory glibc malloc keeps in a CPU rank's heap at the peak: small and mid-sized chunks stay for reuse
# (its mmap threshold rises up to 32 MiB as large chunks are freed). Measured 0.12-0.20 GiB under DDP and
# ZeRO-1 (GPT-2 6-12 x 512); FSDP2's per-block gathers and reduce-scatters (the gathered parameters, the
# gradients and gloo's full-size copy of each) keep about this many times a block's full bytes, per block,
# while a block's full size stays under the ceiling (larger chunks are mmapped and returned on free).
HOST_RETAINED_BYTES = 0.2 * 2 ** 30
HOST_RETAINED_PER_GATHERED_BLOCK = 4
MALLOC_MMAP_CEILING = 32 * 2 ** 20
# With the threshold fixed (MALLOC_MMAP_THRESHOLD_=131072 in the ranks' environment: DeviceSpec.fixed_mmap_threshold)
# malloc held nothing free at the peak in any of these runs; what stays is the 0.06 GiB of pages outside malloc
# that training adds to the process (thread stacks, code), which the share above includes.
HOST_RETAINED_BYTES_FIXED_THRESHOLD = 0.06 * 2 ** 30

# Adam / AdamW keep two fp32 moments per parameter (exp_avg, exp_avg_sq).
OPTIMIZER_STATE_BYTES = 8

# Temporaries of torch's Adam/AdamW step, in fp32 copies: on a CPU (or with `foreach: false`) it steps tensor by
# tensor and holds two of the tensor it steps (sqrt of exp_avg_sq, then its quotient: measured 2 x 294 MiB for a
# 50257 x 1536 embedding); on an accelerator its default foreach path holds one copy of every tensor of a device
# and dtype at once.
STEP_COPIES_PER_TENSOR = 2
STEP_COPIES_FOREACH = 1

# Bytes/s one rank's optimizer step reads and writes in host memory when its states are offloaded
# (torch's CPU AdamW on the few cores and the share of DRAM bandwidth a node gives each device).
HOST_OPTIMIZER_BANDWIDTH = 10e9

# Gradient buckets of DDP and ZeRO-1 (PyTorch DDP's default bucket_cap_mb): one collective, and one
# latency, per bucket. ZeRO-2/3 issue one collective per transformer block instead. The runtime's value.
from ..parallel.zero1.shares import BUCKET_BYTES  # noqa: E402,F401
