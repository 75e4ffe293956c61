"""The combination matrix: the axes users combine, a pairwise covering array of them, and one run.

A combination picks one value per axis. `config_for` turns it into a config and
the world it runs on; `train_combination` is one rank of the seed's loop under
it (the replica check on every step); `reference` trains one plain process the
same way; `compare` says how far apart they are. `tests/test_combination_matrix.py`
runs every pair of axis values, `bench/combinations.py` the full product.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.parallel.tensor import SequencePlan, TensorParallelPlan
from tiny_models import blocks, build, dataset, loss_fn, relative_error, seed_step

ROWS = 2  # per data-parallel rank and step
STEPS = 3
CLIP = 0.5  # the gradient norm starts above 1 for every family: clipping acts on every step

# name: (world size, ranks per node, config); 4 ranks on one node unless the layout needs more
LAYOUTS: dict[str, tuple[int, int, dict]] = {
    "ddp": (4, 4, {}),
    "zero1": (4, 4, {"shard_optimizer_state": True}),
    "zero2": (4, 4, {"zero_stage": 2, "sharded_data_parallel_degree": 4}),
    "zero3": (4, 4, {"sharded_data_parallel_degree": 4}),
    "mics": (4, 4, {"sharded_data_parallel_degree": 2}),
    # the cross-group all-reduce overlapping the step and the next forward (the replica check waits for it)
    "mics-overlap-forward": (4, 2, {"sharded_data_parallel_degree": 2, "cross_group_overlap": "forward"}),
    # ZeRO++ hpZ: after forward parameters stay sharded over each node's two ranks, where backward gathers them
    "zero3-hpz": (4, 2, {"sharded_data_parallel_degree": 4, "zero_hpz_partition_size": 2}),
    "tp": (4, 4, {"tensor_parallel_degree": 2}),
    "tp-world": (2, 2, {"tensor_parallel_degree": 2}),  # one tensor-parallel group, no data parallelism
    "tp-sharded": (4, 4, {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}),
    "pp": (4, 4, {"pipeline_parallel_degree": 2, "microbatches": 2}),
    "pp-tp-dp": (8, 4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}),
    # cut from the module graph at the first step instead of along the block list
    "pp-graph": (4, 4, {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline_cut": "graph"}),
    "sp": (4, 4, {"tensor_parallel_degree": 2, "sequence_parallel": True}),
    # stages hand each other sequence shards; refused in fp16, where it does not train the same weights yet
    "pp-sp": (4, 4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "sequence_parallel": True,
                     "microbatches": 2}),
}
# Variants of a layout the covering array leaves out (their pairs with every other axis value would add rows, not
# risk): they run in VARIANT_ROWS only.
VARIANTS: dict[str, tuple[int, int, dict]] = {
    "mics-bf16-cross": (4, 4, {"sharded_data_parallel_degree": 2, "cross_group_reduce_dtype": "bf16"}),
    # the module-graph cut with two stages per rank, and with tensor-parallel stages
    "pp-graph-interleaved": (4, 4, {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline_cut": "graph",
                                    "pipeline_schedule": "interleaved_1f1b"}),
    "pp-graph-tp": (4, 4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
                           "pipeline_cut": "graph"}),
    # context parallelism: sequences split over 2 ranks beside 2 replicas (ring under DDP; all-to-all under ZeRO-3
    # over dp_shard x cp); its attention splits the causal text families only, so it runs in VARIANT_ROWS
    "cp": (4, 4, {"context_parallel_degree": 2}),
    "cp-all-to-all-zero3": (4, 4, {"context_parallel_degree": 2, "context_parallel_mode": "all_to_all",
                                   "sharded_data_parallel_degree": 2}),
    # the sequence split over cp, then each cp share's activations over tp between the split layers
    "cp-tp-sp": (4, 4, {"context_parallel_degree": 2, "tensor_parallel_degree": 2, "sequence_parallel": True}),
    # two pipeline stages, each splitting its microbatches' sequences over cp; the last takes the loss
    "cp-pp": (4, 4, {"context_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2}),
    # expert parallelism: each MoE layer's experts over 2 ranks of ZeRO-3's sharding group, beside tensor
    # parallelism on the attention, and in each of two pipeline stages; it splits mixture-of-experts families only,
    # so it runs in VARIANT_ROWS
    "zero3-ep": (4, 4, {"sharded_data_parallel_degree": 4, "expert_parallel_degree": 2}),
    "tp-ep": (4, 4, {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "expert_parallel_degree": 2}),
    "pp-ep": (4, 4, {"pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 2, "expert_parallel_degree": 2,
                     "microbatches": 2}),
    # experts over the 2 cp ranks of ZeRO-3's sharding group (dp_shard × cp = expert_shard × ep), sequences over cp
    "cp-ep": (4, 4, {"context_parallel_degree": 2, "sharded_data_parallel_degree": 2, "expert_parallel_degree": 2}),
    # sequence parallelism keeping its gathered inputs as shards, gathered again in backward (Megatron-LM's way)
    "sp-regather": (4, 4, {"tensor_parallel_degree": 2, "sequence_parallel": True,
                           "sequence_parallel_regather": True}),
    "pp-sp-regather": (4, 4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "sequence_parallel": True,
                              "sequence_parallel_regather": True, "microbatches": 2}),
    "cp-tp-sp-regather": (4, 4, {"context_parallel_degree": 2, "tensor_parallel_degree": 2, "sequence_parallel": True,
                                 "sequence_parallel_regather": True}),
    # pure bf16 (bf16 parameters, gradients, reductions and optimizer states, no fp32 master) in pipeline stages,
    # each stage's parameters stored in bf16; with the bf16 precision only, against the fp32 process
    "pp-pure-bf16": (4, 4, {"pipeline_parallel_degree": 2, "microbatches": 2, "bf16_master_weights_and_grads": True}),
    # ZeRO-1's microbatches adding up in fp32 on each rank, reduced once a step (its fp32 masters: bf16/fp16, or
    # fp32 with the optimizer offloaded), alone and in pipeline stages
    "zero1-local": (4, 4, {"shard_optimizer_state": True, "microbatches": 2, "accumulate_gradients_locally": True}),
    "pp-zero1-local": (4, 4, {"pipeline_parallel_degree": 2, "shard_optimizer_state": True, "microbatches": 2,
                              "accumulate_gradients_locally": True}),
}
PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}
# What moves to host memory: nothing, the optimizer's states (and what it steps), or checkpointed regions' inputs.
OFFLOADS = {"none": {}, "optimizer": {"offload_optimizer_state": True}, "activations": {"offload_activations": True}}

# Rows the matrix once found wrong, run besides the covering array: (layout, family, precision, clipping,
# checkpointing, optimizer, resume, offload).
REGRESSIONS = [
    ("tp-world", "gpt2", "fp16", True, "none", "after", False, "none"),  # the loss scaler met DTensor and plain grads
    ("mics", "bert", "fp32", False, "none", "after", False, "none"),     # BERT's tied embeddings sat in two FSDP units
    ("tp-sharded", "bert", "bf16", True, "none", "after", False, "none"),
    ("pp", "llama", "fp16", False, "each", "after", False, "none"),       # stand-ins of other stages computed in fp32
    ("zero3", "llama", "fp32", True, "each", "before", False, "none"),    # an optimizer built first kept stale parameters
    ("tp", "gpt2", "fp32", True, "none", "before", False, "none"),
    ("tp", "gpt2", "fp32", False, "none", "after", True, "none"),        # DCP wrote packed Q/K/V's pieces overlapping
    ("pp", "gpt2", "fp32", False, "none", "after", True, "none"),        # a tied weight's optimizer state under one name
]

VARIANT_ROWS = [
    ("mics-bf16-cross", "gpt2", "fp32", True, "each", "after", False, "none"),
    ("mics-bf16-cross", "bert", "bf16", False, "none", "before", True, "optimizer"),
    ("pp-graph-interleaved", "bert", "fp32", True, "none", "after", True, "none"),
    ("pp-graph-tp", "gpt2", "fp32", False, "each", "before", True, "none"),
    ("cp", "gpt2", "fp32", True, "each", "after", True, "none"),
    ("cp", "llama", "bf16", False, "none", "before", False, "optimizer"),
    ("cp-all-to-all-zero3", "llama", "fp32", True, "matmul", "after", True, "none"),
    ("cp-all-to-all-zero3", "gpt2", "fp16", False, "each", "before", False, "activations"),
    ("cp-tp-sp", "llama", "bf16", True, "each", "after", True, "none"),
    ("cp-pp", "gpt2", "fp32", False, "each", "before", True, "optimizer"),
    ("zero3-ep", "mixtral", "fp32", True, "each", "after", True, "none"),
    ("zero3-ep", "mixtral", "bf16", False, "none", "before", False, "optimizer"),
    ("tp-ep", "mixtral", "fp32", False, "matmul", "after", True, "activations"),
    ("tp-ep", "mixtral", "fp16", True, "none", "before", False, "none"),
    ("pp-ep", "mixtral", "bf16", True, "each", "after", True, "none"),
    ("cp-ep", "mixtral", "bf16", True, "each", "before", True, "none"),
    ("pp-pure-bf16", "llama", "bf16", True, "each", "after", True, "none"),
    ("sp-regather", "llama", "bf16", True, "none", "after", False, "none"),
    ("sp-regather", "gpt2", "fp32", False, "matmul", "before", True, "none"),
    ("pp-sp-regather", "llama", "fp32", True, "none", "after", True, "none"),
    ("cp-tp-sp-regather", "gpt2", "fp32", False, "none", "before", False, "none"),
    ("zero1-local", "gpt2", "bf16", True, "each", "after", True, "none"),
    ("zero1-local", "bert", "fp32", False, "none", "before", False, "optimizer"),
    ("pp-zero1-local", "llama", "fp16", True, "none", "after", True, "none"),
]

AXES: dict[str, tuple[Any, ...]] = {
    "layout": tuple(LAYOUTS),
    "family": ("gpt2", "llama", "bert", "stack"),
    "precision": tuple(PRECISIONS),
    "clipping": (False, True),
    "checkpointing": ("none", "each", "matmul"),  # every block recomputed whole, or keeping its matmuls' outputs
    "optimizer": ("after", "before"),
    "resume": (False, True),
    "offload": tuple(OFFLOADS),
}

# Relative tolerances against the fp32 process: fp32 differs by summation order only; bf16 keeps 8 bits of
# mantissa, fp16 11, through a few steps of compute.
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 5e-3}
# A cross-group all-reduce in bf16 rounds each step's averaged gradient to 8 bits (2^-9 relative), and SGD
# carries that into the update in proportion. Measured in fp32 (GPT-2, clipping): parameters 2.5e-3, clip norm
# 1.8e-4, loss 4e-7 (the same row in fp32 across groups: 2e-7); AdamW amplifies it (tests/test_mics_overlap.py).
CROSS_GROUP_BF16_TOLERANCE = 1e-2

# The plain nn.Module has no built-in tensor-parallel plan: its user brings one, saying where sequence
# parallelism may shard the sequence.
PLANS = {"stack": TensorParallelPlan(styles={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"},
                                     sequence=SequencePlan(blocks="blocks.*", norms=("blocks.*.norm",)))}


def pairwise(axes: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """A covering array: every pair of values of two axes appears in some row. Greedy and deterministic:
    each row starts from the first pair not covered yet and fills the other axes with the value that covers
    the most new pairs (on ties the one fewest rows have yet, then the first, so rows vary)."""
    names = list(axes)
    position = {(name, value): (i, j) for i, name in enumerate(names) for j, value in enumerate(axes[name])}
    uncovered = {((a, va), (b, vb)) for i, a in enumerate(names) for b in names[i + 1:]
                 for va in axes[a] for vb in axes[b]}

    def pairs(row: dict[str, Any]) -> set:
        items = [(name, row[name]) for name in names if name in row]
        return {(x, y) for k, x in enumerate(items) for y in items[k + 1:]}

    rows = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda pair: (position[pair[0]], position[pair[1]]))
        row = {a: va, b: vb}
        for name in names:
            if name not in row:
                row[name] = max(axes[name], key=lambda v: (len(pairs({**row, name: v}) & uncovered),
                                                           -sum(r[name] == v for r in rows)))
        row = {name: row[name] for name in names}
        rows.append(row)
        uncovered -= pairs(row)
    return rows


def product(axes: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Every combination."""
    import itertools

    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def name_of(combo: dict[str, Any]) -> str:
    flags = [f"{combo['layout']}", combo["family"], combo["precision"]]
    checkpointing = {"none": None, "each": "checkpointing"}.get(combo["checkpointing"],
                                                                 f"checkpointing-{combo['checkpointing']}")
    flags += [flag for flag in ("clipping" if combo["clipping"] else None, checkpointing,
                                "resume" if combo["resume"] else None) if flag]
    flags += [f"offload-{combo['offload']}"] if combo["offload"] != "none" else []
    return "-".join(flags + [f"opt-{combo['optimizer']}"])


def config_for(combo: dict[str, Any]) -> tuple[int, int, dict]:
    """(world size, ranks per node, config) of a combination; the replica check runs after every step."""
    world, per_node, layout = {**LAYOUTS, **VARIANTS}[combo["layout"]]
    config = {**layout, **PRECISIONS[combo["precision"]], **OFFLOADS[combo["offload"]], "replica_check_interval": 1}
    if combo["clipping"]:
        config["gradient_clipping"] = CLIP
    return world, per_node, config


def param_groups(named: Iterable[tuple[str, torch.Tensor]]) -> list[dict]:
    """Two groups with their own options, as real scripts have: matrices decay, vectors (biases, norms) do not."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 0.05}]


def make_optimizer(named: Iterable[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups(named), lr=0.1, momentum=0.9)


def _distributed(module: nn.Module, combo: dict[str, Any]) -> tuple[sw.DistributedModel, sw.DistributedOptimizer]:
    """Model and optimizer in the order the combination says: real SMP scripts often build the optimizer first."""
    plan = PLANS.get(combo["family"])
    if combo["optimizer"] == "before":
        optimizer = make_optimizer(module.named_parameters())
        return sw.DistributedModel(module, tensor_parallel_plan=plan), sw.DistributedOptimizer(optimizer)
    model = sw.DistributedModel(module, tensor_parallel_plan=plan)
    return model, sw.DistributedOptimizer(make_optimizer(model.named_parameters()))


def train_combination(combo: dict[str, Any]) -> dict:
    """One rank: losses (None where this rank holds none), clip norms, and on rank 0 the whole parameters."""
    world, _, config = config_for(combo)
    sw.init(config)
    family = combo["family"]
    model, optimizer = _distributed(build(family, freeze_key_bias=True), combo)
    if combo["checkpointing"] != "none":
        policy = None if combo["checkpointing"] == "each" else combo["checkpointing"]
        for block in blocks(model.get_module()):
            sw.set_activation_checkpointing(block, policy=policy)
    train_step = seed_step(family)
    losses, norms = [], []
    loader = sw.data_loader(dataset(family, (STEPS + 1) * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False)
    batches = iter(loader)
    for step in range(STEPS):
        if combo["resume"] and step == 1:
            batches = _through_a_checkpoint(model, optimizer, loader, batches, train_step)
        inputs, targets = next(batches)
        optimizer.zero_grad()
        out = train_step(model, inputs, targets)
        losses.append(out.reduce_mean().item() if out.holds_loss else None)
        optimizer.step()
        norms.append(None if optimizer.grad_norm is None else float(optimizer.grad_norm))
    state = {k: v.float() for k, v in model.full_state_dict().items()}
    return {"losses": losses, "norms": norms, "dp_size": sw.dp_size(), "state": state if sw.rank() == 0 else None}


def _through_a_checkpoint(model, optimizer, loader, batches, train_step):
    """Save, train a step that must not count (weights, optimizer, data position and loss scale all move),
    resume the save: the run must go on as if none of it happened. The loop's next batches come from a new
    pass over `loader`, which continues the restored position."""
    path = [tempfile.mkdtemp(prefix="shardwise-matrix-") if sw.rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    sw.save_checkpoint(path[0], "step1")
    optimizer.zero_grad()
    train_step(model, *next(batches))
    optimizer.step()
    sw.resume_from_checkpoint(path[0])
    dist.barrier()
    if sw.rank() == 0:
        shutil.rmtree(path[0])
    return iter(loader)


def init_only(combo: dict[str, Any]) -> None:
    sw.init(config_for(combo)[2])


@functools.cache
def reference(family: str, clip: bool, global_batch: int) -> dict:
    """One plain process, no shardwise, on the same global batches: losses, norms before clipping, parameters."""
    model = build(family, freeze_key_bias=True)
    optimizer = make_optimizer(model.named_parameters())
    data = dataset(family, STEPS * global_batch)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = data[step * global_batch:(step + 1) * global_batch]
        optimizer.zero_grad()
        loss = loss_fn(family, model, inputs, targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) if clip else None)
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _relative(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / max(abs(w), 1e-6) for g, w in zip(got, want))


def compare(combo: dict[str, Any], ranks: list[dict]) -> dict[str, float]:
    """Worst relative differences from the plain process: per-step mean loss, clip norm on any rank, and
    any whole parameter (norm-relative, see tiny_models.relative_error)."""
    want = reference(combo["family"], combo["clipping"], ROWS * ranks[0]["dp_size"])
    held = [r["losses"] for r in ranks if r["losses"][0] is not None]
    losses = torch.tensor(held).mean(0).tolist()
    worst = {"loss": _relative(losses, want["losses"])}
    if combo["clipping"]:
        worst["norm"] = max(_relative(r["norms"], want["norms"]) for r in ranks)
    state = ranks[0]["state"]
    missing = set(want["state"]) - set(state)
    if missing:
        raise AssertionError(f"full_state_dict() lacks {sorted(missing)[:3]}")
    worst["parameter"] = max(relative_error(state[k], v) for k, v in want["state"].items())
    return worst


def within_tolerance(combo: dict[str, Any], worst: dict[str, float]) -> Optional[str]:
    """None, or which measure exceeds the precision's tolerance (a bf16 cross-group reduction's, if larger)."""
    limit = TOLERANCE[combo["precision"]]
    if config_for(combo)[2].get("cross_group_reduce_dtype") == "bf16":
        limit = max(limit, CROSS_GROUP_BF16_TOLERANCE)
    over = {k: v for k, v in worst.items() if v > limit}
    return None if not over else ", ".join(f"{k} differs by {v:.2e} (> {limit:g})" for k, v in over.items())
