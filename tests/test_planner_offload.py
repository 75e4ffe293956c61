"""The planner's optimizer-state offload: what goes to host memory, what crosses per step, and when it is proposed.

As parallel/sharding/optimizer_offload.py runs it: ZeRO-1 keeps its share's fp32 masters and
Adam's moments (12 bytes per parameter of the share) on the host; ZeRO-2/3 and MiCS
keep all model states there (16a/n). On a CPU device nothing moves, so the plan is
as without the key. tests/test_planner_measured.py checks the CPU runtime against
these predictions with MemTracker.
"""

from dataclasses import replace

import pytest

from shardwise.cli import main
from shardwise.config import parse_config
from shardwise.planner import cluster_preset, plan, predict_memory, predict_step_time, resolve_model
from shardwise.planner.offload import activation_transfers, state_transfers
from shardwise.planner.wrapping import optimizer_share
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster

A = 1_000_000_000  # parameters on a rank
SPEC = replace(resolve_model("gpt2"), parameters=A)
GPU = cluster_preset("p4d.24xlarge")
CPU = cluster_preset("local", devices_per_node=8)
ZERO1 = {"shard_optimizer_state": True, "bf16": True}
ZERO3 = {"sharded_data_parallel_degree": 8, "bf16": True}


def _memory(config: dict, device=GPU.device):
    parsed = parse_config(config)
    return predict_memory(SPEC, parsed, layout_for(parsed, Cluster(1, 8)), 1, 512, "each", device)


def test_zero1_keeps_its_shares_masters_and_moments_on_the_host():
    plain, offloaded = _memory(ZERO1), _memory({**ZERO1, "offload_optimizer_state": True})
    parsed = parse_config(ZERO1)
    share = optimizer_share(SPEC, parsed, layout_for(parsed, Cluster(1, 8)))
    assert offloaded.optimizer == 0 and offloaded.offloaded == pytest.approx(12 * A * share)
    assert (offloaded.parameters, offloaded.gradients) == (plain.parameters, plain.gradients)
    # with the fragmentation margin, and the step's temporaries, which the host's step holds instead
    assert offloaded.step_temporaries == 0 < plain.step_temporaries
    assert plain.total - offloaded.total == pytest.approx(12 * A * share * 1.10 + plain.step_temporaries)


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_layouts_keep_every_model_state_on_the_host(stage):
    config = {**ZERO3, "zero_stage": stage}
    plain, offloaded = _memory(config), _memory({**config, "offload_optimizer_state": True})
    assert offloaded.model_states == 0 and offloaded.offloaded == pytest.approx(16 * A / 8)
    assert offloaded.gathered_params == plain.gathered_params and offloaded.activations == plain.activations


def test_on_a_cpu_nothing_moves():
    """ZeRO-3 is predicted as without the key; fp32 ZeRO-1 steps masters of its share beside its parameters,
    which are 4 bytes per parameter of the share more than stepping the parameters."""
    zero3 = {"sharded_data_parallel_degree": 8}
    assert _memory({**zero3, "offload_optimizer_state": True}, CPU.device) == _memory(zero3, CPU.device)
    zero1 = {"shard_optimizer_state": True}
    offloaded = _memory({**zero1, "offload_optimizer_state": True}, CPU.device)
    assert offloaded.offloaded == 0 and offloaded.optimizer > _memory(zero1, CPU.device).optimizer


@pytest.mark.parametrize("config, gathers", [
    ({**ZERO3, "microbatches": 2}, 2),                  # ZeRO-3: every microbatch gathers forward and backward
    ({**ZERO3, "zero_stage": 2, "microbatches": 2}, 1),  # ZeRO-2 keeps the gathered blocks until backward
])
def test_sharded_offload_moves_shards_every_gather_and_gradient_shards_every_microbatch(config, gathers):
    parsed = parse_config({**config, "offload_optimizer_state": True})
    layout = layout_for(parsed, Cluster(1, 8))
    moved = state_transfers(SPEC, parsed, layout, GPU.device)
    assert moved.to_device == pytest.approx(2 * 4 / 8 * gathers * A)
    assert moved.to_host == pytest.approx(2 * 4 / 8 * A)
    assert state_transfers(SPEC, parsed, layout, CPU.device).total == 0


def test_zero1_moves_its_share_once_per_step():
    """fp32 gradients of the share to the host, its bf16 parameters back."""
    parsed = parse_config({**ZERO1, "offload_optimizer_state": True, "microbatches": 4})
    layout = layout_for(parsed, Cluster(1, 8))
    share = A * optimizer_share(SPEC, parsed, layout)
    assert state_transfers(SPEC, parsed, layout, GPU.device) == pytest.approx((2 * share, 4 * share))


def test_offloaded_activations_move_every_regions_input_both_ways():
    parsed = parse_config({"pipeline_parallel_degree": 2, "microbatches": 4, "offload_activations": True,
                           "bf16": True})
    layout = layout_for(parsed, Cluster(1, 8))
    moved = activation_transfers(SPEC, parsed, layout, 2, 512, "group_2", GPU.device)
    kept = 4 * (SPEC.layers // 2 // 2) * 2 * 512 * SPEC.hidden * 2  # microbatches × regions × tokens × hidden × bf16
    assert (moved.to_device, moved.to_host) == (kept, kept)
    assert activation_transfers(SPEC, parsed, layout, 2, 512, "none", GPU.device).total == 0
    assert activation_transfers(SPEC, parsed, layout, 2, 512, "group_2", CPU.device).total == 0


def test_offload_costs_time_on_a_gpu_and_none_on_a_cpu():
    for cluster, slower in ((GPU, True), (CPU, False)):
        times = []
        for offload in (False, True):
            parsed = parse_config({**ZERO3, "offload_optimizer_state": offload})
            times.append(predict_step_time(SPEC, parsed, layout_for(parsed, Cluster(1, 8)), cluster, 1, 512,
                                           "each"))
        assert (times[1].offload > 0, times[1].optimizer > times[0].optimizer) == (slower, slower)


def test_plan_offloads_only_where_a_layout_fits_only_so():
    """gpt2-30b on one p4d node: 30B parameters need 60 GB of model states per A100 under ZeRO-3 over 8; the
    plan offloads them, and no layout it offloads would fit without."""
    result = plan(resolve_model("gpt2-30b"), GPU, global_batch=8)
    offloaded = [e for e in result.fitting if e.config.get("offload_optimizer_state")]
    assert offloaded and result.best.config.get("offload_optimizer_state")
    fitting = {(tuple(sorted(e.config.items())), e.checkpointing) for e in result.fitting}
    for e in offloaded:
        without = {k: v for k, v in e.config.items() if k != "offload_optimizer_state"}
        assert (tuple(sorted(without.items())), e.checkpointing) not in fitting
    on_cpu = plan(resolve_model("gpt2:n_layer=4,n_embd=256,n_head=4"), CPU, global_batch=8)
    assert not any(e.config.get("offload_optimizer_state") for e in on_cpu.considered)


def test_the_table_names_offloaded_sharding(capsys):
    code = main(["plan", "--model", "gpt2-30b", "--cluster", "p4d.24xlarge", "--global-batch", "8", "--top", "3"])
    assert code == 0 and "offload" in capsys.readouterr().out
