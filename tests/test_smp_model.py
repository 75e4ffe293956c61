"""SMP v1's `DistributedModel` arguments and methods and `set_activation_checkpointing`, in 2-rank worlds of
plain replicas (DDP), ZeRO-3 and tensor parallelism, against one plain process where numbers are concerned."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.config import IneffectiveSettingsWarning
from shardwise.parallel.recompute.apply import apply_activation_checkpointing
from shardwise.testing import run_distributed
from tiny_models import SEED, build, dataset, loss_fn, make_optimizer, relative_error, seed_step, train_reference

WORLD, ROWS, STEPS = 2, 2, 2
LAYOUTS = {
    "ddp": {},
    "zero3": {"sharded_data_parallel_degree": 2},
    "tp": {"tensor_parallel_degree": 2},
}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _copy(state: dict) -> dict:
    """A state dict's tensors copied: on the CPU torch's (and so SMP's) state dicts alias the live tensors."""
    return {name: value.clone() if torch.is_tensor(value) else value for name, value in state.items()}


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: _whole(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(relative_error(got[name], value) for name, value in want.items())


def _notices(build_model) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = build_model()
    return made, [str(w.message) for w in caught if issubclass(w.category, IneffectiveSettingsWarning)]


# ----- state dicts: SMP's meaning -----

def state_dicts(config: dict) -> dict:
    """Train, then: state_dict() whole; local_state_dict() pieces; both load back after the weights moved."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    batches = list(sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False))
    more = list(sw.data_loader(dataset("gpt2", ROWS * sw.dp_size(), seed=7), batch_size=ROWS, shuffle=False))

    def step(inputs, targets) -> None:
        opt.zero_grad()
        train_step(model, inputs, targets)
        opt.step()

    for batch in batches:
        step(*batch)
    full, local = _copy(model.state_dict()), _copy(model.local_state_dict())
    step(*more[0])
    probe = "transformer.h.0.mlp.c_fc.weight"
    moved = relative_error(model.state_dict()[probe], full[probe])
    model.load_state_dict(full)
    from_full = _copy(model.state_dict())
    step(*more[0])
    model.load_state_dict(local)
    from_local = model.state_dict()
    return {
        "full": full, "moved": moved, "from_full": from_full, "from_local": from_local,
        "plain_cpu": all(type(t) is torch.Tensor and t.device.type == "cpu" for t in full.values()),
        "partial": local.pop("_smp_is_partial"),
        "pieces": {name: tuple(t.shape) for name, t in local.items()},
        "local_plain": all(type(t) is torch.Tensor for t in local.values()),
        "nested": sorted(nn.ModuleDict({"wrapped": model}).state_dict()),
        "rank0_only": sorted(model.state_dict(gather_to_rank0=True)),
        "bad_shape": _error(lambda: model.load_state_dict({"transformer.wte.weight": torch.zeros(3)}, strict=False)),
        "unknown": _error(lambda: model.load_state_dict({**full, "extra.weight": torch.zeros(1)})),
        "unknown_lenient": model.load_state_dict({**full, "extra.weight": torch.zeros(1)}, strict=False),
        "alone": _state_dict_on_dp_rank0_alone(model) if config == {} else None,
    }


def _error(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as err:
        return str(err)
    return ""


def _state_dict_on_dp_rank0_alone(model) -> int:
    """As SMP scripts save: `if smp.dp_rank() == 0: model.state_dict()`; plain replicas need no other rank."""
    count = len(model.state_dict()) if sw.dp_rank() == 0 else 0
    dist.barrier()
    return count


@functools.cache
def gpt2_reference() -> dict:
    return train_reference("gpt2", "sgd", STEPS, ROWS * WORLD)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_dict_is_the_whole_model_and_both_kinds_load_back(layout):
    want = gpt2_reference()["state"]
    ranks = run_distributed(state_dicts, WORLD, LAYOUTS[layout], timeout=300)
    for rank, got in enumerate(ranks):
        assert list(got["full"]) == list(want) and got["plain_cpu"]
        assert all(got["full"][name].shape == value.shape for name, value in want.items())
        assert _worst(got["full"], want) < 1e-5
        assert got["moved"] > 1e-4
        assert all(torch.equal(got["from_full"][name], value) for name, value in got["full"].items())
        assert all(torch.equal(got["from_local"][name], value) for name, value in got["full"].items())
        assert got["partial"] is True and got["local_plain"] and set(got["pieces"]) == set(want)
        split = {name for name, shape in got["pieces"].items() if shape != tuple(want[name].shape)}
        assert bool(split) == (layout != "ddp"), split  # ZeRO-3 and tensor parallelism hold pieces
        assert got["nested"] == sorted(f"wrapped.{name}" for name in want)
        assert got["rank0_only"] == (sorted(want) if rank == 0 else [])
        assert "extra.weight" in got["unknown"] and "strict=False" in got["unknown"]
        assert got["unknown_lenient"].unexpected_keys == ["extra.weight"]
        if layout == "ddp":
            assert "size mismatch" in got["bad_shape"]
            assert got["alone"] == (len(want) if rank == 0 else 0)
        else:
            assert got["bad_shape"].startswith("load_state_dict: transformer.wte.weight has shape (3,)")


# ----- arguments that change the gradients -----

def gradient_arguments(config: dict) -> dict:
    """Side by side, on the same weights and batches (two microbatches each): the default model, one that sums
    its microbatches, one that synchronises every second step, and backward by outputs with their gradients."""
    sw.init({**config, "microbatches": 2})

    def made(**options):
        return sw.DistributedModel(build("gpt2", freeze_key_bias=True), **options)

    averaged, summed, deferred, by_outputs, by_loss = (
        made(), made(average_grads_across_microbatches=False), made(backward_passes_per_step=2), made(), made())
    train_step = seed_step("gpt2")
    first, second = sw.data_loader(dataset("gpt2", 2 * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False)

    @sw.step
    def outputs_step(model, inputs, targets):
        logits = model(inputs)["logits"]
        model.backward(logits, torch.full_like(logits, 1 / logits.numel()))

    @sw.step
    def mean_step(model, inputs, targets):
        model.backward(model(inputs)["logits"].mean())

    result = {}
    for name, model, batch in (("averaged_once", averaged, first), ("averaged_twice", averaged, second),
                               ("summed_once", summed, first), ("deferred_once", deferred, first),
                               ("deferred_twice", deferred, second)):
        train_step(model, *batch)
        result[name] = _gradients(model)
    outputs_step(by_outputs, *first)
    mean_step(by_loss, *first)
    return {**result, "by_outputs": _gradients(by_outputs), "by_loss": _gradients(by_loss)}


@functools.cache
def first_batch_gradients() -> dict[str, torch.Tensor]:
    model = build("gpt2", freeze_key_bias=True)
    loss_fn("gpt2", model, *dataset("gpt2", 2 * ROWS * WORLD)[:ROWS * WORLD]).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _fingerprint(gradients: dict[str, torch.Tensor]) -> float:
    return sum(float(g.double().abs().sum()) for g in gradients.values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_microbatch_sums_deferred_synchronisation_and_backward_by_outputs(layout):
    ranks = run_distributed(gradient_arguments, WORLD, LAYOUTS[layout], timeout=300)
    for got in ranks:
        assert _worst(got["averaged_once"], first_batch_gradients()) < 1e-5
        doubled = {name: 2 * g for name, g in got["averaged_once"].items()}
        assert _worst(got["summed_once"], doubled) < 1e-6
        assert _worst(got["deferred_twice"], got["averaged_twice"]) < 1e-6
        assert _worst(got["by_outputs"], got["by_loss"]) < 1e-6
    same_once = [_fingerprint(r["averaged_once"]) for r in ranks]
    deferred_once = [_fingerprint(r["deferred_once"]) for r in ranks]
    assert same_once[0] == pytest.approx(same_once[1], rel=1e-6)
    # Only DDP's replicas have a synchronisation to defer: each rank still holds its own batch's gradients.
    assert (deferred_once[0] != pytest.approx(deferred_once[1], rel=1e-3)) == (layout == "ddp")


# ----- hooks, local views, tensor-parallel queries, DDP's methods, notices -----

def hooks_and_queries(config: dict) -> dict:
    sw.init(config)
    model, notices = _notices(lambda: sw.DistributedModel(build("gpt2", freeze_key_bias=True), trace_device="cpu",
                                                          overlapping_allreduce=False, bucket_cap_mb=50))
    calls = []
    forwards = []
    model.get_module().register_forward_pre_hook(lambda *_: forwards.append(1))
    record = lambda kind: lambda m, o: calls.append((kind, m is model, o, m.partitioned, len(forwards)))  # noqa: E731
    model.register_post_partition_hook(record("partition"))
    model.register_post_partition_hook(record("removed")).remove()
    model.register_post_step_hook(record("step"))
    partitioned_before = model.partitioned
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    for inputs, targets in sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS):
        train_step(model, inputs, targets)
    model.register_post_partition_hook(record("late"))
    calls = [(kind, is_model, o is opt, partitioned, seen) for kind, is_model, o, partitioned, seen in calls]
    _, cpu_notices = _notices(model.cpu)
    _, join_notices = _notices(model.join)
    _, hook_notices = _notices(lambda: model.register_comm_hook(None, allreduce_hook))
    params = list(model.named_parameters())
    not_scalar = _error(lambda: model.backward(torch.ones(2, requires_grad=True)))
    return {
        "not_scalar": not_scalar,
        "notices": notices, "cpu": (model.cpu() is model, cpu_notices), "join": join_notices, "hook": hook_notices,
        "bucket_bytes": getattr(model.module, "bucket_bytes_cap", None),
        "partitioned": (partitioned_before, model.partitioned), "calls": calls,
        "local": ([n for n, _ in model.local_named_parameters()] == [n for n, _ in params]
                  and all(a is b for a, (_, b) in zip(model.local_parameters(), params))
                  and [n for n, _ in model.local_named_buffers()] == [n for n, _ in model.get_module().named_buffers()]
                  and len(list(model.local_buffers())) == len(list(model.get_module().buffers()))
                  and [n for n, _ in model.local_named_modules()] == [n for n, _ in model.get_module().named_modules()]
                  and next(model.local_modules()) is model.get_module()),
        "distributed": sorted(n for n, p in params if model.is_distributed_parameter(p)),
        "distributed_modules": sorted(n for n, m in model.get_module().named_modules()
                                      if any(m is d for d in model.distributed_modules())),
        "buffers_distributed": any(model.is_distributed_buffer(b) for b in model.buffers()),
        "scaled": [model.is_scaled_batch_parameter(p) for _, p in params],
        "scaled_buffers": [model.is_scaled_batch_buffer(b) for b in model.buffers()],
        "foreign_scaled": model.is_scaled_batch_parameter(nn.Parameter(torch.zeros(1))),
        "default": [n for n, _ in model.default_reducer_named_parameters()],
        "scaled_reducer": [n for n, _ in model.scaled_batch_reducer_named_parameters()],
        "names": [n for n, _ in params],
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hooks_local_views_and_tensor_parallel_queries(layout):
    ranks = run_distributed(hooks_and_queries, WORLD, LAYOUTS[layout], timeout=300)
    tp = layout == "tp"
    for rank, got in enumerate(ranks):
        assert got["partitioned"] == (False, True)
        assert "expects a scalar loss, got shape (2,)" in got["not_scalar"] and "model.backward(outputs, grads)" \
            in got["not_scalar"]
        # Before the first forward, with the optimizer; once; a removed hook never; one registered late at once.
        assert got["calls"] == [("partition", True, True, True, 0), ("step", True, True, True, 1),
                                ("late", True, True, True, STEPS)]
        assert got["local"]
        names = got["names"]
        assert bool(got["distributed"]) == tp and all(".attn." in n or ".mlp." in n or "wte" in n or "lm_head" in n
                                                      for n in got["distributed"])
        assert bool(got["distributed_modules"]) == tp and not got["buffers_distributed"]
        assert got["scaled"] == [tp] * len(names) and set(got["scaled_buffers"]) <= {tp}
        assert not got["foreign_scaled"]
        assert (got["default"], got["scaled_reducer"]) == (([], names) if tp else (names, []))
        assert got["cpu"] == (True, [])  # CPU ranks: the model is on the CPU already
        notices = got["notices"] + got["join"] + got["hook"]
        if rank != 0:  # one notice per world, from rank 0
            assert notices == []
            continue
        (notice,) = got["notices"]
        assert "trace_device=" in notice and "traced once on fake meta tensors" in notice and "overlapping_allreduce=" in notice
        if layout == "ddp":  # DDP takes bucket_cap_mb itself
            assert "bucket_cap_mb" not in notice and got["bucket_bytes"] == 50 * 2 ** 20
        else:
            assert "no DDP buckets in this layout" in notice
        if layout == "ddp":
            assert got["join"] == [] and got["hook"] == []
        else:
            assert "DistributedModel.join()" in got["join"][0] and "register_comm_hook()" in got["hook"][0]


def pipeline_views() -> dict:
    """Two pipeline stages: the hooks run from the schedule's step too; local views hold this rank's stage only."""
    from shardwise.parallel.pipeline.stage import Elsewhere

    sw.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    calls = []
    model.register_post_partition_hook(lambda m, o: calls.append("partition"))
    model.register_post_step_hook(lambda m, o: calls.append("step"))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    batches = list(sw.data_loader(dataset("gpt2", 3 * ROWS), batch_size=ROWS, shuffle=False))

    def step(index: int) -> None:
        opt.zero_grad()
        train_step(model, *batches[index])
        opt.step()

    step(0)
    full, local = _copy(model.state_dict()), _copy(model.local_state_dict())
    step(1)
    model.load_state_dict(full)
    from_full = _copy(model.state_dict())
    step(2)
    model.load_state_dict(local)
    return {"calls": calls, "full": full, "from_full": from_full, "from_local": model.state_dict(),
            "local": sorted(name for name in local if name != "_smp_is_partial"),
            "stand_ins": [n for n, m in model.get_module().named_modules() if isinstance(m, Elsewhere)],
            "modules": [n for n, _ in model.local_named_modules()]}


def test_pipeline_stages_load_whole_and_local_state_dicts_and_run_the_hooks():
    ranks = run_distributed(pipeline_views, WORLD, timeout=300)
    names = set(ranks[0]["full"])
    assert set(ranks[0]["local"]).isdisjoint(ranks[1]["local"])
    assert set(ranks[0]["local"]) | set(ranks[1]["local"]) == names
    for got in ranks:
        assert got["calls"] == ["partition", "step"]
        assert set(got["full"]) == names and set(got["local"]) < names
        assert all(torch.equal(got["from_full"][n], v) and torch.equal(got["from_local"][n], v)
                   for n, v in got["full"].items())
        assert got["stand_ins"] and not set(got["stand_ins"]) & set(got["modules"])


def ddp_join_and_comm_hook() -> dict:
    """Uneven batches under `join()`; a comm hook that averages over replicas and microbatches itself (SMP)."""
    sw.init({"microbatches": 2})
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    data = dataset("gpt2", 3 * ROWS)
    with model.join():
        for step in range(2 + sw.rank()):  # rank 1 takes a step more than rank 0
            opt.zero_grad()
            train_step(model, *data[step * ROWS:(step + 1) * ROWS])
            opt.step()
    joined = {name: p.detach().clone() for name, p in model.named_parameters()}

    def average(state, bucket):
        calls.append(bucket.index())
        tensor = bucket.buffer().div_(dist.get_world_size() * 2)  # replicas × microbatches
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])

    calls: list[int] = []
    plain, hooked = (sw.DistributedModel(build("gpt2", freeze_key_bias=True)) for _ in range(2))
    hooked.register_comm_hook(None, average)
    batch = data[sw.rank() * ROWS:(sw.rank() + 1) * ROWS]
    train_step(plain, *batch)
    train_step(hooked, *batch)
    return {"joined": joined, "calls": len(calls), "plain": _gradients(plain), "hooked": _gradients(hooked)}


def test_ddp_join_takes_uneven_batches_and_a_comm_hook_reduces():
    ranks = run_distributed(ddp_join_and_comm_hook, WORLD, timeout=300)
    assert all(torch.equal(ranks[0]["joined"][name], value) for name, value in ranks[1]["joined"].items())
    for got in ranks:
        assert got["calls"] > 0
        assert _worst(got["hooked"], got["plain"]) < 1e-6


def test_bad_arguments_are_named_before_anything_runs():
    with pytest.raises(ValueError, match="trace_device must be 'cpu' or 'gpu', got 'tpu'"):
        sw.DistributedModel(nn.Linear(2, 2), trace_device="tpu")
    with pytest.raises(ValueError, match="backward_passes_per_step must be a positive int, got 0"):
        sw.DistributedModel(nn.Linear(2, 2), backward_passes_per_step=0)


# ----- set_activation_checkpointing -----

class Layer(nn.Module):
    """Records each run of its forward (recomputation included) in `runs`."""

    def __init__(self, index: int, runs: list[int], dropout: float = 0.0):
        super().__init__()
        self.index, self.runs = index, runs
        self.linear, self.dropout = nn.Linear(8, 8), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.append(self.index)
        return self.dropout(torch.tanh(self.linear(x)))


class PairLayer(Layer):
    """Takes and returns a tuple, as SMP's `pack_args_as_tuple` is for."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, scale = pair
        return super().forward(x) * scale, scale


def _layers(kind=Layer, count: int = 4, dropout: float = 0.0) -> tuple[nn.Sequential, list[int]]:
    torch.manual_seed(SEED)
    runs: list[int] = []
    return nn.Sequential(*(kind(i, runs, dropout) for i in range(count))), runs


def _run(sequential: nn.Sequential, runs: list[int], pair: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """Which layers ran again in backward, in order, and the gradients (same dropout draws every call)."""
    torch.manual_seed(SEED)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = sequential((x, torch.full((1,), 2.0, requires_grad=True)) if pair else x)
    runs.clear()
    (out[0] if pair else out).square().sum().backward()
    return list(runs), [x.grad] + [p.grad for p in sequential.parameters()]


@pytest.mark.parametrize("strategy, recomputed", [("each", [3, 2, 1, 0]), ("contiguous", [0, 1, 2, 3]),
                                                  ("group_2", [2, 3, 0, 1]), ("group_3", [3, 0, 1, 2])])
def test_sequential_strategies_recompute_their_groups_with_the_same_gradients(strategy, recomputed):
    plain, runs = _layers()
    _, want = _run(plain, runs)
    layers, runs = _layers()
    assert apply_activation_checkpointing(layers, strategy=strategy) is layers
    order, got = _run(layers, runs)
    assert order == recomputed
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_preserve_rng_state_reaches_torch_checkpoint():
    plain, runs = _layers(dropout=0.5)
    _, want = _run(plain, runs)
    for preserve in (True, False):
        layers, runs = _layers(dropout=0.5)
        apply_activation_checkpointing(layers, preserve_rng_state=preserve, strategy="group_2")
        _, got = _run(layers, runs)
        # Replayed, the random state draws the forward's dropout masks again; not replayed, other ones.
        assert all(torch.equal(g, w) for g, w in zip(got, want)) == preserve


@pytest.mark.parametrize("pack", [True, False])
def test_layers_taking_tuples_need_no_packing(pack):
    plain, runs = _layers(PairLayer)
    _, want = _run(plain, runs, pair=True)
    layers, runs = _layers(PairLayer)
    apply_activation_checkpointing(layers, pack_args_as_tuple=pack, strategy="group_2")
    order, got = _run(layers, runs, pair=True)
    assert order == [2, 3, 0, 1] and all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_module_list_checkpoints_each_block_and_bad_strategies_are_named():
    blocks, runs = _layers()
    blocks = nn.ModuleList(blocks)
    sw.set_activation_checkpointing(blocks)
    x = torch.randn(3, 8, requires_grad=True)
    for block in blocks:
        x = block(x)
    runs.clear()
    x.sum().backward()
    assert runs == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="an nn.ModuleList's blocks are called one by one by its parent's forward"):
        sw.set_activation_checkpointing(blocks, strategy="group_2")
    with pytest.raises(ValueError, match="groups the layers of an nn.Sequential, and Linear is not one"):
        sw.set_activation_checkpointing(nn.Linear(2, 2), strategy="contiguous")
    with pytest.raises(ValueError, match=r"strategy must be 'each', 'contiguous' or 'group_<k>' .* got 'group_0'"):
        sw.set_activation_checkpointing(nn.Sequential(), strategy="group_0")

    class Doubled(nn.Sequential):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(ValueError, match="which Doubled overrides; pass strategy='each'"):
        sw.set_activation_checkpointing(Doubled(nn.Linear(2, 2)), strategy="group_2")


class SeqBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class SeqStack(nn.Module):
    """Token model whose blocks are an nn.Sequential; ZeRO-3 shards each block on its own (they are named as a
    Hugging Face model names its blocks), so a group's recomputation gathers its blocks again."""

    _no_split_modules = ["SeqBlock"]

    def __init__(self, layers: int = 4, hidden: int = 32):
        super().__init__()
        from tiny_models import VOCAB

        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.Sequential(*(SeqBlock(hidden) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> dict:
        return {"logits": self.head(self.norm(self.blocks(self.embed(ids))))}


STACK_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
STRATEGIES = ("each", "contiguous", "group_3")


def sequential_strategies(config: dict) -> dict:
    from torch.distributed.fsdp import FSDPModule

    sw.init(config)
    result = {}
    for strategy in STRATEGIES:
        torch.manual_seed(SEED)
        model = sw.DistributedModel(SeqStack(), tensor_parallel_plan=STACK_PLAN)
        sw.set_activation_checkpointing(model.get_module().blocks, strategy=strategy)
        opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
        train_step = seed_step("stack")
        for inputs, targets in sw.data_loader(dataset("stack", STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                              shuffle=False):
            opt.zero_grad()
            train_step(model, inputs, targets)
            opt.step()
        result[strategy] = _copy(model.state_dict())
        result["block_units"] = isinstance(model.get_module().blocks[0], FSDPModule)
        del model, opt  # one model at a time, as a script has it
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointing_strategies_train_as_one_process_without_checkpointing(layout):
    torch.manual_seed(SEED)
    want = train_reference("stack", "sgd", STEPS, ROWS * WORLD, model=SeqStack())["state"]
    for got in run_distributed(sequential_strategies, WORLD, LAYOUTS[layout], timeout=300):
        assert got["block_units"] == (layout == "zero3")
        for strategy in STRATEGIES:
            assert _worst(got[strategy], want) < 1e-5, strategy


def test_groups_never_span_a_stand_in_for_another_stages_layer():
    """Under a pipeline the layers another stage holds are stand-ins: "contiguous" is each run this rank holds."""
    from shardwise.parallel.pipeline.stage import Elsewhere

    layers, runs = _layers(count=5)
    layers[2] = Elsewhere(layers[2])
    apply_activation_checkpointing(layers, strategy="contiguous")
    x = torch.randn(3, 8, requires_grad=True)
    out = layers(x)
    runs.clear()
    out.sum().backward()
    # The stand-in's zeros cut the graph: only the run after it is recomputed, and none of it runs again before.
    assert runs == [3, 4] and x.grad is None


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def unused_parameter_steps() -> bool:
    """DDP's find_unused_parameters reaches DDP: a parameter forward never uses no longer stops the step."""
    sw.init({})
    torch.manual_seed(0)
    model = sw.DistributedModel(_WithUnused(), find_unused_parameters=True)
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @sw.step
    def train_step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    for _ in range(2):
        optimizer.zero_grad()
        train_step(model, torch.ones(2, 4))
        optimizer.step()
    used = model.get_module().used.weight.grad is not None
    sw.shutdown()
    return used


def test_ddp_arguments_reach_ddp():
    assert all(run_distributed(unused_parameter_steps, 2, timeout=300))


def caches(config: dict) -> tuple[bool, bool, bool]:
    """Whether a Hugging Face GPT-2 returns a key/value cache: training forward, evaluation, asked for in training."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2"))
    ids = dataset("gpt2", ROWS).tensors[0]
    training = model(ids)
    with torch.no_grad():
        evaluation = model(ids)
    asked = model(ids, use_cache=True)
    return tuple(out.past_key_values is not None for out in (training, evaluation, asked))


@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_a_training_forward_builds_no_key_value_cache(layout):
    """A cache would keep every block's keys and values to backward, and grow again as checkpointed blocks
    recompute; evaluation, and a caller who asks for one, still get it."""
    for got in run_distributed(caches, WORLD, LAYOUTS[layout], timeout=120):
        assert got == (False, True, True)
