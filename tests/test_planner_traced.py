"""The planner on models without a Hugging Face config: traced on the meta device, checked against MemTracker in one
process, and pipelined along the module-graph cut the runtime makes."""

import pytest
import torch
from torch import nn

from shardwise.config import parse_config
from shardwise.parallel.pipeline.graph_cut import cut_graph
from shardwise.planner import PlanError, cluster_preset, evaluate, predict_memory, resolve_model
from shardwise.topology import Layout
from test_planner_measured import CPU, StepMemory, _check
from tiny_models import CHANNELS, IMAGE, LABELS, TinyCNN

BATCH, WIDTH = 4, 64
CNN = "tiny_models:TinyCNN"
IMAGE_SHAPE = (CHANNELS, IMAGE, IMAGE)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


class MLP(nn.Module):
    """bench/link.py's model, 64 wide: repeated blocks of a linear layer and a ReLU, then a head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def example_inputs(batch, seq):
    """The convention `--model test_planner_traced:MLP` traces with: `seq` rows of WIDTH features per sample."""
    return {"x": torch.randn(batch, seq, WIDTH)}


CASES = {  # target, input shape, a real batch, its loss, sequence length
    "mlp": ("test_planner_traced:MLP", None, lambda: torch.randn(BATCH, 8, WIDTH),
            lambda out: out.square().mean(), 8),
    "cnn": (CNN, IMAGE_SHAPE, lambda: torch.randn(BATCH, *IMAGE_SHAPE),
            lambda out: nn.functional.cross_entropy(out["logits"], torch.arange(BATCH) % LABELS), 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_traced_models_match_memtracker_in_one_process(name):
    target, shape, make_batch, loss_of, seq = CASES[name]
    spec = resolve_model(target, input_shape=shape, seq=seq)
    torch.manual_seed(0)
    model = (MLP if name == "mlp" else TinyCNN)().train()
    batch = make_batch()
    measured = StepMemory.of_adamw_training(model, lambda: loss_of(model(batch)))
    assert spec.parameters == sum(p.numel() for p in model.parameters())
    _check(f"traced {name}", predict_memory(spec, parse_config({}), Layout(), BATCH, seq, device=CPU), measured)


def test_the_planner_pipelines_a_cnn_along_the_runtimes_module_graph_cut():
    spec = resolve_model(CNN, input_shape=IMAGE_SHAPE)
    assert spec.layers == 1 and spec.max_stages >= 4
    model = TinyCNN()
    cut = cut_graph(model, {"images": torch.zeros(2, *IMAGE_SHAPE)}, 2, parse_config({}).effective_memory_weight)
    runtime = [sum(p.numel() for unit, s in zip(cut.units, cut.stage_of_unit) if s == stage
                   for p in model.get_submodule(unit).parameters()) for stage in range(2)]
    assert [sum(stage.tensors) for stage in spec.graph_stages(2)] == runtime

    cluster = cluster_preset("local", devices_per_node=2)
    replicated = evaluate(spec, cluster, {}, global_batch=8)  # 4 samples a rank
    piped = evaluate(spec, cluster, {"pipeline_parallel_degree": 2, "microbatches": 2}, global_batch=8)  # 2 × 4
    assert piped.fits and piped.memory.parameters == 4 * max(runtime)  # fp32, the busiest stage's
    busiest = max(stage.forward_flops for stage in spec.graph_stages(2))
    assert piped.time.compute == pytest.approx(2 * replicated.time.compute * busiest / spec.traced.block_flops)


def test_a_module_without_inputs_is_refused_naming_both_ways_to_give_them():
    with pytest.raises(PlanError, match=r"TinyCNN has no Hugging Face config, so the planner traces its forward and "
                                        r"needs example inputs; pass --input-shape .* or define example_inputs"):
        resolve_model(CNN)
