"""Tensor parallelism trains the same model as one process, on real gloo worlds of 2 and 4 ranks.

Every rank also trains the plain model on the whole global batch and compares:
losses and every full parameter within 1e-5 relative (fp32, dropout off). Where
parameters are compared the optimizer is SGD with momentum: a few gradients are
zero in exact arithmetic (attention key biases — softmax ignores a shift shared
by all keys), and Adam turns their rounding noise into full-size steps. The
AdamW run compares losses at 1e-5 and parameters at 1e-4. Norms get a 1e-3 floor
so that those ~0 tensors are compared absolutely.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from shardwise.config import parse_config
from shardwise.parallel.recompute.apply import apply_activation_checkpointing
from shardwise.parallel.tensor import TensorParallelBatch, apply_tensor_parallel, full_state_dict, loss_context
from shardwise.runtime.devices import local_device
from shardwise.testing import run_distributed

ROWS = 2  # rows each rank brings with prescaled_batch off
SEQ = 16


def _gpt2(vocab: int = 256) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama(vocab: int = 256) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
                                        max_position_embeddings=32))


def _vit(vocab: int = 0) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=128, image_size=16, patch_size=4, num_labels=5))


def _bert(vocab: int = 256) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=vocab, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class _Mlp(nn.Module):
    """A model no plan is built in for."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 5)

    def forward(self, pixel_values):
        x = pixel_values.flatten(1)[:, :32]
        return {"logits": self.head(x + self.down(F.gelu(self.up(x))))}


MODELS = {"gpt2": _gpt2, "llama": _llama, "vit": _vit, "bert": _bert, "mlp": lambda vocab=0: _Mlp()}
USER_PLANS = {"mlp": {"up": "colwise", "down": "rowwise"}}


def _inputs(kind: str, rows: int, step: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if kind in ("vit", "mlp"):
        return {"pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 5, (rows,), generator=g)}
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _loss(kind: str, outputs, inputs: dict) -> torch.Tensor:
    logits, labels = outputs["logits"], inputs["labels"]
    if kind in ("vit", "mlp"):
        return F.cross_entropy(logits, labels)
    if kind == "bert":
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _my_rows(inputs: dict, tp: int, prescaled: bool) -> dict:
    """SMP's loader: off, every rank gets its own rows (dp × tp shards); on, a TP group shares tp × more."""
    rank = dist.get_rank()
    lo, hi = (rank // tp * tp * ROWS, (rank // tp + 1) * tp * ROWS) if prescaled else (rank * ROWS, (rank + 1) * ROWS)
    return {k: v[lo:hi] for k, v in inputs.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-3)).item()


def _setup(kind: str, tp: int, prescaled: bool, vocab: int, fsdp: bool, bf16: bool = False, sequence: bool = False,
           regather: bool = False):
    device = local_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    reference = MODELS[kind](vocab).to(device)
    model = copy.deepcopy(reference)
    config = parse_config({"tensor_parallel_degree": tp, "prescaled_batch": prescaled, "bf16": bf16,
                           "sequence_parallel": sequence})
    apply_tensor_parallel(model, mesh["tp"], USER_PLANS.get(kind), sequence_parallel=config.sequence_parallel,
                          regather=regather)
    if fsdp:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        for block in (model.transformer.h if kind == "gpt2" else model.model.layers):
            apply_activation_checkpointing(block)
            fully_shard(block, mesh=mesh["dp_shard"], mp_policy=policy)
        fully_shard(model, mesh=mesh["dp_shard"], mp_policy=policy)
    return device, mesh, reference, model


def _mean_over_ranks(loss: torch.Tensor) -> float:
    value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train(kind: str, tp: int, prescaled: bool, *, optimizer: str = "sgd", steps: int = 3, vocab: int = 256,
          fsdp: bool = False, bf16: bool = False, model_loss: bool = False, sequence: bool = False) -> dict:
    """One rank: train the plain model on the global batch and the split one on this rank's rows.

    With FSDP the batch handling runs as forward hooks next to FSDP's own; without,
    as explicit gather/split calls. bf16 without FSDP is autocast, as for DDP.
    """
    device, mesh, reference, model = _setup(kind, tp, prescaled, vocab, fsdp, bf16, sequence)
    make = ((lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if optimizer == "sgd"
            else (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))
    ref_opt, opt = make(reference.parameters()), make(model.parameters())
    batch = TensorParallelBatch(mesh["tp"], prescaled)
    if fsdp:
        batch.install(model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and not fsdp)
    ref_losses, losses = [], []
    for step in range(steps):
        inputs = {k: v.to(device) for k, v in _inputs(kind, dist.get_world_size() * ROWS, step, vocab).items()}
        ref_loss = _loss(kind, reference(**{k: v for k, v in inputs.items() if k != "labels"}), inputs)
        ref_loss.backward()
        mine = _my_rows(inputs, tp, prescaled)
        with loss_context(model):
            kwargs = mine if model_loss else {k: v for k, v in mine.items() if k != "labels"}
            with autocast:
                if fsdp:
                    outputs = model(**kwargs)
                else:
                    args, kwargs = batch.gather((), kwargs)
                    outputs = batch.split(model(*args, **kwargs))
                loss = outputs["loss"] if model_loss else _loss(kind, outputs, mine)
            loss.backward()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        ref_losses.append(ref_loss.item())
        losses.append(_mean_over_ranks(loss))
    full, ref = full_state_dict(model), reference.state_dict()
    return {"ref_losses": ref_losses, "losses": losses, "names": sorted(full) == sorted(ref),
            "param_error": max(_rel(full[k], ref[k]) for k in ref)}


def _check(result: dict, loss_tol: float = 1e-5, param_tol: float = 1e-5) -> None:
    assert result["names"], "state_dict names must stay those of the unsplit model"
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=loss_tol)
    assert result["param_error"] < param_tol


@pytest.mark.parametrize("prescaled", [False, True], ids=["own-rows", "prescaled"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "vit"])
def test_same_math_as_one_process(kind, tp, prescaled):
    for result in run_distributed(train, tp, kind, tp, prescaled):
        _check(result)


def test_adamw_llama():
    for result in run_distributed(train, 2, "llama", 2, False, optimizer="adamw"):
        _check(result, param_tol=1e-4)


@pytest.mark.parametrize("prescaled", [False, True], ids=["own-rows", "prescaled"])
def test_model_computed_loss_on_vocab_sharded_logits(prescaled):
    """`labels=`: HF's own loss runs on vocab-sharded logits under loss_context, on the group's batch."""
    for result in run_distributed(train, 2, "gpt2", 2, prescaled, model_loss=True):
        _check(result)


@pytest.mark.parametrize("prescaled", [False, True], ids=["own-rows", "prescaled"])
def test_bert_masked_lm_with_tied_decoder(prescaled):
    for result in run_distributed(train, 2, "bert", 2, prescaled, model_loss=prescaled):
        _check(result)


def test_user_plan_for_a_model_without_builtin_plan():
    for result in run_distributed(train, 2, "mlp", 2, False):
        _check(result)


def test_uneven_vocabulary():
    """250 rows over 4 ranks: 63, 63, 63, 61; embedding, loss and the row split still agree."""
    for result in run_distributed(train, 4, "gpt2", 4, False, vocab=250):
        _check(result)


@pytest.mark.parametrize("prescaled", [False, True], ids=["own-rows", "prescaled"])
def test_tp2_with_fsdp2_and_checkpointing_on_2x2_mesh(prescaled):
    for result in run_distributed(train, 4, "gpt2", 2, prescaled, fsdp=True):
        _check(result)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2-policy", "autocast"])
def test_bf16(fsdp):
    world = 4 if fsdp else 2
    for result in run_distributed(train, world, "llama", 2, False, fsdp=fsdp, bf16=True, optimizer="adamw", steps=2):
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=2e-2)


def local_bytes(tp: int) -> dict:
    _, _, reference, model = _setup("gpt2", tp, False, 256, fsdp=False)
    split = [p for p in model.parameters() if isinstance(p, DTensor) and p.to_local().numel() < p.numel()]
    return {"split_local": sum(p.to_local().nbytes for p in split),
            "split_full": sum(p.numel() * p.element_size() for p in split),
            "rest": sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in model.parameters()
                        if all(p is not q for q in split)),
            "total_full": sum(p.nbytes for p in reference.parameters()),
            "split_names": sorted({n.split(".")[-2] for n, p in model.named_parameters()
                                   if any(p is q for q in split)})}


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_holds_one_tp_th_of_split_layers(tp):
    for result in run_distributed(local_bytes, tp, tp):
        assert result["split_local"] * tp == result["split_full"]
        assert result["split_local"] + result["rest"] == result["total_full"] - result["split_full"] * (tp - 1) / tp
        assert result["split_names"] == ["c_attn", "c_fc", "c_proj", "wte"]  # lm_head is tied to wte


def logits_shape(prescaled: bool) -> list[int]:
    _, mesh, _, model = _setup("gpt2", 2, prescaled, 256, fsdp=False)
    batch = TensorParallelBatch(mesh["tp"], prescaled)
    ids = torch.randint(0, 256, (ROWS, SEQ), device=next(model.parameters()).device)
    _, kwargs = batch.gather((), {"input_ids": ids})
    logits = batch.split(model(**kwargs))["logits"]
    return list((logits.to_local() if isinstance(logits, DTensor) else logits).shape)


def test_no_rank_holds_the_group_logits():
    """Prescaled: rows × vocab/tp (sharded for loss_parallel). Own rows: the rank's rows × vocab."""
    assert run_distributed(logits_shape, 2, True) == [[ROWS, SEQ, 128]] * 2
    assert run_distributed(logits_shape, 2, False) == [[ROWS, SEQ, 256]] * 2


def block_collectives(kind: str, sequence: bool = False, regather: bool = False) -> dict:
    """Collectives of the first block in forward and in backward (with `sequence`, it also enters the
    sequence shards: its input is cut to this rank's slice, and the slice's gradient all-gathered)."""
    _, _, _, model = _setup(kind, 2, True, 256, fsdp=False, sequence=sequence, regather=regather)
    hidden = torch.randn(ROWS, SEQ, 64, device=next(model.parameters()).device, requires_grad=True)
    if kind == "gpt2":
        block, extra = model.transformer.h[0], {}
    else:
        block = model.model.layers[0]
        extra = {"position_embeddings": model.model.rotary_emb(hidden, torch.arange(SEQ, device=hidden.device)[None])}
    with CommDebugMode() as forward:
        out = block(hidden, **extra)
    with CommDebugMode() as backward:
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return {name: {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
            for name, comms in (("forward", forward), ("backward", backward))}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_one_all_reduce_per_attention_and_mlp_each_way(kind):
    """Forward: attention + MLP all-reduce their outputs; backward: their inputs' gradients, once each."""
    assert run_distributed(block_collectives, 2, kind)[0] == {"forward": {"all_reduce": 2},
                                                              "backward": {"all_reduce": 2}}
