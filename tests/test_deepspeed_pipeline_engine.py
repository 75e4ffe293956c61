"""`shardwise.deepspeed`'s PipelineEngine: `train_batch`/`eval_batch` on a PipelineModule train as one process.

The script is DeepSpeed's pipeline loop: a PipelineModule of LayerSpecs, a plain callable and a
TiedLayerSpec pair (an embedding whose weight is also the output projection, `forward_fn` given),
`deepspeed.initialize`, then `engine.train_batch(data_iter)` per global batch. The reference is the same
script in one process with `num_stages=1` and the micro batch times the data-parallel ranks: each of its
micro-batches holds the same samples as those of all ranks together. Beyond DeepSpeed, the pipeline engine
combines with ZeRO-1 and tensor parallelism as shardwise's pipeline does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.testing import run_distributed

VOCAB, HIDDEN, SEQ, GAS, STEPS = 32, 16, 6, 4, 3
TOLERANCE = 1e-5


def _embed(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight)  # the embedding's weight as the output projection


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _pipeline(stages: int, linear: type):
    from shardwise.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(0)
    layers = [TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN, forward_fn=_embed),
              LayerSpec(linear, HIDDEN, HIDDEN), torch.nn.GELU(), LayerSpec(torch.nn.LayerNorm, HIDDEN),
              LayerSpec(linear, HIDDEN, HIDDEN), lambda x: x * 0.5, LayerSpec(torch.nn.LayerNorm, HIDDEN),
              TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN, forward_fn=_project)]
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=_loss, partition_method="parameters")


def train(stages: int, micro: int, extra: dict, tensor_parallel: bool = False) -> dict:
    import shardwise.deepspeed as deepspeed
    from shardwise.deepspeed.utils import RepeatingLoader
    from shardwise.nn import DistributedLinear

    net = _pipeline(stages, DistributedLinear if tensor_parallel else torch.nn.Linear)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=generator)
    data = torch.utils.data.TensorDataset(ids, torch.roll(ids, -1, dims=1))
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "eps": 1e-6, "torch_adam": True}}, **extra}
    engine, _, loader, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                                training_data=data)
    batches = iter(RepeatingLoader(loader))
    losses = [engine.train_batch(batches).item() for _ in range(STEPS)]
    evaluated = engine.eval_batch(batches).item()
    return {"losses": losses, "eval": evaluated, "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps, "stage": engine.stage_id, "state": engine.module_state_dict()}


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(train, 1, 1, 4, {})[0]


@pytest.mark.parametrize("world,extra", [(2, {}), (4, {"zero_optimization": {"stage": 1}}),
                                         (4, {"tensor_parallel_degree": 2})],
                         ids=["pp2", "pp2-dp2-zero1", "pp2-tp2"])
def test_train_batch_trains_as_one_process(world, extra, reference):
    dp = world // 2  # tensor-parallel ranks read batches of their own too (shardwise's data parallelism)
    ranks = run_distributed(train, world, 2, 4 // dp, extra, "tensor_parallel_degree" in extra)
    for got in ranks:  # the loss on every rank, as DeepSpeed broadcasts it
        assert got["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE, abs=TOLERANCE)
        assert got["eval"] == pytest.approx(reference["eval"], rel=TOLERANCE, abs=TOLERANCE)
        assert got["global_steps"] == STEPS and got["micro_steps"] == STEPS * GAS
    assert sorted({got["stage"] for got in ranks}) == [0, 1]
    for name, value in reference["state"].items():
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


def _refused(call: str) -> str:
    import shardwise.deepspeed as deepspeed

    net = _pipeline(1, torch.nn.Linear)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    try:
        {"forward": lambda: engine(torch.zeros(2, SEQ, dtype=torch.long)), "step": engine.step,
         "no data": engine.train_batch}[call]()
    except Exception as error:  # noqa: BLE001  (the message is what is checked)
        return str(error)
    return "no error"


@pytest.mark.parametrize("call,message", [("forward", "Only train_batch() and eval_batch() are accessible"),
                                          ("step", "Only train_batch() and eval_batch() are accessible"),
                                          ("no data", "train_batch() needs data: pass data_iter=")])
def test_pipeline_engine_refuses_what_deepspeed_refuses(call, message):
    assert message in run_distributed(_refused, 1, call)[0]
