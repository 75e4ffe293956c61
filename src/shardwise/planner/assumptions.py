"""Every number the planner assumes rather than derives, in one place (docs/planner.md explains each)."""

# Fraction of a device's peak FLOP/s that transformer training kernels sustain
# (large GEMMs reach 60-80 %; norms, softmax, elementwise ops and launches pull the step to ~50 %).
ACHIEVABLE_FLOPS_FRACTION = 0.5

# Fraction of a link's nominal per-direction bandwidth a collective achieves (NCCL bus bandwidth
# on NVLink/EFA/InfiniBand measures 75-85 % of nominal).
LINK_EFFICIENCY = 0.8

# While a collective overlaps compute, both slow each other (shared SMs and memory bandwidth):
# this fraction of the overlapped interval is hidden, the rest is paid twice.
OVERLAP_EFFICIENCY = 0.8

# Allocator fragmentation and transient tensors not modelled one by one, as a share of the
# bytes the model accounts for.
FRAGMENTATION_MARGIN = 0.10

# Adam / AdamW keep two fp32 moments per parameter (exp_avg, exp_avg_sq).
OPTIMIZER_STATE_BYTES = 8

# Bytes/s one rank's optimizer step reads and writes in host memory when its states are offloaded
# (torch's CPU AdamW on the few cores and the share of DRAM bandwidth a node gives each device).
HOST_OPTIMIZER_BANDWIDTH = 10e9

# Gradient buckets of DDP and ZeRO-1 (PyTorch DDP's default bucket_cap_mb): one collective, and one
# latency, per bucket. ZeRO-2/3 issue one collective per transformer block instead. The runtime's value.
from ..parallel.zero1.shares import BUCKET_BYTES  # noqa: E402,F401
