"""SMP's Hugging Face stand-ins: a GPT-2 or GPT-J built for tensor parallelism trains as `DistributedTransformerLMHead`.

Split over 2 tensor-parallel ranks and over 2 ZeRO-3 ranks, with the Hugging
Face model's weights loaded through the family's `translate_hf_state_dict_to_smdistributed_*`,
it trains with the same losses and ends with the same weights as the Hugging Face
model itself in one process; a full checkpoint of it is the Hugging Face model's state dict.
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM

import shardwise as sw
from shardwise.nn.huggingface import gpt2, gptj
from shardwise.testing import run_distributed

STEPS, ROWS, SEQ, VOCAB = 3, 4, 16, 64
SHARED = dict(n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


class Family(NamedTuple):
    model: type
    class_path: str  # what a full checkpoint's manifest names
    config: Callable[[], Any]
    to_shardwise: Callable[[dict], dict]
    to_hugging_face: Callable[[dict], dict]


FAMILIES = {
    "gpt2": Family(GPT2LMHeadModel, "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel",
                   lambda: GPT2Config(n_embd=32, **SHARED),
                   gpt2.translate_hf_state_dict_to_smdistributed_gpt2, gpt2.translate_state_dict_to_hf_gpt2),
    # Rotary on half of each 16-wide head: the turned and the passed dims both train.
    "gptj": Family(GPTJForCausalLM, "transformers.models.gptj.modeling_gptj.GPTJForCausalLM",
                   lambda: GPTJConfig(n_embd=64, rotary_dim=8, **SHARED),
                   gptj.translate_hf_state_dict_to_smdistributed_gptj, gptj.translate_state_dict_to_hf_gptj),
}


def reference_model(family: Family) -> torch.nn.Module:
    torch.manual_seed(0)
    return family.model(family.config())


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def optimizer_of(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def train_alone(family: Family) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = reference_model(family)
    optimizer = optimizer_of(model.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(input_ids=batch(step), labels=batch(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_stand_in(name: str, config: dict, root: str) -> tuple[bool, list[float], dict[str, torch.Tensor]]:
    family = FAMILIES[name]
    sw.init(config)
    with sw.model_creation(tensor_parallelism=True):
        built = family.model(family.config())
    model = sw.DistributedModel(built)
    replaced = isinstance(model.get_module(), sw.nn.DistributedTransformerLMHead)  # FSDP2 subclasses it
    model.load_state_dict(family.to_shardwise(reference_model(family).state_dict()))
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
    state = family.to_hugging_face(model.state_dict())
    sw.shutdown()
    return replaced, losses, state


@pytest.mark.parametrize("config", [{"tensor_parallel_degree": 2}, {"sharded_data_parallel_degree": 2}],
                         ids=["tp2", "zero3"])
@pytest.mark.parametrize("name", FAMILIES)
def test_stand_in_trains_as_the_hugging_face_model_and_saves_its_state_dict(name, config, tmp_path):
    family = FAMILIES[name]
    expected_losses, expected = train_alone(family)
    replaced, losses, state = run_distributed(train_stand_in, 2, name, config, str(tmp_path), timeout=300)[0]
    assert replaced
    assert losses == pytest.approx(expected_losses, abs=1e-5)
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():  # AdamW's first steps blow rounding in tiny gradients up to ~1e-5;
        assert torch.allclose(state[key], value, atol=5e-5), key  # a wrong one moves a weight by ~lr = 1e-2
    saved = torch.load(tmp_path / "final" / "model.pt", weights_only=True)
    family.model(family.config()).load_state_dict(saved, strict=True)  # Hugging Face's names and shapes
    assert all(torch.equal(saved[key], state[key]) for key in expected)
    manifest = json.loads((tmp_path / "final" / "shardwise.json").read_text())
    assert manifest["model_class"] == family.class_path
