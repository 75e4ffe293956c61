"""Tensor parallelism through the public API, composed with DDP, ZeRO-1/2/3 and MiCS.

The user's loop is the seed's: `sw.init(config)`, `sw.DistributedModel`,
`sw.DistributedOptimizer`, an `@sw.step` function calling `model.backward`.
Every rank also trains the plain model on the whole global batch; losses
(averaged over ranks) and every full parameter must agree within 1e-5 relative
(fp32, dropout off). Parameters are compared after SGD with momentum: attention
key biases have an exactly-zero gradient, which Adam would turn into full-size
steps of rounding noise (see test_tensor_parallel.py); AdamW runs on the
bias-free Llama. Each call trains GPT-2, Llama and ViT in turn in one world.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.testing import run_distributed
from test_tensor_parallel import MODELS, USER_PLANS, _inputs, _loss

ROWS = 2  # rows per data-parallel rank (dp counts TP ranks, as in SMP)
STEPS = 3
KINDS = ("gpt2", "llama", "vit")


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _my_rows(inputs: dict, prescaled: bool) -> dict:
    """SMP's data split: off, rows by dp rank (TP peers differ); on, by replica (TP peers share tp× rows)."""
    index, rows = (sw.rdp_rank(), ROWS * sw.tp_size()) if prescaled else (sw.dp_rank(), ROWS)
    return {k: v[index * rows:(index + 1) * rows] for k, v in inputs.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-3)).item()


def train_kind(kind: str, prescaled: bool, optimizer: str, checkpoint: bool, clip: float | None = None) -> dict:
    torch.manual_seed(0)
    reference = MODELS[kind](256)
    model = sw.DistributedModel(copy.deepcopy(reference), tensor_parallel_plan=USER_PLANS.get(kind))
    if checkpoint:
        for block in model.get_module().base_model.layers if kind != "gpt2" else model.get_module().transformer.h:
            sw.set_activation_checkpointing(block)
    ref_opt = _optimizer(optimizer, reference.parameters())
    opt = sw.DistributedOptimizer(_optimizer(optimizer, model.parameters()))

    @sw.step
    def train_step(model, inputs):
        loss = _loss(kind, model(**{k: v for k, v in inputs.items() if k != "labels"}), inputs)
        model.backward(loss)
        return loss

    ref_losses, losses = [], []
    for step in range(STEPS):
        inputs = _inputs(kind, sw.size() * ROWS, step, 256)
        ref_loss = _loss(kind, reference(**{k: v for k, v in inputs.items() if k != "labels"}), inputs)
        ref_loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = torch.as_tensor(train_step(model, _my_rows(inputs, prescaled)).reduce_mean()).detach().clone()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        ref_losses.append(ref_loss.item())
        losses.append(loss.item() / sw.size())
    full, ref = model.full_state_dict(), reference.state_dict()
    errors = {k: _rel(full[k], ref[k]) for k in ref}
    total = (sum((full[k] - ref[k]).norm() ** 2 for k in ref) ** 0.5 / sum(v.norm() ** 2 for v in ref.values()) ** 0.5)
    return {"kind": kind, "ref_losses": ref_losses, "losses": losses, "names": sorted(full) == sorted(ref),
            "worst": max(errors.items(), key=lambda kv: kv[1]), "total": total.item()}


def train_all(config: dict, kinds=KINDS, optimizer: str = "sgd", checkpoint: bool = False) -> list[dict]:
    sw.init(config)
    return [train_kind(kind, config.get("prescaled_batch", False), optimizer, checkpoint,
                       config.get("gradient_clipping")) for kind in kinds]


def _check(results: list[dict], per_tensor: bool = True) -> None:
    for result in results:
        assert result["names"], "state_dict names must stay those of the unsplit model"
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5), result["kind"]
        if per_tensor:
            assert result["worst"][1] < 1e-5, (result["kind"], result["worst"])
        assert result["total"] < 1e-5, result["kind"]


CASES = {
    "tp4": {"tensor_parallel_degree": 4},
    "tp4-prescaled": {"tensor_parallel_degree": 4, "prescaled_batch": True},
    "tp2-ddp": {"tensor_parallel_degree": 2},
    "tp2-ddp-prescaled": {"tensor_parallel_degree": 2, "prescaled_batch": True},
    "tp2-zero1": {"tensor_parallel_degree": 2, "shard_optimizer_state": True},
    # The gradient norm is ~1.7 (GPT-2) at first: 0.5 clips every step; packed Q/K/V is a _StridedShard.
    "tp2-ddp-clipping": {"tensor_parallel_degree": 2, "gradient_clipping": 0.5},
    "tp2-zero1-clipping": {"tensor_parallel_degree": 2, "shard_optimizer_state": True, "gradient_clipping": 0.5},
    "tp2-zero3-clipping": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "gradient_clipping": 0.5},
    "tp2-zero3": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
    "tp2-zero3-prescaled": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True},
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_math_as_one_process(name):
    _check(run_distributed(train_all, 4, CASES[name], timeout=300)[0])


def test_zero2_microbatches_and_checkpointing():
    """TP × ZeRO-2 with two @step microbatches and every block recomputed in backward."""
    config = {"tensor_parallel_degree": 2, "zero_stage": 2, "sharded_data_parallel_degree": 2, "microbatches": 2}
    _check(run_distributed(train_all, 4, config, checkpoint=True, timeout=300)[0])


def test_user_plan_for_a_model_without_builtin_plan():
    """A model no plan is built in for splits by the plan given to DistributedModel."""
    _check(run_distributed(train_all, 4, {"tensor_parallel_degree": 2}, ("mlp",), timeout=300)[0])


def test_zero1_adamw_on_llama():
    """AdamW divides by each gradient's own scale, so a gradient entry near zero turns reduction-order
    rounding into a visible step: the whole model is compared at 1e-5 (norm of all differences over
    norm of all parameters), single tensors are not."""
    config = {"tensor_parallel_degree": 2, "shard_optimizer_state": True}
    _check(run_distributed(train_all, 4, config, ("llama",), "adamw", timeout=300)[0], per_tensor=False)


def _megatron_split(name: str) -> bool:
    """GPT-2 tensors split over TP: every projection weight and the embedding (tied to the head), and the
    MLP's column-parallel bias. Row-parallel biases stay whole, and so does the packed Q/K/V bias (tiny; a
    chunk-wise split would not compose with FSDP2's dim-0 sharding, see parallel/tensor/styles.py)."""
    module, kind = name.split(".")[-2:]
    return kind == "weight" and module in ("c_attn", "c_fc", "c_proj", "wte") or (module, kind) == ("c_fc", "bias")


def parameter_bytes() -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    sw.init({"tensor_parallel_degree": dist.get_world_size()})
    torch.manual_seed(0)
    reference = MODELS["gpt2"](256)
    names = {name: p.nbytes for name, p in reference.named_parameters()}
    model = sw.DistributedModel(reference)
    tracker = MemTracker()
    tracker.track_external(model)
    measured = sum(snapshot["Parameter"] for snapshot in tracker.get_tracker_snapshot().values())
    split = sum(b for n, b in names.items() if _megatron_split(n))
    return {"measured": measured, "split": split, "whole": sum(names.values()) - split}


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_holds_one_tp_th_of_split_layers_memtracker(tp):
    """MemTracker's parameter bytes on each rank = the unsplit tensors + 1/tp of the split ones, exactly
    (the tiny GPT-2's split dims all divide by 4)."""
    for result in run_distributed(parameter_bytes, tp):
        assert result["split"] > 4 * result["whole"]  # the split layers are most of the model
        assert result["measured"] == result["whole"] + result["split"] // tp


# Last: a world of eight stops the idle pools of four and two the tests above share.
@pytest.mark.slow
@pytest.mark.parametrize("prescaled", [False, True], ids=["own-rows", "prescaled"])
def test_mics_with_tp_on_8_ranks(prescaled):
    """TP 2 inside, MiCS over dp 4: partition groups of 2 sharded, replicated across the 2 groups."""
    config = {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": prescaled}
    _check(run_distributed(train_all, 8, config, timeout=600)[0])
