"""The pipeline's module-graph cut: how long it takes on a large model, and how good the cut it picks is.

    python bench/graph_cut.py [--layers 48] [--width 1600] [--heads 25] [--seq 1024] [--stages 4]
                              [--small-layers 12] [--json FILE]

Time: `cut_graph` on a GPT-2 of `--layers` blocks built on the meta device (no
allocation), for one microbatch of `--seq` tokens, wall clock. Quality: on a GPT-2
of `--small-layers` blocks, the costliest stage of the cut it picks, by its own
cost model, against the best contiguous cut found by trying every split of the
finest units (every called module without called children), for each
memory_weight. A ratio of 1.0 means the cut is as good as any cut at any module
boundary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from shardwise.parallel.pipeline.graph_cut import cut_graph, trace_calls


def gpt2_on_meta(layers: int, width: int, heads: int, positions: int, vocab: int = 50257) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=positions,
                                          vocab_size=vocab))


def cut_time(layers: int, width: int, heads: int, seq: int, stages: int) -> dict:
    model = gpt2_on_meta(layers, width, heads, seq)
    ids = torch.zeros(1, seq, dtype=torch.long)
    start = time.perf_counter()
    cut = cut_graph(model, {"input_ids": ids, "labels": ids}, stages, memory_weight=0.8)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    return {"layers": layers, "params": params, "stages": stages, "seconds": round(seconds, 2),
            "units": len(cut.units), "split_points": list(cut.split_points)}


def _leaves(call) -> list:
    return [call] if not call.children else [leaf for child in call.children for leaf in _leaves(child)]


def best_contiguous(costs: list[float], stages: int) -> float:
    """The least costliest stage over every contiguous split of `costs` into `stages` non-empty runs."""
    prefix = list(itertools.accumulate(costs, initial=0.0))
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        edges = (0, *cuts, len(costs))
        best = min(best, max(prefix[b] - prefix[a] for a, b in zip(edges, edges[1:])))
    return best


def cut_quality(layers: int, stages: int, weights: tuple[float, ...] = (0.0, 0.5, 1.0)) -> list[dict]:
    model = gpt2_on_meta(layers, 64, 4, 32, vocab=512)  # a small vocabulary: no one module dominates
    ids = torch.zeros(2, 32, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    root, _ = trace_calls(model, inputs)
    leaves = sorted(_leaves(root), key=lambda call: call.order)
    flops, params = sum(c.flops for c in leaves) or 1, sum(c.params for c in leaves) or 1
    rows = []
    for weight in weights:
        cut = cut_graph(model, inputs, stages, memory_weight=weight)
        finest = [(1 - weight) * c.flops / flops + weight * c.params / params for c in leaves]
        stage_of = [next(s for u, s in zip(cut.units, cut.stage_of_unit) if leaf.path == u
                         or leaf.path.startswith(u + ".")) for leaf in leaves]  # the unit holding each leaf
        picked = max(sum(c for c, s in zip(finest, stage_of) if s == stage) for stage in range(stages))
        best = best_contiguous(finest, stages)
        rows.append({"memory_weight": weight, "units": len(cut.units), "finest_units": len(leaves),
                     "picked": round(picked, 4), "best": round(best, 4), "ratio": round(picked / best, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=25)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--small-layers", type=int, default=12)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    results = {"time": cut_time(args.layers, args.width, args.heads, args.seq, args.stages),
               "quality": cut_quality(args.small_layers, args.stages)}
    timing = results["time"]
    print(f"cut of a {timing['layers']}-layer GPT-2 ({timing['params'] / 1e9:.2f}B parameters, meta device) into "
          f"{timing['stages']} stages: {timing['seconds']} s over {timing['units']} units")
    print("memory_weight  units  finest  picked  best    ratio")
    for row in results["quality"]:
        print(f"{row['memory_weight']:<14} {row['units']:<6} {row['finest_units']:<7} {row['picked']:<7} "
              f"{row['best']:<7} {row['ratio']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
