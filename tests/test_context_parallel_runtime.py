"""Context parallelism through the runtime: `sw.init({"context_parallel_degree": n, ...})`, `DistributedModel`,
`@sw.step` and `DistributedOptimizer`, with the training loop of one process unchanged: whole rows into
`model(input_ids=..., labels=...)`, or into `model(input_ids)` with the loop's own loss over the logits.

On 4 gloo ranks, CP 2 beside two data-parallel replicas under DDP, ZeRO-1, ZeRO-2 (all-to-all) and ZeRO-3 (also
built with delayed initialisation, and with ZeRO++ hpZ), and CP 4 alone and under ZeRO-3 with every block
recomputed, CP 2 × TP 2 (ring; all-to-all with sequence parallelism under ZeRO-3) and CP 2 × PP 2 (ring with the
model's loss; all-to-all with the loop's own), Hugging Face Llama and GPT-2 train 3 SGD steps (packed documents in
some cases): losses and every parameter match one process that averages each replica's loss as data parallelism
does. Mixture-of-experts Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE with their experts split over ranks the cp axis
lends (EP × CP) train on their own loss from labels, load-balancing loss included, as one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.parallel.materialize import materialize
from shardwise.testing import run_distributed
import test_expert_parallel as experts_tests
from test_context_parallel import POSITIONS, SEQ, VOCAB, tiny
from test_expert_parallel_own_loss import train_on_own_loss
from tiny_models import dataset, relative_error

STEPS = 3
TOLERANCE = 2e-5


def _batch(step: int, rows: int, packed: bool) -> dict:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=generator)
    labels = ids.clone()
    labels[-1, -3:] = -100  # the last replica's row ends in padding
    return {"input_ids": ids, "labels": labels, "position_ids": POSITIONS[packed][:1].expand(rows, -1)}


def _built(kind: str, delayed: bool = False) -> torch.nn.Module:
    """The tiny model from seed 0: built whole, or (`delayed`) on the meta device, as one process then materialises
    it whole and delayed initialisation does unit by unit."""
    torch.manual_seed(0)
    if not delayed:
        return tiny(kind)
    with torch.device("meta"):
        model = tiny(kind)
    materialize(model, torch.device("cpu"), torch.initial_seed())
    return model


def _reference(kind: str, replicas: list[int], packed: bool, tp: int = 1,
               delayed: bool = False) -> tuple[torch.nn.Module, list[float]]:
    """One process over the same global batches, step s of `replicas[s]` replicas of `tp` rows each (a tensor-
    parallel group's rows are one batch), averaging the replicas' losses as data parallelism does."""
    reference = _built(kind, delayed)
    optimizer, losses = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), []
    for step, count in enumerate(replicas):
        batch = _batch(step, count * tp, packed)
        loss = sum(reference(**{k: v[r * tp:(r + 1) * tp] for k, v in batch.items()}, use_cache=False).loss
                   for r in range(count)) / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return reference, losses


def train_kind(kind: str, packed: bool, checkpoint: bool, steps: range = range(STEPS), earlier: tuple = (),
               save: str | None = None, resume: str | None = None, own_loss: bool = False,
               delayed: bool = False) -> float:
    """Train `steps` (after `earlier` steps' replica counts, resumed from `resume`; built on the meta device when
    `delayed`); the largest difference from one process in a loss or a parameter."""
    torch.manual_seed(0)
    if delayed:
        with sw.delay_param_initialization():
            module = tiny(kind)
    else:
        module = tiny(kind)
    model = sw.DistributedModel(module)
    # the attention is split (a model left whole on every cp rank would train the same math too)
    assert any(hasattr(m, "context_parallel") for m in model.get_module().modules()), "attention not split over cp"
    if checkpoint:
        for block in (model.get_module().transformer.h if kind == "gpt2" else model.get_module().model.layers):
            sw.set_activation_checkpointing(block)
    opt = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    if resume:
        sw.resume_from_checkpoint(resume)

    @sw.step
    def train_step(model, input_ids, labels, position_ids):
        if own_loss:  # the loop's own loss over the logits, which the model then returns whole
            logits = model(input_ids, position_ids=position_ids)["logits"]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        else:
            loss = model(input_ids=input_ids, labels=labels, position_ids=position_ids).loss
        model.backward(loss)
        return loss

    replicas, tp = sw.rdp_size(), sw.tp_size()  # each tensor-parallel rank brings its own row (SMP's dp rank)
    reference, want = _reference(kind, [*earlier, *[replicas] * len(steps)], packed, tp, delayed)
    errors = []
    for step in steps:
        batch = _batch(step, replicas * tp, packed)
        mine = {k: v[sw.dp_rank():sw.dp_rank() + 1] for k, v in batch.items()}
        loss = torch.as_tensor(train_step(model, **mine).reduce_mean()).detach().clone()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        errors.append(abs(loss.item() / sw.size() - want[step]))
    full = model.full_state_dict()
    errors += [((full[k] - v).norm() / v.norm().clamp_min(1e-3)).item() for k, v in reference.state_dict().items()]
    if save:
        sw.save_checkpoint(save, "saved")
    return max(errors)


def train_all(config: dict, kinds: tuple, packed: bool = False, checkpoint: bool = False, **resuming) -> dict:
    sw.init(config)
    delayed = config.get("delayed_parameter_initialization", False)
    return {kind: train_kind(kind, packed, checkpoint, delayed=delayed, **resuming) for kind in kinds}


CASES = {
    "cp2-ddp": ({"context_parallel_degree": 2}, False, False),
    "cp2-zero1-packed": ({"context_parallel_degree": 2, "shard_optimizer_state": True}, True, False),
    "cp2-zero2-all_to_all": ({"context_parallel_degree": 2, "context_parallel_mode": "all_to_all", "zero_stage": 2,
                              "sharded_data_parallel_degree": 2}, False, False),
    "cp2-zero3": ({"context_parallel_degree": 2, "sharded_data_parallel_degree": 2}, False, False),
    "cp4": ({"context_parallel_degree": 4}, False, False),
    "cp2-zero3-own-loss": ({"context_parallel_degree": 2, "sharded_data_parallel_degree": 2}, True, False),
    "cp4-zero3-checkpointing": ({"context_parallel_degree": 4, "zero_stage": 3}, True, True),
    # built on the meta device, each block materialised right before it is sharded over dp_shard × cp
    "cp2-zero3-delayed": ({"context_parallel_degree": 2, "sharded_data_parallel_degree": 2,
                           "delayed_parameter_initialization": True}, False, False),
    # ZeRO++ hpZ: secondary groups of 2 cut the sharding group of dp_shard 2 × cp 2
    "cp2-zero3-hpz2": ({"context_parallel_degree": 2, "zero_stage": 3, "zero_hpz_partition_size": 2}, False, False),
    "cp2-tp2": ({"context_parallel_degree": 2, "tensor_parallel_degree": 2}, True, False),
    "cp2-tp2-sp-zero3-all_to_all": ({"context_parallel_degree": 2, "tensor_parallel_degree": 2,
                                      "context_parallel_mode": "all_to_all", "sequence_parallel": True,
                                      "zero_stage": 3}, False, False),
    "cp2-pp2": ({"context_parallel_degree": 2, "pipeline_parallel_degree": 2}, True, False),
    "cp2-pp2-own-loss-all_to_all": ({"context_parallel_degree": 2, "pipeline_parallel_degree": 2,
                                     "context_parallel_mode": "all_to_all"}, False, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_math_as_one_process(name):
    config, packed, checkpoint = CASES[name]
    errors = run_distributed(train_all, 4, config, ("llama", "gpt2"), packed, checkpoint, own_loss="own" in name,
                             timeout=600)[0]
    assert max(errors.values()) < TOLERANCE, errors


def test_mics_partition_groups_span_the_cp_ranks():
    """CP 2 on 8 ranks under MiCS (partition groups of 2 data-parallel × 2 cp ranks, two groups) with the cross-group
    reduction deferred to the next forward: Llama trains as one process."""
    config = {"context_parallel_degree": 2, "sharded_data_parallel_degree": 2, "cross_group_overlap": "forward"}
    errors = run_distributed(train_all, 8, config, ("llama",), False, False, timeout=600)[0]
    assert max(errors.values()) < TOLERANCE, errors


def train_moe(family: str, config: dict) -> dict:
    """One rank: a tiny mixture-of-experts model trained on its replica's whole rows with its loss from labels
    (cross entropy plus the weighted load-balancing loss); the mean loss, this rank's load-balancing loss per step
    and the whole parameters."""
    sw.init(config)
    model = sw.DistributedModel(experts_tests._model(family))
    optimizer = sw.DistributedOptimizer(experts_tests._optimizer(model))

    world_rows = experts_tests.WORLD * experts_tests.ROWS  # one process's batch per step
    inputs, targets = dataset("llama", STEPS * world_rows).tensors
    return train_on_own_loss(model, optimizer, inputs, targets, world_rows, world_rows // sw.rdp_size())


MOE_CASES = {
    # ep over the two cp ranks of each replica; the replica check after every step
    "mixtral-cp2-ep2-zero3": ("mixtral", {"context_parallel_degree": 2, "sharded_data_parallel_degree": 2,
                                          "expert_parallel_degree": 2, "replica_check_interval": 1}),
    # one replica: the cp ranks alone make the global batch, and each expert share is sharded over two of them
    "qwen3_moe-cp4-ep2-zero3-all_to_all": ("qwen3_moe", {"context_parallel_degree": 4, "zero_stage": 3,
                                                         "context_parallel_mode": "all_to_all",
                                                         "expert_parallel_degree": 2}),
    # the other two families whose attention CP splits: experts over both replicas and both cp ranks
    "qwen2_moe-cp2-ep4-zero2": ("qwen2_moe", {"context_parallel_degree": 2, "zero_stage": 2,
                                             "expert_parallel_degree": 4}),
    "olmoe-cp2-ep2-zero3-all_to_all": ("olmoe", {"context_parallel_degree": 2, "sharded_data_parallel_degree": 2,
                                                 "context_parallel_mode": "all_to_all",
                                                 "expert_parallel_degree": 2}),
}


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_experts_split_over_the_cp_ranks_train_as_one_process(name):
    """Expert parallelism borrowing the cp ranks of the sharding group: every loss (with the load-balancing loss
    over the global batch), every rank's load-balancing loss and every parameter are one process's."""
    family, config = MOE_CASES[name]
    want = experts_tests.reference(family)
    for got in run_distributed(train_moe, 4, family, config, timeout=600):
        assert got["losses"] == pytest.approx(want["losses"], rel=experts_tests.TOLERANCE)
        assert got["aux"] == pytest.approx(want["aux"], rel=experts_tests.TOLERANCE)
        assert got["state"].keys() == want["state"].keys()
        for key, tensor in want["state"].items():
            assert relative_error(got["state"][key], tensor) <= experts_tests.TOLERANCE, key


def test_a_cp_checkpoint_resumes_at_another_cp_degree(tmp_path):
    """CP 2 under ZeRO-3 (two replicas) saves after 2 steps; CP 4 under DDP (one replica) resumes and trains the
    third: weights and momentum carry over, and every loss and parameter stays one process's."""
    saver = {"context_parallel_degree": 2, "sharded_data_parallel_degree": 2}
    first = run_distributed(train_all, 4, saver, ("llama",), steps=range(2), save=str(tmp_path), timeout=600)[0]
    then = run_distributed(train_all, 4, {"context_parallel_degree": 4}, ("llama",), steps=range(2, 3),
                           earlier=(2, 2), resume=str(tmp_path), timeout=600)[0]
    assert max(first.values()) < TOLERANCE and max(then.values()) < TOLERANCE, (first, then)
