"""Context parallelism on this machine: bytes on the wire per rank against the planner's theory, and the longest
sequence one layout trains with and without CP.

    python bench/context_parallel.py [--nproc 4] [--cp 2 4] [--seq 4096] [--budget-mib 64] [--json FILE]

Traffic: one attention layer (batch 1, 8 heads, 4 key/value heads, head dim 64, fp32) runs forward and backward
on its load-balanced share of `seq` tokens per rank, ring and all-to-all, with and without packed documents.
`WireBytes` (a TorchDispatchMode: nothing is patched) counts, for every all-to-all the attention issues, the
bytes of the input that go to other ranks (the ring's hops are all-to-alls sending everything to the next rank),
beside planner/context.py's `wire_bytes`.

Longest sequence: a tiny Llama (hidden 64, 2 layers, 4 heads, vocab 128) trains one step on one row; the
sequence doubles from 1024 while the rank's peak memory (MemTracker, every category) stays under
`--budget-mib`: one process without CP, then `nproc` ranks with CP = nproc (ring). Reported as measured in
docs/context_parallel.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

from shardwise.parallel.context import apply_context_parallel, sequence_loss, shard, shard_batch
from shardwise.parallel.context.all_to_all import all_to_all_attention
from shardwise.parallel.context.ring import ring_attention
from shardwise.planner.context import AttentionShape, wire_bytes
from shardwise.testing import run_distributed, shutdown_pools
from shardwise.torch_internals import TorchDispatchMode


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class WireBytes(TorchDispatchMode):
    """Bytes this rank sends to other ranks of `group` through all-to-alls (c10d's and the functional one)."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.rank, self.size, self.sent = dist.get_rank(group), dist.get_world_size(group), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name == "all_to_all_single":
            tensor, splits = args[0], args[2]  # input, output splits, input splits, group name
            self.sent += self._sent(tensor, splits)
        elif func.namespace == "c10d" and name == "alltoall_base_":
            tensor, splits = args[1], args[4]  # output, input, group, output splits, input splits
            self.sent += self._sent(tensor, splits)
        return func(*args, **(kwargs or {}))

    def _sent(self, tensor: torch.Tensor, splits: list[int]) -> int:
        rows = tensor.shape[0] if tensor.dim() else 1
        kept = splits[self.rank] if splits else rows // self.size
        return _nbytes(tensor) * (rows - kept) // max(rows, 1)


def attention_traffic(mode: str, cp: int, seq: int, documents: bool, heads: int = 8, kv_heads: int = 4,
                      head_dim: int = 64) -> dict:
    """On every rank of groups of `cp`: one attention layer's forward and backward; bytes sent, and theory."""
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, dist.get_world_size(), cp)]
    group, cp_rank = groups[rank // cp], rank % cp
    torch.manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim)
    k, v = torch.randn(1, kv_heads, seq, head_dim), torch.randn(1, kv_heads, seq, head_dim)
    local = [shard(t, 2, cp_rank, cp).requires_grad_() for t in (q, k, v)]
    ids = torch.arange(seq).div(seq // 4, rounding_mode="floor").unsqueeze(0) if documents else None
    split = ring_attention if mode == "ring" else all_to_all_attention
    with WireBytes(group) as forward:
        out = split(*local, group, scale=head_dim ** -0.5,
                    documents=None if ids is None else shard(ids, 1, cp_rank, cp))
    with WireBytes(group) as backward:
        out.backward(torch.ones_like(out))
    theory = wire_bytes(mode, cp, AttentionShape(1, seq, heads, kv_heads, head_dim, 4, documents))
    return {"forward": forward.sent, "backward": backward.sent,
            "theory_forward": theory["forward"], "theory_backward": theory["backward"]}


def _tiny_llama(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=seq))


def peak_bytes(seq: int, cp: int) -> int:
    """This rank's peak memory (MemTracker, all categories) over one training step on one row of `seq` tokens."""
    from torch.distributed._tools.mem_tracker import MemTracker

    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _tiny_llama(seq)
    if cp > 1:
        apply_context_parallel(model, dist.group.WORLD, "ring")
    ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(1))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        if cp > 1:
            inputs, labels = shard_batch(ids, rank, cp, labels=ids)
            sequence_loss(model(**inputs, use_cache=False).logits, labels, dist.group.WORLD).backward()
        else:
            model(ids, labels=ids, use_cache=False).loss.backward()
    return max(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values())


def _peak_over_ranks(seq: int, cp: int) -> int:
    peak = torch.tensor([peak_bytes(seq, cp)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def longest(cp: int, budget: int, start: int = 1024, limit: int = 1 << 20) -> dict:
    """The longest power-of-two multiple of `start` whose step peaks under `budget` bytes on every rank."""
    measured, seq = {}, start
    while seq <= limit:
        peak = run_distributed(_peak_over_ranks, cp, seq, cp, timeout=1800)[0]
        measured[seq] = peak
        if peak > budget:
            break
        seq *= 2
    fitting = [s for s, p in measured.items() if p <= budget]
    return {"longest": max(fitting) if fitting else None, "peak_bytes": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--skip-longest", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
              "traffic": {}, "longest": {}}
    for mode in ("ring", "all_to_all"):
        for cp in args.cp:
            for documents in (False, True):
                rank0 = run_distributed(attention_traffic, args.nproc, mode, cp, args.seq, documents, timeout=1800)[0]
                error = max(abs(rank0[k] / rank0[f"theory_{k}"] - 1) for k in ("forward", "backward"))
                key = f"{mode} cp{cp}{' packed' if documents else ''}"
                report["traffic"][key] = {**rank0, "relative_error": error}
                print(f"{key:>22}: forward {rank0['forward']:>10} B (theory {rank0['theory_forward']:>12.0f}), "
                      f"backward {rank0['backward']:>10} B (theory {rank0['theory_backward']:>12.0f}), "
                      f"error {error:.2%}", flush=True)
    if not args.skip_longest:
        budget = args.budget_mib << 20
        for cp in (1, args.nproc):
            report["longest"][f"cp{cp}"] = found = longest(cp, budget)
            print(f"cp {cp}: longest sequence under {args.budget_mib} MiB per rank: {found['longest']} "
                  f"(peaks: {found['peak_bytes']})", flush=True)
    shutdown_pools()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
