"""SMP's Hugging Face stand-ins: a GPT-2 built for tensor parallelism trains as `DistributedTransformerLMHead`.

Split over 2 tensor-parallel ranks and over 2 ZeRO-3 ranks, with the Hugging Face model's
weights loaded through `translate_hf_state_dict_to_smdistributed_gpt2`, it trains with
the same losses and ends with the same weights as the Hugging Face model itself
in one process; a full checkpoint of it is the Hugging Face model's state dict.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import shardwise as sw
from shardwise.nn.huggingface import gpt2
from shardwise.testing import run_distributed

CONFIG = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
STEPS, ROWS, SEQ = 3, 4, 16


def reference_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def optimizer_of(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def train_alone() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = reference_model()
    optimizer = optimizer_of(model.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=batch(step), labels=batch(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_stand_in(config: dict, root: str) -> tuple[bool, list[float], dict[str, torch.Tensor]]:
    sw.init(config)
    with sw.model_creation(tensor_parallelism=True):
        built = GPT2LMHeadModel(GPT2Config(**CONFIG))
    model = sw.DistributedModel(built)
    replaced = isinstance(model.get_module(), sw.nn.DistributedTransformerLMHead)  # FSDP2 subclasses it
    model.load_state_dict(gpt2.translate_hf_state_dict_to_smdistributed_gpt2(reference_model().state_dict()))
    optimizer = sw.DistributedOptimizer(optimizer_of(model.parameters()))

    @sw.step
    def train_step(model, ids):
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)["loss"]
        model.backward(loss)
        return loss

    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        rows = batch(step).chunk(sw.dp_size())[sw.dp_rank()]  # each replica its part of the one batch
        loss = train_step(model, rows).reduce_mean()  # this replica's, as in SMP: averaged over replicas here
        torch.distributed.all_reduce(loss, group=sw.get_dp_process_group())
        losses.append(loss.item() / sw.dp_size())
        optimizer.step()
    sw.save_checkpoint(root, "final", partial=False)
    state = gpt2.translate_state_dict_to_hf_gpt2(model.state_dict())
    sw.shutdown()
    return replaced, losses, state


@pytest.mark.parametrize("config", [{"tensor_parallel_degree": 2}, {"sharded_data_parallel_degree": 2}],
                         ids=["tp2", "zero3"])
def test_gpt2_stand_in_trains_as_hugging_faces_gpt2_and_saves_its_state_dict(config, tmp_path):
    expected_losses, expected = train_alone()
    replaced, losses, state = run_distributed(train_stand_in, 2, config, str(tmp_path), timeout=300)[0]
    assert replaced
    assert losses == pytest.approx(expected_losses, abs=1e-5)
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert torch.allclose(state[name], value, atol=2e-5), name
    saved = torch.load(tmp_path / "final" / "model.pt", weights_only=True)
    GPT2LMHeadModel(GPT2Config(**CONFIG)).load_state_dict(saved, strict=True)  # Hugging Face's names and shapes
    assert all(torch.equal(saved[name], state[name]) for name in expected)
    manifest = json.loads((tmp_path / "final" / "shardwise.json").read_text())
    assert manifest["model_class"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
