"""Expert parallelism's all-to-all traffic per rank, measured against the planner's theory.

    python bench/expert_parallel.py [--nproc 4] [--ep 2 4] [--tokens 4096] [--hidden 64] [--experts 8]
                                    [--top-k 2] [--json FILE]

One Mixtral layer (transformers, built from a config: no download) with its experts split over `ep` of
`nproc` gloo CPU ranks trains one step (forward and backward) on `tokens` random tokens per rank. Every
all-to-all on the EP group is recorded by shardwise's own collective watch (observe/comms.py, a
TorchDispatchMode under torch.distributed: nothing is patched) with the bytes of its buffer, and set
beside planner/experts.py's `all_to_all_bytes` for this rank: once with a perfectly balanced router
(skew 1: what every rank sends on average) and once with the rows this rank's experts really received
(its own skew). Reported as measured in docs/expert_parallel.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

from shardwise.observe.comms import CollectiveWatch
from shardwise.parallel.experts import apply_expert_parallel, expert_parallel_modules
from shardwise.planner.experts import all_to_all_bytes, expert_shape
from shardwise.testing import run_distributed, shutdown_pools

SEED = 0


def _model(hidden: int, experts: int, top_k: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512, num_local_experts=experts,
                           num_experts_per_tok=top_k, max_position_embeddings=128, output_router_logits=True)
    torch.manual_seed(SEED)
    return MixtralForCausalLM(config)


def measure(ep: int, tokens: int, hidden: int, experts: int, top_k: int) -> dict:
    """One rank: one training step; the bytes of each all-to-all on its EP group, and the rows it received."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("replicas", "ep"))
    model = _model(hidden, experts, top_k)
    apply_expert_parallel(model, mesh["ep"], dist.group.WORLD)
    layer, = expert_parallel_modules(model)
    layer.traffic = []
    ids = torch.randint(0, 512, (tokens // 128, 128), generator=torch.Generator().manual_seed(dist.get_rank()))
    ep_group = mesh["ep"].get_group()
    with CollectiveWatch({ep_group.group_name: ("ep", ep)}) as watch:
        model(input_ids=ids, labels=ids).loss.backward()
    exchanges = [c for c in watch.collectives if c.name == "all_to_all" and c.group == "ep"]
    received = sum(t.received[i] for t in layer.traffic for i in range(ep))
    return {"bytes": sum(c.nbytes for c in exchanges), "calls": len(exchanges), "received_rows": received}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=4096, help="per rank, a multiple of 128")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    shape = expert_shape(args.experts, args.top_k, 1, args.hidden, 2 * args.hidden)
    rows, results = args.tokens * args.top_k, {}
    print(f"| EP | rank | all-to-all calls | measured bytes | theory, skew 1 | ratio | rank's skew | "
          f"theory, rank's skew | ratio |\n|---|---|---|---|---|---|---|---|---|")
    for ep in args.ep:
        ranks = run_distributed(measure, args.nproc, ep, args.tokens, args.hidden, args.experts, args.top_k,
                                timeout=600)
        results[ep] = []
        for rank, got in enumerate(ranks):
            skew = got["received_rows"] / rows
            balanced = all_to_all_bytes(shape, args.tokens, ep, 4, skew=1.0)
            own = all_to_all_bytes(shape, args.tokens, ep, 4, skew=skew)
            row = {**got, "rank": rank, "theory_balanced": balanced, "ratio_balanced": got["bytes"] / balanced,
                   "skew": skew, "theory_own_skew": own, "ratio_own_skew": got["bytes"] / own}
            results[ep].append(row)
            print(f"| {ep} | {rank} | {got['calls']} | {got['bytes']:,} | {balanced:,.0f} | "
                  f"{row['ratio_balanced']:.4f} | {skew:.3f} | {own:,.0f} | {row['ratio_own_skew']:.4f} |")
        mean = sum(r["bytes"] for r in results[ep]) / len(results[ep])
        print(f"| {ep} | mean | | {mean:,.0f} | {balanced:,.0f} | {mean / balanced:.4f} | | | |")
    shutdown_pools()
    if args.json:
        setup = {"nproc": args.nproc, "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
                 "top_k": args.top_k, "torch": torch.__version__, "python": sys.version.split()[0],
                 "machine": platform.machine(), "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
