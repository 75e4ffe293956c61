"""One accelerator's training throughput: a ~1B-parameter Llama in bf16 under shardwise against raw torch.

Three runs of the same model, data and AdamW on one device, world size 1 (FSDP2 on a
one-rank mesh, parameters in fp32 and compute in bf16):

- `torch eager`: torch's own `fully_shard` per block and at the root, MixedPrecisionPolicy(bf16);
- `torch compiled`: the same with each block compiled (`block.compile()`, as torchtitan does);
- `shardwise`: `sw.init({"zero_stage": 3, "bf16": True})` and the seed's loop.

Each run warms up, then times its steps with the device synchronised around them and
reports the median step, tokens/s, MFU (6·N + 12·L·h·s FLOPs per token, N the matmul
parameters, against the device's data-sheet bf16 peak) and the allocator's peak
(allocated and reserved), beside the planner's predicted step time and memory for that
layout. Writes gpu_check.json and gpu_check.md into the results folder.

    python bench/gpu_check.py RESULTS            # on an accelerator (bench/gpu_check.sh runs it)
    python bench/gpu_check.py RESULTS --dry-run  # a tiny Llama on the CPU: every part but the sizes and the kernels
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.config import parse_config
from shardwise.config.layout import layout_for
from shardwise.planner import cluster_preset, predict_memory, predict_step_time, spec_from_hf
from shardwise.runtime import state
from shardwise.runtime.devices import backend_for, local_device
from shardwise.topology import Cluster

GB = 1e9
SHARDWISE_CONFIG = {"zero_stage": 3, "bf16": True}


@dataclass(frozen=True)
class Size:
    """The model and the step: `rows` sequences of `seq` tokens per step."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int
    rows: int
    warmup: int
    steps: int

    def llama_config(self) -> transformers.LlamaConfig:
        return transformers.LlamaConfig(hidden_size=self.hidden, num_hidden_layers=self.layers,
                                        num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                        intermediate_size=self.intermediate, vocab_size=self.vocab,
                                        max_position_embeddings=self.seq, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0, tie_word_embeddings=False)


# Llama 3.2 1B's shape with a 32k vocabulary: 1.1 billion parameters; 8192 tokens a step.
BILLION = Size(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=8192, vocab=32000, seq=2048, rows=4,
               warmup=3, steps=8)
TINY = Size(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=32, rows=2, warmup=1, steps=1)


def flops_per_token(size: Size, matmul_parameters: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter and the attention scores' 12·L·h·s (PaLM's count)."""
    return 6 * matmul_parameters + 12 * size.layers * size.hidden * size.seq


def build(size: Size, device: torch.device) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(size.llama_config())


def batches(size: Size, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, size.vocab, (size.rows, size.seq), generator=g).to(device)
            for _ in range(size.warmup + size.steps)]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def timed(step: Callable[[torch.Tensor], torch.Tensor], data: list[torch.Tensor], size: Size,
          device: torch.device) -> dict:
    """Median seconds per step after the warm-up, the last loss, and the allocator's peaks over the timed steps."""
    for ids in data[:size.warmup]:
        step(ids)
    on_device = device.type != "cpu"
    if on_device:
        torch.accelerator.synchronize(device)
        torch.accelerator.reset_peak_memory_stats(device)
    seconds, loss = [], None
    for ids in data[size.warmup:]:
        start = time.perf_counter()
        loss = step(ids)
        if on_device:
            torch.accelerator.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return {"step_s": statistics.median(seconds), "loss": float(loss),
            "allocated_bytes": torch.accelerator.max_memory_allocated(device) if on_device else None,
            "reserved_bytes": torch.accelerator.max_memory_reserved(device) if on_device else None}


def run_torch(size: Size, device: torch.device, compiled: bool, backend: str) -> dict:
    """Raw torch: FSDP2 per block and at the root on a one-rank mesh, bf16 compute, AdamW."""
    model = build(size, device)
    if compiled:
        for block in model.model.layers:
            block.compile(backend=backend)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = lm_loss(model(ids).logits, ids)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return timed(step, batches(size, device), size, device)


def run_shardwise(size: Size, device: torch.device) -> dict:
    sw.init(SHARDWISE_CONFIG)
    model = sw.DistributedModel(build(size, device))
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @sw.step
    def train_step(model, ids):
        loss = lm_loss(model(ids).logits, ids)
        model.backward(loss)
        return loss

    def step(ids: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = train_step(model, ids).reduce_mean()
        optimizer.step()
        return loss

    sharded = isinstance(next(model.parameters()), DTensor)  # ZeRO-3: FSDP2's shards, as the torch runs
    result = timed(step, batches(size, device), size, device) | {"sharded": sharded}
    state.set_current(None)  # the process group stays for the next run
    return result


def left_allocated(device: torch.device) -> int:
    """Bytes the runs before still hold on the device once their garbage is collected (FSDP's hooks make
    reference cycles): taken off this run's peaks, which count every allocation alive."""
    gc.collect()
    if device.type == "cpu":
        return 0
    torch.accelerator.empty_cache()
    return torch.accelerator.memory_allocated(device)


def cluster_for(device: torch.device):
    """The planner's one-device cluster: an H200 (the H100 preset's chip with the H200's memory and bandwidth)
    on an accelerator, this machine's CPU in the dry run."""
    if device.type == "cpu":
        return cluster_preset("local", devices_per_node=1)
    cluster = cluster_preset("p5.48xlarge", devices_per_node=1)
    return replace(cluster, device=replace(cluster.device, name="H200", memory_bytes=141 * GB,
                                           memory_bandwidth=4800 * GB))


def predicted(size: Size, device: torch.device) -> dict:
    config = parse_config(SHARDWISE_CONFIG)
    spec = spec_from_hf(size.llama_config().to_dict(), "llama")
    layout, cluster = layout_for(config, Cluster(1, 1)), cluster_for(device)
    memory = predict_memory(spec, config, layout, size.rows, size.seq, device=cluster.device)
    time_ = predict_step_time(spec, config, layout, cluster, size.rows, size.seq)
    return {"step_s": time_.total, "tokens_per_s": time_.tokens_per_s, "mfu": time_.mfu,
            "tensor_bytes": memory.tensors, "total_bytes": memory.total, "peak_flops": cluster.device.peak_flops["bf16"]}


def measure(size: Size, device: torch.device, compile_backend: str, save: Callable[[dict], None]) -> dict:
    """Every run, the compiled one last (its compilation is the slowest part); `save(result)` after each, so a
    run stopped by its time limit keeps what was measured."""
    model = build(size, "meta")
    parameters = sum(p.numel() for p in model.parameters())
    matmul = parameters - model.model.embed_tokens.weight.numel()
    plan = predicted(size, device)
    tokens = size.rows * size.seq
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
              "torch": torch.__version__, "size": size.__dict__, "parameters": parameters,
              "tokens_per_step": tokens, "planner": plan, "runs": {}}
    runs: dict[str, Callable[[], dict]] = {
        "torch eager": lambda: run_torch(size, device, False, compile_backend),
        "shardwise": lambda: run_shardwise(size, device),
        "torch compiled": lambda: run_torch(size, device, True, compile_backend)}
    for name, run in runs.items():
        left = left_allocated(device)
        measured = run()
        if measured["allocated_bytes"] is not None:
            measured["allocated_bytes"] -= left
            measured["reserved_bytes"] -= left
        measured["left_bytes"] = left
        measured["tokens_per_s"] = tokens / measured["step_s"]
        measured["mfu"] = measured["tokens_per_s"] * flops_per_token(size, matmul) / plan["peak_flops"]
        result["runs"][name] = measured
        save(result)
    return result


def markdown(result: dict) -> str:
    plan, gib = result["planner"], 2 ** 30

    def memory(value):
        return "–" if value is None else f"{value / gib:.1f}"

    lines = [f"{result['parameters'] / 1e6:,.1f}M-parameter Llama, bf16, {result['tokens_per_step']} tokens a step, "
             f"one {result['device']}, torch {result['torch']}", "",
             "| run | step (s) | tokens/s | MFU | peak allocated (GiB) | peak reserved (GiB) | final loss |",
             "|---|---|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        lines.append(f"| {name} | {run['step_s']:.3f} | {run['tokens_per_s']:,.0f} | {run['mfu']:.1%} | "
                     f"{memory(run['allocated_bytes'])} | {memory(run['reserved_bytes'])} | {run['loss']:.4f} |")
    lines.append(f"| planner (shardwise's layout) | {plan['step_s']:.3f} | {plan['tokens_per_s']:,.0f} | "
                 f"{plan['mfu']:.1%} | {memory(plan['tensor_bytes'])} (tensors) | {memory(plan['total_bytes'])} "
                 "(total) | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny Llama on the CPU, compiled with dynamo's eager backend: checks the script itself")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.dry_run else local_device(0)
    if device.type == "cpu" and not args.dry_run:
        parser.error("no accelerator: run with --dry-run to check the script on the CPU")
    size, backend = (TINY, "eager") if args.dry_run else (BILLION, "inductor")
    store = dist.FileStore(str(Path(tempfile.mkdtemp(prefix="gpu_check_")) / "store"), 1)
    dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1,
                            device_id=None if device.type == "cpu" else device)
    args.results.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        (args.results / "gpu_check.json").write_text(json.dumps(result, indent=2))
        (args.results / "gpu_check.md").write_text(markdown(result))

    try:
        result = measure(size, device, backend, save)
    finally:
        dist.destroy_process_group()
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
