"""One smoke test per private torch internal shardwise relies on (see `shardwise.torch_internals`).

Each checks the internal still exists and behaves as shardwise assumes, so a torch
upgrade that changes one fails here, by name, before it fails deep in a training run.
Most run in this process on a one-rank gloo group; the two that need several ranks to
mean anything run on two.
"""

import inspect
import io
import json
import pickle
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from transformers.modeling_outputs import CausalLMOutputWithPast

from shardwise.parallel.pipeline.schedule import EvalSafeStage
from shardwise.testing import run_distributed
from shardwise.torch_internals import (
    ATTENTION_KERNELS,
    active_saved_tensors_hooks,
    in_checkpointed_region,
    FakeTensorMode,
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    TorchDispatchMode,
    all_gather_base_op,
    all_reduce_sum,
    all_to_all_autograd,
    at_backward_end,
    children_table,
    clear_dtensor_caches,
    drop_forward_hooks,
    flash_attention_cpu,
    flash_attention_cpu_backward,
    flatten_mesh,
    foreach,
    functional_collective_ops,
    grad_scaler_state,
    layout_unpickler,
    process_groups,
    reduce_scatter_base_op,
    replicate,
    reshard_after_forward_over,
    ring_attention,
    ring_attention_backward,
    set_group_timeout,
    storage_id,
    strided_shard,
    style_input_fn,
    style_output_fn,
    tensor_tables,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_map_only,
    tree_unflatten,
    unflatten_mesh,
    unscale_and_check_,
    use_tensor_tables,
    version,
    view_base,
)


@pytest.fixture(scope="module")
def mesh():
    """A 1-D mesh over a one-rank gloo world in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    dist.destroy_process_group()
    clear_dtensor_caches()


# ----- fake tensors -----

def test_fake_tensor_mode_runs_a_meta_model_and_hugging_face_sees_it_tracing():
    """The pipeline's graph cut runs the model on fake meta tensors: shapes flow, no data, and Hugging Face's
    `is_tracing` takes them for a trace (so it skips its data-dependent checks)."""
    from transformers.utils.import_utils import is_tracing

    with torch.device("meta"):
        layer = nn.Linear(4, 3)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        out = layer(fake.from_tensor(torch.empty(2, 4, device="meta")))
        assert out.shape == (2, 3) and is_tracing(out)


# ----- pytree -----

def test_pytree_flattens_and_rebuilds_nested_outputs():
    tree = {"a": (torch.ones(1), 2), "b": [torch.zeros(2), None]}
    leaves, spec = tree_flatten(tree)
    assert [type(leaf) for leaf in leaves] == [torch.Tensor, int, torch.Tensor, type(None)]
    assert tree_unflatten(leaves, spec).keys() == tree.keys()
    assert tree_map(lambda x: 3, tree) == {"a": (3, 3), "b": [3, 3]}
    assert len(tree_leaves(tree)) == 4
    assert tree_map_only(torch.Tensor, lambda t: t.sum().item(), tree) == {"a": (1.0, 2), "b": [0.0, None]}


def test_pytree_knows_hugging_face_model_outputs():
    """A pipeline's last stage sends a ModelOutput's tensors and rebuilds it (transformers registers it)."""
    output = CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(2))
    leaves, spec = tree_flatten(output)
    assert len(leaves) == 2
    assert isinstance(tree_unflatten(leaves, spec), CausalLMOutputWithPast)


# ----- autograd -----

def test_at_backward_end_runs_once_after_every_gradient():
    """ZeRO-1's gradient buckets close a round from the first gradient hook of a backward pass."""
    first, second = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    seen = []
    first.register_post_accumulate_grad_hook(
        lambda p: at_backward_end(lambda: seen.append(first.grad is not None and second.grad is not None)))
    (first * 2 + second * 3).sum().backward()
    assert seen == [True]
    (first * 2 + second * 3).sum().backward()
    assert seen == [True, True]


def test_active_saved_tensors_hooks_and_checkpointed_regions_are_told_apart():
    """sequence_parallel_regather passes what it does not keep to the hooks active before it, and stands aside in a
    checkpointed region's forward and in its recomputation."""
    seen = []

    def pack(t):
        return t

    def unpack(t):
        return t

    def probe(x):
        seen.append(in_checkpointed_region())
        return x.sin()

    assert active_saved_tensors_hooks() is None and not in_checkpointed_region()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert active_saved_tensors_hooks() == (pack, unpack) and not in_checkpointed_region()
    x = torch.ones(2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(probe, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]   # forward, then the recomputation in backward


def test_version_counts_in_place_writes_of_a_tensor_and_its_views():
    t = torch.zeros(4)
    before = version(t)
    t.add_(1)
    t[:2].mul_(2)
    assert version(t) == before + 2
    _ = t * 2
    assert version(t) == before + 2
    model = nn.Linear(2, 2)
    before = version(model.weight)
    model.load_state_dict(nn.Linear(2, 2).state_dict())
    assert version(model.weight) > before


def test_version_of_a_dtensor_counts_writes_through_it_not_its_local_tensor(mesh):
    """A write through a DTensor (load_state_dict into a tensor-parallel parameter) bumps the DTensor's
    counter only: a check for changes must read the parameter's own counter, not its local tensor's."""
    param = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    before, local_before = version(param), version(param.to_local())
    with torch.no_grad():
        param.copy_(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    assert version(param) == before + 1
    assert version(param.to_local()) == local_before
    assert param.to_local().eq(1).all()


def test_storage_id_is_shared_by_views_and_view_base_leads_back_to_the_viewed_tensor():
    """The graph cut counts each block of saved memory once, and a parameter seen through a view as no activation,
    on fake tensors."""
    with FakeTensorMode():
        whole, other = torch.empty(4, 4), torch.empty(4, 4)
        view = whole[1:]
        assert storage_id(view) == storage_id(whole) != storage_id(other)
        assert view_base(view) is whole and view_base(whole) is whole
    weight = nn.Parameter(torch.ones(2, 2))
    assert view_base(weight.t()) is weight and view_base(weight.t()).is_leaf


# ----- DTensor and DeviceMesh -----

def _flattened() -> dict:
    world = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("a", "b", "c"))
    flat = flatten_mesh(world["a", "b"], "ab")
    return {"names": flat.mesh_dim_names, "shape": tuple(flat.shape), "ranks": flat.mesh.tolist(),
            "group_size": dist.get_world_size(flat.get_group()),
            "inner": tuple(flatten_mesh(world["b", "c"], "bc").shape)}


def _exchanged() -> dict:
    rank = dist.get_rank()
    rows = torch.arange(3.0 if rank == 0 else 2.0).add(10 * rank).unsqueeze(-1).requires_grad_()
    # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 1 to rank 0 and 1 to itself
    sent, received = ([1, 2], [1, 1]) if rank == 0 else ([1, 1], [2, 1])
    got = all_to_all_autograd(rows, received, sent, dist.group.WORLD)
    (got * torch.arange(1.0, got.shape[0] + 1).unsqueeze(-1)).sum().backward()
    return {"got": got.flatten().tolist(), "grad": rows.grad.flatten().tolist(),
            "sum": all_reduce_sum(torch.tensor([rank + 1.0]), dist.group.WORLD).item()}


def test_all_to_all_autograd_sends_uneven_splits_and_returns_gradients_by_the_reverse_exchange():
    first, second = run_distributed(_exchanged, 2)
    assert first == {"got": [0.0, 10.0], "grad": [1.0, 1.0, 2.0], "sum": 3.0}
    assert second == {"got": [1.0, 2.0, 11.0], "grad": [2.0, 3.0], "sum": 3.0}


def test_flatten_mesh_gives_one_axis_over_the_product_of_the_axes():
    for got in run_distributed(_flattened, 2):
        assert got == {"names": ("ab",), "shape": (2,), "ranks": [0, 1], "group_size": 2, "inner": (1,)}


def _resharded_after_forward() -> dict:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    split = unflatten_mesh(mesh, "shard", (2, 2), ("outer", "inner"))
    secondary = split["outer", "inner"]
    made = len(process_groups())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with reshard_after_forward_over(secondary):
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    loss = model(torch.ones(2, 4)).sum()
    after_forward = [[p.device_mesh.mesh.tolist(), p.to_local().numel()] for p in model.parameters()]
    loss.backward()
    return {"secondary": secondary.mesh.tolist(), "shard_still_sliceable": mesh["shard"].size(),
            "new_groups": len(process_groups()) - made, "after_forward": after_forward,
            "after_backward": sorted({p.device_mesh.ndim for p in model.parameters()})}


def test_reshard_after_forward_over_keeps_each_unit_on_the_shared_secondary_groups():
    """Forward leaves every parameter half-held on the 2-D (outer, inner) mesh made once, without a process group
    per unit; backward gathers from there and re-shards over the whole group."""
    ranks = run_distributed(_resharded_after_forward, 4)
    for rank, got in enumerate(ranks):
        pair = [[0, 1], [2, 3]]
        assert got["secondary"] == pair and got["shard_still_sliceable"] == 4 and got["new_groups"] == 0
        assert got["after_forward"] == [[pair, 8], [pair, 2]] * 2  # each layer's weight (16) and bias (4)
        assert got["after_backward"] == [1]


# torch 2.11 (the lent GPU machine's) has the internals but not these two behaviours (docs/torch.md): its DTensor
# redistribution reads a lone _StridedShard as a shard order and refuses it; its pipeline schedules exchange shapes
# between a rank's own V-shaped stages over the process group, which gloo refuses.
BEFORE_2_13 = torch.__version__ < "2.13"


def _strided_local() -> dict:
    mesh = init_device_mesh("cpu", (2,))
    packed = torch.arange(12.0).reshape(2, 6)  # three chunks of two columns side by side (Q, K, V)
    shard = distribute_tensor(packed, mesh, [strided_shard(1, 3)])
    return {"local": shard.to_local()[0].tolist(), "whole": bool(shard.full_tensor().equal(packed))}


@pytest.mark.xfail(BEFORE_2_13, strict=True, reason="torch 2.11: a lone _StridedShard cannot be redistributed")
def test_strided_shard_cuts_each_chunk_and_reassembles_in_order():
    assert run_distributed(_strided_local, 2) == [{"local": [0.0, 2.0, 4.0], "whole": True},
                                                  {"local": [1.0, 3.0, 5.0], "whole": True}]


def test_strided_shard_is_a_sharding_placement_that_is_no_plain_shard():
    """Clipping counts every placement but Replicate as sharded; a strided shard is neither Shard nor Replicate."""
    placement = strided_shard(1, 3)
    assert not isinstance(placement, Shard)
    assert not placement.is_replicate() and not placement.is_partial()
    assert (placement.dim, placement.split_factor) == (1, 3)


def test_clear_dtensor_caches_empties_them_and_dtensor_still_works(mesh):
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    t = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    assert (t + 1).redistribute(mesh, [Shard(0)]).placements == (Shard(0),)
    MeshTopoInfo.build_from_mesh(mesh)  # what sharding propagation's cost model caches per mesh
    clear_dtensor_caches()
    assert _redistribute._gen_transform_infos.cache_info().currsize == 0
    assert MeshTopoInfo.build_from_mesh.cache_info().currsize == 0
    assert (t + 1).redistribute(mesh, [Shard(0)]).to_local().eq(2).all()


# ----- multi-tensor ops -----

def test_foreach_ops_compute_per_tensor_in_place_or_new_on_plain_and_dtensor_lists(mesh):
    """LAMB and NovoGrad step with these: each acts on every tensor of the list, the `_` ones in place, and a
    DTensor list keeps its placements (the norms come back partial, to be reduced over the mesh)."""
    a, b = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])], [torch.tensor([1.0, 2.0]), torch.tensor([2.0])]
    assert [n.item() for n in foreach.norm(a, 2.0, dtype=torch.float64)] == [5.0, 1.0]
    halves = foreach.div(a, 2.0)
    assert [t.tolist() for t in halves] == [[1.5, 2.0], [0.5]] and a[0].tolist() == [3.0, 4.0]
    foreach.add_(a, b, alpha=2.0)  # a = [5, 8], [5]
    foreach.sub_(a, b)  # [4, 6], [3]
    foreach.mul_(a, 2.0)  # [8, 12], [6]
    foreach.div_(a, b)  # [8, 6], [3]
    foreach.addcmul_(a, b, b, value=0.5)  # [8.5, 8], [5]
    foreach.add_(a, 1.0)  # [9.5, 9], [6]
    assert [t.tolist() for t in foreach.add(a, 0.5)] == [[10.0, 9.5], [6.5]] and a[1].item() == 6.0
    assert [t.tolist() for t in foreach.sqrt([torch.tensor([9.0])])] == [[3.0]]
    foreach.sqrt_(b)
    assert [t.tolist() for t in a] == [[9.5, 9.0], [6.0]] and b[1].item() == pytest.approx(2 ** 0.5)
    foreach.copy_(b, [torch.zeros(2), torch.ones(1)])
    assert [t.tolist() for t in b] == [[0.0, 0.0], [1.0]]
    shards = [distribute_tensor(torch.tensor([3.0, 4.0]), mesh, [Shard(0)])]
    norm = foreach.norm(shards, 2.0)[0]
    assert isinstance(norm, DTensor) and norm.placements[0].is_partial() and norm.full_tensor().item() == 5.0
    foreach.mul_(shards, 2.0)
    assert shards[0].placements == (Shard(0),) and shards[0].full_tensor().tolist() == [6.0, 8.0]


# ----- tensor-parallel styles -----

def test_parallel_style_apply_is_the_hook_parallelize_module_calls(mesh):
    assert getattr(ParallelStyle._apply, "__isabstractmethod__", False)
    applied = []

    class Recording(ParallelStyle):
        def _apply(self, module, device_mesh):
            applied.append((module, device_mesh))
            return module

    module = nn.Linear(2, 2)
    parallelize_module(module, mesh, Recording())
    assert applied == [(module, mesh)]


def test_style_hooks_turn_inputs_into_dtensors_and_outputs_back(mesh):
    colwise, rowwise, module = ColwiseParallel(), RowwiseParallel(), nn.Linear(4, 4)
    rowwise.desired_input_layouts = (Shard(-1),)  # torch's _apply sets it per module, as styles.Rowwise does
    x = torch.ones(2, 4)
    into_col = style_input_fn(colwise)(module, (x,), mesh)
    into_row = style_input_fn(rowwise)(module, (x,), mesh)
    assert isinstance(into_col, DTensor) and into_col.placements == (Replicate(),)
    assert isinstance(into_row, DTensor) and into_row.placements == (Shard(1),)  # the last dim of 2
    out = style_output_fn(colwise)(module, DTensor.from_local(x, mesh, [Shard(-1)]), mesh)
    assert type(out) is torch.Tensor and out.equal(x)


# ----- FSDP2 and the gradient scaler -----

def test_replicate_wraps_a_module_with_replicated_dtensor_parameters(mesh):
    assert {"mesh", "mp_policy"} <= set(inspect.signature(replicate).parameters)
    model = replicate(nn.Linear(2, 2), mesh=mesh)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in model.parameters())
    model.set_requires_gradient_sync(True)
    model(torch.ones(3, 2)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_unscale_and_check_scales_in_place_and_flags_non_finite_values():
    grads, found = [torch.tensor([2.0, 4.0])], torch.zeros(1)
    unscale_and_check_(grads, found, torch.tensor(0.5))
    assert grads[0].tolist() == [1.0, 2.0] and found.item() == 0
    unscale_and_check_([torch.tensor([float("inf")])], found, torch.tensor(0.5))
    assert found.item() == 1


def test_sharded_grad_scaler_unscales_through_its_overridable_hook(mesh):
    """precision.LossScaler overrides `_unscale_grads_` and reads `_scale`."""
    assert list(inspect.signature(ShardedGradScaler._unscale_grads_).parameters) == [
        "self", "optimizer", "inv_scale", "found_inf", "allow_fp16"]
    calls = []

    class Recording(ShardedGradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            calls.append(self._scale.device)
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = Recording(device="cpu", process_group=dist.group.WORLD)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    assert calls == [torch.device("cpu")]


def _recorded(scaler: torch.amp.GradScaler, steps: int) -> list[float]:
    """The scale after each of `steps` finite steps."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    for _ in range(steps):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_grad_scaler_state_is_what_a_grad_scaler_saves_and_restarts_its_growth_count():
    """precision.LossScaler loads it to start a scale rule: the growth count starts again from 0."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=100)
    _recorded(scaler, 2)
    assert scaler.state_dict()["_growth_tracker"] == 2
    assert set(scaler.state_dict()) == set(grad_scaler_state(4.0, 2.0, 0.5, 3))
    scaler.load_state_dict(grad_scaler_state(4.0, 2.0, 0.5, 3))
    assert _recorded(scaler, 3) == [4.0, 4.0, 8.0]


# ----- pipelining -----

def _v_schedule(stage_class: type, train: bool) -> None:
    """Two stages on this one rank, V-shaped: the gradient hand-over between them stays on the rank."""
    stages = [stage_class(nn.Linear(4, 4), i, 2, torch.device("cpu"), group=dist.group.WORLD) for i in range(2)]
    schedule = ScheduleZBVZeroBubble(stages, 2, loss_fn=lambda output, target: output.sum(), scale_grads=False)
    if train:
        schedule.step(torch.ones(2, 4), target=torch.zeros(2), return_outputs=False)
    else:
        with torch.no_grad():
            schedule.eval(torch.ones(2, 4), target=torch.zeros(2), return_outputs=False)


@pytest.mark.xfail(BEFORE_2_13, strict=True, reason="torch 2.11: V-shaped schedules send to the rank's own stage")
def test_pipeline_stage_members_the_eval_safe_stage_overrides(mesh):
    """The V-shaped schedule calls exactly the members EvalSafeStage overrides; torch's own stage still
    asserts a backward pass in evaluation (when it stops, EvalSafeStage can go)."""
    for name in ("get_local_bwd_output", "set_local_bwd_input"):
        assert callable(getattr(PipelineStage, name))
    assert isinstance(inspect.getattr_static(PipelineStage, "has_backward"), property)
    with pytest.raises(AssertionError, match="doesn't have backward"):
        _v_schedule(PipelineStage, train=False)
    _v_schedule(EvalSafeStage, train=False)
    _v_schedule(EvalSafeStage, train=True)


# ----- nn.Module -----

def test_drop_forward_hooks_removes_the_hooks_a_parallel_style_registers(mesh):
    layer = nn.Linear(4, 4)
    parallelize_module(layer, mesh, ColwiseParallel())
    x = torch.ones(2, 4)
    assert type(layer(x)) is torch.Tensor  # the style's hooks turn the input into a DTensor and the output back
    drop_forward_hooks(layer)
    assert not (layer._forward_pre_hooks or layer._forward_pre_hooks_with_kwargs or layer._forward_hooks
                or layer._forward_hooks_with_kwargs)
    assert type(layer.weight) is DTensor  # the split weight stays


def test_children_table_edits_a_module_list_without_renumbering():
    blocks = nn.ModuleList(nn.Linear(1, 1) for _ in range(4))
    children = children_table(blocks)
    assert any(value is children for value in vars(blocks).values())  # what a shallow fork copies
    del children["1"]
    children["3"] = nn.Identity()
    assert [name for name, _ in blocks.named_children()] == ["0", "2", "3"]
    assert [name.split(".")[0] for name, _ in blocks.named_parameters()] == ["0", "0", "2", "2"]


def test_tensor_tables_are_what_a_module_shows_and_saves():
    norm = nn.BatchNorm1d(2)
    parameters, buffers, non_persistent = tensor_tables(norm)
    assert parameters["weight"] is norm.weight and buffers["running_mean"] is norm.running_mean
    norm.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert "scratch" in non_persistent

    shell = nn.Module()
    use_tensor_tables(shell, {"w": nn.Parameter(torch.ones(1))}, {"b": torch.zeros(1), "tmp": torch.ones(1)}, {"tmp"})
    assert [name for name, _ in shell.named_parameters()] == ["w"] and shell.b is tensor_tables(shell)[1]["b"]
    assert list(shell.state_dict()) == ["w", "b"]  # the non-persistent buffer is not saved
    shell.w = nn.Parameter(torch.full((1,), 2.0))  # attribute writes land in the given table
    assert tensor_tables(shell)[0]["w"].item() == 2.0


# ----- process groups and the flight recorder -----

FLIGHT_RECORDER_SCRIPT = """
import json, os
os.environ["TORCH_FR_BUFFER_SIZE"] = "4"
import torch, torch.distributed as dist
from shardwise.torch_internals import flight_recorder_trace

def collectives():
    dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(2), group=group)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = dist.new_group([0], group_desc="second")
for _ in range(3):
    collectives()
trace = flight_recorder_trace()
print(json.dumps({"status": trace["pg_status"], "entries": [
    {"op": e["profiling_name"], "group": list(e["process_group"]), "seq": e["collective_seq_id"],
     "stack": [f["name"] for f in e["frames"]]} for e in trace["entries"]]}))
"""


def test_flight_recorder_trace_lists_recent_collectives_with_group_sequence_and_stack_on_gloo():
    """Hang reports read each rank's recent collectives, and how far it got in each group, from it."""
    done = subprocess.run([sys.executable, "-c", FLIGHT_RECORDER_SCRIPT], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    trace = json.loads(done.stdout.splitlines()[-1])
    assert [entry["seq"] for entry in trace["entries"]] == [2, 2, 3, 3]  # the buffer keeps the newest 4
    assert [entry["group"] for entry in trace["entries"]][:2] == [["0", "default_pg"], ["1", "second"]]
    assert {entry["op"] for entry in trace["entries"]} == {"gloo:all_reduce"}
    assert all("collectives" in entry["stack"] for entry in trace["entries"])
    assert {name: status["last_enqueued_collective"] for name, status in trace["status"].items()} == {"0": 3, "1": 3}


def _group_timeout() -> dict:
    group = dist.new_group([0, 1], group_desc="pair")
    name, (found, desc, ranks) = next((n, g) for n, g in process_groups().items() if g[0] is group)
    set_group_timeout(group, timedelta(seconds=1))
    error = None
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="Timed out") as raised:
            dist.all_reduce(torch.ones(1), group=group)
        error = str(raised.value)
    else:
        time.sleep(4)
    return {"desc": desc, "ranks": ranks, "world_listed": dist.group.WORLD in [g for g, _, _ in
                                                                               process_groups().values()],
            "error": error}


def test_set_group_timeout_shortens_a_new_groups_wait_and_process_groups_lists_it():
    """A group made after the world waits torch's 30 minutes unless its timeout is set."""
    first, second = run_distributed(_group_timeout, 2, timeout=120)
    assert first["desc"] == "pair" and first["ranks"] == [0, 1] and first["world_listed"]
    assert "Timed out waiting 1000ms" in first["error"], first  # gloo names the timeout it waited


def test_torch_dispatch_mode_sees_every_aten_call():
    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Recording() as recording:
        torch.ones(2).add_(1)
    assert torch.ops.aten.add_.Tensor in recording.ops


def _dispatched(run: Callable[[], Any]) -> list[Any]:
    """The op packets `run` dispatches, in order."""
    ops = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    with Recording():
        run()
    return ops


def test_collectives_dispatch_as_the_ops_observe_comms_names(mesh):
    """observe/comms.py tells collectives by these op names and the functional collectives' namespace."""
    gathered, scattered = torch.zeros(2), torch.zeros(1)
    assert all_gather_base_op in _dispatched(lambda: dist.all_gather_into_tensor(gathered, torch.ones(2)))
    assert reduce_scatter_base_op in _dispatched(lambda: dist.reduce_scatter_tensor(scattered, torch.ones(1)))
    functional = _dispatched(lambda: all_reduce_sum(torch.ones(2), mesh.get_group()))
    assert functional_collective_ops.all_reduce in functional  # its op's namespace is the one comms.py looks for
    assert functional_collective_ops.all_reduce.default.namespace == functional_collective_ops.name


# ----- selective recompute -----

def test_attention_kernels_hold_what_sdpa_runs_and_op_classes_tell_overloads_from_packets():
    q = torch.randn(1, 2, 4, 8)
    kernels = _dispatched(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ATTENTION_KERNELS
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in kernels
    assert all(isinstance(op, OpOverload) for op in ATTENTION_KERNELS)
    assert isinstance(torch.ops.aten.mm, OpOverloadPacket) and not isinstance(torch.ops.aten.mm, OpOverload)
    assert isinstance(torch.ops.higher_order.cond, HigherOrderOperator)
    assert isinstance(functional_collective_ops.all_reduce.default, OpOverload)


# ----- checkpoint metadata -----

def test_layout_unpickler_is_the_one_function_a_pickled_layout_names():
    """checkpoint/storage.py's metadata unpickler lets it, and nothing else of torch.serialization, through."""
    found = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.append((module, name))
            return super().find_class(module, name)

    assert Recording(io.BytesIO(pickle.dumps(torch.sparse_coo))).load() is torch.sparse_coo
    assert found == [(layout_unpickler.__module__, layout_unpickler.__name__)]


# ----- context parallelism -----


def test_flash_attention_cpu_gives_sdpa_output_logsumexp_and_gradients():
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 4, 8) for _ in range(4))
    out, lse = flash_attention_cpu(q, k, v, is_causal=True, attn_mask=None, scale=0.5)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.5).backward(grad)
    grads = flash_attention_cpu_backward(grad, q, k, v, out, lse, is_causal=True, attn_mask=None, scale=0.5)
    assert all(torch.allclose(got, leaf.grad, atol=1e-6) for got, leaf in zip(grads, leaves))


def test_ring_attention_calls_the_block_and_returns_output_logsumexp_and_gradients(mesh):
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 4, 8) for _ in range(4))
    group = mesh.get_group()
    out, lse = ring_attention(group, flash_attention_cpu, q, k, v, True, scale=0.5, attn_mask=None)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5),
                          atol=1e-6)
    grads = ring_attention_backward(group, flash_attention_cpu_backward, grad, q, k, v, out, lse, True, scale=0.5,
                                    attn_mask=None)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, flash_attention_cpu_backward(
        grad, q, k, v, out, lse, is_causal=True, attn_mask=None, scale=0.5)))


# ----- tests and bench only -----

def test_mem_tracker_counts_parameters_and_gradients_by_category():
    from torch.distributed._tools.mem_tracker import MemTracker

    model = nn.Linear(4, 4)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(torch.ones(2, 4)).sum().backward()
    by_category = tracker.get_tracker_snapshot()[torch.device("cpu")]
    assert by_category["Parameter"] == by_category["Gradient"] == 20 * 4  # 16 weights and 4 biases, fp32
    assert tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] > 0
