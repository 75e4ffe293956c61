"""DeepSpeed's PipelineModule (shardwise.deepspeed.pipe) on shardwise's pipeline.

- The stage boundaries are DeepSpeed's for the same layers, for 'parameters', 'uniform' and 'type:REGEX':
  hard-coded (worked out by hand below) and, where deepspeed is installed, DeepSpeed's own
  `PipelineModule._partition_layers` on the same layers built from deepspeed's LayerSpecs; the ported
  `partition_balanced` agrees with deepspeed's on random weights.
- Same math as one process (a PipelineModule of one stage, plain torch, SGD with momentum) for several
  steps, through the plain sw API (sw.init, DistributedModel, @sw.step, DistributedOptimizer): a stack of
  LayerSpecs, a module instance, a lambda and parameter-free modules, on pp 2 (each method) and pp 2 × dp 2;
  a language model whose embedding is tied to its output projection (TiedLayerSpec with forward_fn) across
  the two stages; and activation_checkpoint_interval 3, whose regions recompute each layer once per
  microbatch (one region starts at stage 1's first layer, which receives stage 0's output). Each rank
  holds exactly its stage's layers. Losses 1e-5 relative; every parameter
  ‖got − want‖ / max(‖want‖, 1e-3) ≤ 1e-5.
- Every bad input is one line naming the fix.

The helpers (`build_module`, `dataset`, `reference`, KINDS) are meant for the engine's tests too.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import shardwise as sw
from shardwise.deepspeed.pipe import (LayerSpec, PipeDataParallelTopology, PipeModelDataParallelTopology,
                                      PipelineModule, ProcessTopology, TiedLayerSpec, partition_balanced,
                                      partition_uniform)
from shardwise.parallel.materialize import materialize
from shardwise.parallel.pipeline import find_blocks
from shardwise.parallel.pipeline import partition as cut
from shardwise.parallel.pipeline.stage import StageModule, stage_view
from shardwise.testing import run_distributed
from tiny_models import make_optimizer, relative_error

SEED = 1234
IN, HIDDEN, OUT, VOCAB, SEQ = 8, 16, 4, 32, 6
ROWS = 8  # per data-parallel rank and step
STEPS = 3
MICROBATCHES = 2
TOLERANCE = 1e-5


class Block(nn.Module):
    """A residual MLP: 2 × (16·16 + 16) = 544 parameters at width 16."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def stack_layers() -> list:
    """8 layers as DeepSpeed's examples mix them: LayerSpecs, a built module, a lambda, parameter-free modules.

    Trainable parameters per layer: 144, 0, 544, 544, 0, 544, 0, 68.
    """
    return [LayerSpec(nn.Linear, IN, HIDDEN), nn.ReLU(), LayerSpec(Block, HIDDEN), Block(HIDDEN),
            lambda x: x * 0.5, LayerSpec(Block, HIDDEN), nn.Tanh(), LayerSpec(nn.Linear, HIDDEN, OUT)]


def tied_layers() -> list:
    """A language model whose token embedding (512 parameters) is its output projection too:
    512, 544, 544, 32, 512 by layer, so 'parameters' cuts after the first Block and the tie spans both stages."""
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN), LayerSpec(Block, HIDDEN), LayerSpec(Block, HIDDEN),
            LayerSpec(nn.LayerNorm, HIDDEN),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=lambda emb, x: x @ emb.weight.t())]


class MaskedBlock(nn.Module):
    """Takes and returns (hidden, mask), as Megatron's pipeline layers pass an attention mask along."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = pair
        return x + torch.tanh(self.fc(x)) * mask, mask


def pair_layers() -> list:
    """A (hidden, mask) tuple from layer 1 to layer 4, so across the stages ('parameters' cuts after layer 2:
    144, 0, 272 | 272, 0, 68). The mask is a float tensor no gradient flows into."""
    return [LayerSpec(nn.Linear, IN, HIDDEN), lambda x: (x, (x.detach() > 0).float()), LayerSpec(MaskedBlock, HIDDEN),
            LayerSpec(MaskedBlock, HIDDEN), lambda pair: pair[0], LayerSpec(nn.Linear, HIDDEN, OUT)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


KINDS = {"stack": (stack_layers, F.mse_loss), "tied": (tied_layers, lm_loss), "pair": (pair_layers, F.mse_loss)}

# DeepSpeed's boundaries for 2 stages, by hand. Stack, 'parameters': the split whose stages differ least is
# after layer 2 (688 | 1156: 468 apart; after 3 or 4, 1232 | 612). 'uniform': 8 layers, 4 each.
# 'type:block' weighs the Blocks (layers 2, 3, 5) 1: every cut from 3 to 5 leaves 1 | 2 or 2 | 1 apart, and
# DeepSpeed's programme keeps the latest of equal cuts. Tied, 'parameters': 1056 | 1088. Pair: 416 | 340.
EXPECTED = {("stack", "parameters"): [0, 3, 8], ("stack", "uniform"): [0, 4, 8], ("stack", "type:block"): [0, 5, 8],
            ("tied", "parameters"): [0, 2, 5], ("pair", "parameters"): [0, 3, 6]}


def build_module(kind: str, num_stages: int, delayed: bool = False, **options) -> PipelineModule:
    """The PipelineModule of `kind`, every layer built from seed SEED (as on every rank); `delayed`: on the meta
    device (as under sw.delay_param_initialization()), for DistributedModel to materialise each rank's stage."""
    layers, loss = KINDS[kind]
    torch.manual_seed(SEED)
    with contextlib.redirect_stdout(io.StringIO()), torch.device("meta" if delayed else "cpu"):
        return PipelineModule(layers(), num_stages=num_stages, loss_fn=loss, **options)  # prints the partition


def dataset(kind: str, rows: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    if kind == "tied":
        return TensorDataset(torch.randint(VOCAB, (rows, SEQ), generator=generator),
                             torch.randint(VOCAB, (rows, SEQ), generator=generator))
    return TensorDataset(torch.randn(rows, IN, generator=generator), torch.randn(rows, OUT, generator=generator))


def reference(kind: str, global_batch: int, steps: int = STEPS, **options) -> dict:
    """One plain process: the PipelineModule of one stage, `loss_fn(module(inputs), labels)`, SGD with momentum."""
    module = build_module(kind, 1, **options)
    if options.get("delayed"):  # what DistributedModel does with a meta-built model, on one process
        materialize(module, torch.device("cpu"), torch.initial_seed() % 2 ** 62)
    optimizer = make_optimizer("sgd", module.parameters())
    inputs, labels = dataset(kind, steps * global_batch).tensors
    losses = []
    for step in range(steps):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        optimizer.zero_grad()
        loss = module.loss_fn(module(inputs[rows]), labels[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def train_pipe(config: dict, kind: str, variants: list[dict]) -> list[dict]:
    """One rank: for each variant (PipelineModule options), the loop a DeepSpeed pipeline engine runs, on the plain
    sw API: the module's loss_fn on `model(inputs)` per microbatch, `pipeline_parallel_degree` its num_stages."""
    sw.init(config)
    results = []
    for options in variants:
        module = build_module(kind, config["pipeline_parallel_degree"], **options)
        loss_fn, parts = module.loss_fn, module.partitions()
        model = sw.DistributedModel(module)
        # Calls of each held layer's module, recomputations included (a pre-hook: torch's checkpoint stops
        # recomputing a region's last layer once it has what backward needs, before that layer's forward ends),
        # and backward passes through this stage (gradients accumulated into its first parameter).
        calls: dict[int, int] = {}
        backwards = []
        for layer in model.get_module().layers:
            if hasattr(layer, "module"):
                layer.module.register_forward_pre_hook(
                    lambda m, args, index=layer.index: calls.__setitem__(index, calls.get(index, 0) + 1))
        next(model.get_module().parameters()).register_post_accumulate_grad_hook(lambda p: backwards.append(1))
        optimizer = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))

        @sw.step
        def train_step(model, inputs, labels):
            loss = loss_fn(model(inputs), labels)
            model.backward(loss)
            return loss

        losses = []
        for inputs, labels in sw.data_loader(dataset(kind, STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                             shuffle=False):
            optimizer.zero_grad()
            out = train_step(model, inputs, labels)
            losses.append(out.reduce_mean().item() if out.holds_loss else None)
            optimizer.step()
        results.append({"losses": losses, "state": model.full_state_dict(), "pp_rank": sw.pp_rank(),
                        "parts": parts, "held": [layer.index for layer in model.get_module().layers],
                        "calls": calls, "backwards": len(backwards), "stage_id": module.stage_id})
    return results


def check_same_math(config: dict, ranks: list[list[dict]], kind: str, variants: list[dict]) -> None:
    """Every variant on every rank: its stage's layers, and one process's losses and parameters."""
    pp = config["pipeline_parallel_degree"]
    dp = len(ranks) // pp
    for v, options in enumerate(variants):
        runs = [r[v] for r in ranks]
        for run in runs:
            start, stop = run["parts"][run["pp_rank"]], run["parts"][run["pp_rank"] + 1]
            assert run["held"] == list(range(start, stop)), (options, run["pp_rank"], run["held"], run["parts"])
            assert run["stage_id"] == run["pp_rank"]
        want = reference(kind, ROWS * dp, **options)
        held = torch.tensor([run["losses"] for run in runs if run["losses"][0] is not None])
        assert len(held) == dp
        torch.testing.assert_close(held.mean(0), torch.tensor(want["losses"]), rtol=TOLERANCE, atol=0)
        for rank, run in enumerate(runs):
            assert set(run["state"]) == set(want["state"])
            errors = {name: relative_error(run["state"][name], value) for name, value in want["state"].items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOLERANCE, f"{options} rank {rank}: {worst} differs by {errors[worst]:.2e}"


# -- the specs and the signature -----------------------------------------------------------------------------


def test_specs_build_what_they_name_and_keep_deepspeeds_defaults():
    spec = LayerSpec(nn.Linear, 4, 2, bias=False)
    built = spec.build()
    assert isinstance(built, nn.Linear) and built.bias is None and built.weight.shape == (2, 4)
    assert repr(spec) == "Linear(4, 2, bias=False)"
    tied = TiedLayerSpec("embed", nn.Embedding, 10, 4)
    assert (tied.key, tied.forward_fn, tied.tied_weight_attr) == ("embed", None, ["weight"])
    assert TiedLayerSpec("e", nn.Embedding, 10, 4, tied_weight_attr="weight").tied_weight_attr == ["weight"]
    with pytest.raises(RuntimeError, match=r"^LayerSpec only supports torch.nn.Module types, got <function .*; fix: "
                                           r"pass a module class \(put a plain function straight into the layers "
                                           r"instead\)$"):
        LayerSpec(lambda x: x)


def test_the_signatures_are_deepspeeds():
    ds_pipe = pytest.importorskip("deepspeed.pipe")
    for ours, theirs in ((PipelineModule, ds_pipe.PipelineModule), (LayerSpec, ds_pipe.LayerSpec),
                         (TiedLayerSpec, ds_pipe.TiedLayerSpec)):
        mine, ds = inspect.signature(ours.__init__).parameters, inspect.signature(theirs.__init__).parameters
        assert list(mine) == list(ds), ours
        differing = {name for name in ds if name != "activation_checkpoint_func"
                     and (mine[name].default, mine[name].kind) != (ds[name].default, ds[name].kind)}
        assert not differing, (ours, differing)


# -- DeepSpeed's boundaries ----------------------------------------------------------------------------------


def _deepspeed_layers(layers: list) -> list:
    """The same layers with deepspeed's own LayerSpec and TiedLayerSpec."""
    ds_pipe = pytest.importorskip("deepspeed.pipe")
    converted = []
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            layer = ds_pipe.TiedLayerSpec(layer.key, layer.typename, *layer.module_args, forward_fn=layer.forward_fn,
                                          tied_weight_attr=layer.tied_weight_attr, **layer.module_kwargs)
        elif isinstance(layer, LayerSpec):
            layer = ds_pipe.LayerSpec(layer.typename, *layer.module_args, **layer.module_kwargs)
        converted.append(layer)
    return converted


def deepspeed_parts(layers: list, method: str, stages: int) -> list[int]:
    """DeepSpeed's own `PipelineModule._partition_layers` on `layers`, without a process group."""
    module = pytest.importorskip("deepspeed.runtime.pipe.module")
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    fake = module.PipelineModule.__new__(module.PipelineModule)
    nn.Module.__init__(fake)  # what _partition_layers reads, set by hand: DeepSpeed's __init__ needs the world
    fake.num_stages, fake.global_rank, fake.loss_fn = stages, 0, None
    fake._layer_specs = _deepspeed_layers(layers)
    fake._topo = topology.PipeDataParallelTopology(num_pp=stages, num_dp=1)
    with contextlib.redirect_stdout(io.StringIO()):
        fake._partition_layers(method=method)
    return [int(p) for p in fake.parts]


@pytest.fixture
def two_ranks(monkeypatch):
    """A launcher's environment of 2 ranks, without a process group: PipelineModules of 2 stages are built."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


@pytest.mark.parametrize("kind, method", list(EXPECTED))
def test_the_stage_boundaries_are_deepspeeds(two_ranks, kind, method):
    module = build_module(kind, 2, partition_method=method)
    assert module.partitions() == EXPECTED[kind, method]
    assert [module.stage_owner(i) for i in range(len(module.layers))] == [
        s for s in range(2) for _ in range(EXPECTED[kind, method][s], EXPECTED[kind, method][s + 1])]
    assert deepspeed_parts(KINDS[kind][0](), method, 2) == EXPECTED[kind, method]


@pytest.mark.parametrize("method", ["parameters", "uniform", "type:block", "type:Linear|tanh"])
@pytest.mark.parametrize("stages", [1, 3, 4])
def test_the_boundaries_are_deepspeeds_for_more_stages(monkeypatch, method, stages):
    monkeypatch.setenv("WORLD_SIZE", str(stages))
    assert build_module("stack", stages, partition_method=method).partitions() == deepspeed_parts(
        stack_layers(), method, stages)


def test_partition_balanced_and_uniform_are_deepspeeds():
    utils = pytest.importorskip("deepspeed.runtime.utils")
    rng = random.Random(SEED)
    for _ in range(200):
        n, parts = rng.randint(1, 12), rng.randint(1, 5)
        weights = [rng.choice([0, 0, 1, 2, 3, rng.randint(0, 10 ** 6)]) for _ in range(n)]
        assert partition_balanced(weights, parts) == [int(p) for p in utils.partition_balanced(weights, parts)]
        assert partition_uniform(n, parts) == [int(p) for p in utils.partition_uniform(n, parts)]


def test_the_topologies_are_deepspeeds():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert tuple(topo.get_coord(5)) == (1, 0, 1) and topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=0, data=1) == [2, 3] and topo.get_axis_list("data", 0) == [0, 1, 4, 5]
    assert topo.get_rank_repr(3) == "model_01" and topo.get_dim("data") == 2 and topo.get_dim("sequence") == 0
    ds = pytest.importorskip("deepspeed.runtime.pipe.topology")
    pairs = ((PipeDataParallelTopology(num_pp=2, num_dp=3), ds.PipeDataParallelTopology(num_pp=2, num_dp=3)),
             (topo, ds.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)))
    for ours, theirs in pairs:
        assert {tuple(c): r for c, r in ours.mapping.items()} == {tuple(c): r for c, r in theirs.mapping.items()}
        for axis in ours.get_axis_names():
            assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)


# -- one process ---------------------------------------------------------------------------------------------


def test_on_one_process_the_layers_run_in_order_and_checkpointing_calls_the_given_function():
    module = build_module("stack", 1)
    torch.manual_seed(SEED)
    specs = stack_layers()
    for spec in specs:  # 'parameters' partitioning builds each LayerSpec once to count it first, as DeepSpeed's
        if isinstance(spec, LayerSpec):
            spec.build()
    plain = [m.build() if isinstance(m, LayerSpec) else m for m in specs]
    x = torch.randn(3, IN)
    want = x
    for layer in plain:
        want = layer(want)
    torch.testing.assert_close(module(x), want, rtol=0, atol=0)
    regions = []

    def counting(function, *args):
        regions.append(len(args))
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    checkpointed = build_module("stack", 1, activation_checkpoint_interval=3, activation_checkpoint_func=counting)
    out = checkpointed(x)
    out.sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert regions == [1, 1, 1]  # layers 0-2, 3-5, 6-7: each run holds a layer with parameters
    only_blocks = build_module("stack", 1, activation_checkpoint_interval=1, checkpointable_layers=["Block"],
                               activation_checkpoint_func=counting)
    regions.clear()
    only_blocks(x)
    assert regions == [1, 1, 1]  # the three Blocks alone


def test_seed_layers_seeds_each_layer_before_it_is_built():
    """DeepSpeed's seed_layers: layer i is built right after seed_fn(base_seed + i) (torch.manual_seed by default)."""
    seeds = []
    module = build_module("stack", 1, seed_layers=True, base_seed=7)
    seeded = build_module("stack", 1, seed_layers=True, base_seed=7, seed_fn=lambda seed: (seeds.append(seed),
                                                                                            torch.manual_seed(seed)))
    assert seeds == [7 + i for i in range(8)]
    for index in (0, 2, 5, 7):  # the LayerSpecs
        spec = stack_layers()[index]
        torch.manual_seed(7 + index)
        want = spec.build().state_dict()
        for got in (module, seeded):
            torch.testing.assert_close(got.layers[index].module.state_dict(), want, rtol=0, atol=0)


# -- same math in real worlds --------------------------------------------------------------------------------

# What a PipelineModule of 2 stages implies (`shardwise_config()`): DeepSpeed's rank order, pipe outermost.
CONFIG = {"pipeline_parallel_degree": 2, "placement_strategy": "PDT", "microbatches": MICROBATCHES}
METHODS = [{"partition_method": "parameters"}, {"partition_method": "uniform"}, {"partition_method": "type:Block"}]


def test_same_math_on_two_stages_for_every_partition_method():
    ranks = run_distributed(train_pipe, 2, CONFIG, "stack", METHODS, timeout=300)
    assert [run["parts"] for run in ranks[0]] == [EXPECTED["stack", m] for m in ("parameters", "uniform", "type:block")]
    check_same_math(CONFIG, ranks, "stack", METHODS)


def test_same_math_on_two_stages_times_two_replicas():
    """Ranks 0, 1 hold stage 0 and ranks 2, 3 stage 1, as DeepSpeed's PipeDataParallelTopology numbers them."""
    variants = [{"partition_method": "parameters"}]
    ranks = run_distributed(train_pipe, 4, CONFIG, "stack", variants, timeout=300)
    assert [run[0]["pp_rank"] for run in ranks] == [0, 0, 1, 1]
    check_same_math(CONFIG, ranks, "stack", variants)


def test_a_tied_embedding_spans_the_stages_and_trains_as_one_weight():
    """Built as is, and on the meta device (each rank materialises its stage; stage 1's copy of the embedding
    then takes stage 0's values)."""
    variants = [{}, {"delayed": True}]
    ranks = run_distributed(train_pipe, 2, CONFIG, "tied", variants, timeout=300)
    assert ranks[0][0]["parts"] == EXPECTED["tied", "parameters"]
    assert [run[0]["held"] for run in ranks] == [[0, 1], [2, 3, 4]]  # the embedding's two uses on two stages
    check_same_math(CONFIG, ranks, "tied", variants)
    weight = "layers.1.module.fc1.weight"
    assert not torch.equal(ranks[0][0]["state"][weight], ranks[0][1]["state"][weight]), "delayed: other values"
    for run in ranks:  # the copies took the same steps: still one weight
        for variant in run:
            torch.testing.assert_close(variant["state"]["layers.0.module.weight"],
                                       variant["state"]["layers.4.module.weight"], rtol=0, atol=0)


def test_activation_checkpointing_recomputes_runs_of_layers():
    """Interval 3 on 'parameters' ([0, 3, 8]): stage 0 runs layers 0-2 as one region; stage 1 runs 3-5 (from the
    layer fed by stage 0) and 6-7. Against the same training without checkpointing, every layer's module runs
    again in backward, as often as every other layer of its stage and at least once per backward pass
    accumulating gradients (the last stage's first step also recomputes for the schedule's trial backward,
    which accumulates none), and the training is the same."""
    variants = [{}, {"activation_checkpoint_interval": 3}]
    ranks = run_distributed(train_pipe, 2, CONFIG, "stack", variants, timeout=300)
    check_same_math(CONFIG, ranks, "stack", variants)
    for plain, checkpointed in ranks:
        assert set(checkpointed["calls"]) == set(plain["calls"]) == {i for i in plain["held"] if i != 4}  # 4: lambda
        assert checkpointed["backwards"] == plain["backwards"] >= STEPS * MICROBATCHES
        extra = {i: checkpointed["calls"][i] - plain["calls"][i] for i in plain["calls"]}
        assert len(set(extra.values())) == 1 and min(extra.values()) >= plain["backwards"], extra


def test_a_tuple_crosses_the_stages_whole():
    """Stage 0's last layer returns (hidden, mask); stage 1's first layer gets the tuple, plain and in a
    checkpointed region (interval 2: layers 3-4, then 5)."""
    variants = [{}, {"activation_checkpoint_interval": 2}]
    ranks = run_distributed(train_pipe, 2, CONFIG, "pair", variants, timeout=300)
    assert ranks[0][0]["parts"] == EXPECTED["pair", "parameters"]
    check_same_math(CONFIG, ranks, "pair", variants)


# -- what is refused -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, error", [
    ({"partition_method": "balanced"},
     "ValueError: PipelineModule: partition_method 'balanced' is not 'parameters', 'uniform' or 'type:REGEX'; fix: use "
     "one of those"),
    ({"partition_method": [0, 4, 8]},
     "ValueError: PipelineModule: partition_method must be a string ('parameters', 'uniform' or 'type:REGEX'), got "
     "[0, 4, 8]; fix: pass one of those (an explicit list of boundaries is not a DeepSpeed method)"),
    ({"partition_method": "type:Conv"},
     "ValueError: PipelineModule: partition_method 'type:conv' matches no layer's class (the layers are <lambda>, "
     "Block, Linear, ReLU, Tanh); fix: name one of them, e.g. 'type:<lambda>'"),
    ({"partition_method": "profile"},
     "ValueError: PipelineModule: partition_method 'profile' balances nothing in DeepSpeed either (it refuses it); "
     "fix: use 'parameters', 'uniform' or 'type:REGEX'"),
    ({"num_stages": 3},
     "RuntimeError: PipelineModule: num_stages (3) must divide the world size (2); fix: launch a multiple of 3 "
     "processes, or pass a num_stages that divides 2"),
    ({"num_stages": None},
     "RuntimeError: PipelineModule: must provide num_stages or topology; fix: pass num_stages=<the pipeline degree>"),
    ({"activation_checkpoint_interval": -1},
     "ValueError: PipelineModule: activation_checkpoint_interval must be an int of 0 or more (layers per recomputed "
     "run, 0 for none), got -1"),
    ({"topology": PipeDataParallelTopology(num_pp=2, num_dp=2)},
     "ValueError: PipelineModule: the topology spans 4 ranks ({'pipe': 2, 'data': 2}) but the world has 2; fix: "
     "give a topology whose dims multiply to the world size"),
])
def test_bad_module_arguments_are_one_line_naming_the_fix(two_ranks, options, error):
    options = {"num_stages": 2, **options}
    with pytest.raises((ValueError, RuntimeError)) as info:
        with contextlib.redirect_stdout(io.StringIO()):
            PipelineModule(stack_layers(), loss_fn=F.mse_loss, **options)
    assert f"{info.typename}: {info.value}" == error


def test_a_topology_gives_the_stages_and_the_config_keys_in_shardwise_order_only(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    module = build_module("stack", None, topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2))
    assert (module.num_stages, module.num_pipeline_stages(), module.stage_id) == (2, 2, 1)
    assert module.shardwise_config() == {"pipeline_parallel_degree": 2, "placement_strategy": "PDT",
                                         "tensor_parallel_degree": 2}
    with pytest.raises(ValueError) as info:
        build_module("stack", None, topology=ProcessTopology(axes=["data", "pipe"], dims=[4, 2]))
    assert str(info.value) == (
        "PipelineModule: the topology's axes ['data', 'pipe'] are not pipe, data, model (outermost first), the order "
        "shardwise numbers ranks in; fix: use PipeDataParallelTopology or PipeModelDataParallelTopology")


@pytest.mark.parametrize("layers, error", [
    ([], "ValueError: PipelineModule: the layer list is empty; fix: pass the model's layers (LayerSpecs, modules or "
         "callables) in the order the forward runs them"),
    ([nn.ReLU()], "ValueError: PipelineModule: 1 layers cannot fill num_stages=2 stages of at least one layer each; "
                  "fix: use num_stages of at most 1"),
    ([TiedLayerSpec("t", nn.Embedding, 4, 2), nn.ReLU(), TiedLayerSpec("t", nn.Linear, 2, 4)],
     "ValueError: PipelineModule: TiedLayerSpec key 't' is Embedding at layer 0 and Linear at layer 2, but one key is "
     "one module; fix: give the same typename, or a different key"),
    ([TiedLayerSpec("t", nn.Embedding, 4, 2, tied_weight_attr="bias"), nn.ReLU()],
     "ValueError: PipelineModule: TiedLayerSpec 't': tied_weight_attr 'bias' names no weight of Embedding (it has "
     "weight); fix: name one of those"),
    ([nn.ReLU(), 3], "TypeError: PipelineModule: layer 1 is a int, which is neither a LayerSpec, a module nor a "
                     "callable; fix: pass one of those"),
])
def test_bad_layers_are_one_line_naming_the_fix(two_ranks, layers, error):
    with pytest.raises((ValueError, TypeError)) as info:
        with contextlib.redirect_stdout(io.StringIO()):
            PipelineModule(layers, num_stages=2)
    assert f"{info.typename}: {info.value}" == error


def test_a_stage_sending_what_is_not_a_tensor_is_one_line_naming_the_fix(two_ranks):
    """Stage 0 of uniform [0, 2, 4] ends with a layer returning (hidden, None), as the core's stage runs it."""
    with contextlib.redirect_stdout(io.StringIO()):
        module = PipelineModule([nn.Linear(IN, HIDDEN), lambda x: (x, None), lambda pair: pair[0],
                                 nn.Linear(HIDDEN, OUT)], num_stages=2, partition_method="uniform")
    part = cut(module, 2)
    assert part.bounds == ((0, 2), (2, 4)) and part.how == "placed by hand"
    stage = StageModule(stage_view(module, part, 0), part, 0)
    stage.install_hooks()
    with pytest.raises(TypeError) as info:
        stage(forward_input=torch.randn(2, IN))
    assert str(info.value) == ("pipeline stage 0 sends its last block's output (Tensor, NoneType) to stage 1, and only "
                               "tensors pass between stages; fix: return tensors only from the block, rebuilding the "
                               "rest on the next stage")


def test_a_loss_module_with_parameters_goes_with_the_last_stage(two_ranks):
    class ScaledMSE(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, outputs, labels):
            return self.scale * F.mse_loss(outputs, labels)

    with contextlib.redirect_stdout(io.StringIO()):
        module = PipelineModule(stack_layers(), num_stages=2, loss_fn=ScaledMSE())
    blocks = find_blocks(module)
    assert (blocks.path, blocks.before, blocks.after) == ("layers", (), ("loss_fn",))


def test_on_one_process_two_stages_is_one_line_naming_the_fix():
    with pytest.raises(RuntimeError) as info:
        build_module("stack", 2)
    assert str(info.value) == ("PipelineModule: num_stages (2) must divide the world size (1); fix: launch a multiple "
                               "of 2 processes, or pass a num_stages that divides 1 (1 on one process)")


def test_a_nested_pipeline_module_is_refused_in_one_line(two_ranks):
    with contextlib.redirect_stdout(io.StringIO()):
        inner = PipelineModule(stack_layers(), num_stages=2, loss_fn=F.mse_loss)
        with pytest.raises(ValueError) as info:
            PipelineModule([inner, *stack_layers()], num_stages=2, loss_fn=F.mse_loss)
    assert str(info.value) == ("PipelineModule: layer 0 is a PipelineModule, whose stages cannot nest in another's "
                               "(DeepSpeed refuses it too); fix: pass its layers instead")
