"""Predicted memory per category against torch's MemTracker on one CPU process.

A real training step of tiny Hugging Face models (AdamW, fp32): model states must
match within ±10 %, activations within ±25 %. The sharded runs will be compared the
same way once the runtime applies them; `measure_step` is the reusable part.
"""

import pytest
import torch
import transformers
from torch.distributed._tools.mem_tracker import MemTracker

from shardwise.config import parse_config
from shardwise.planner import cluster_preset, predict_memory, spec_from_hf
from shardwise.topology import Layout

BATCH = 4


def measure_step(model: torch.nn.Module, batch: dict) -> dict:
    """Bytes per MemTracker category: model states after optimizer.step(), activations at the end of forward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        loss = model(**batch).loss
        after_forward = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
        optimizer.step()
        after_step = tracker.get_tracker_snapshot("current")[torch.device("cpu")]

    def get(snapshot, name):
        return next(v for k, v in snapshot.items() if getattr(k, "name", None) == name)

    return {"parameters": get(after_step, "PARAM"), "gradients": get(after_step, "GRAD"),
            "optimizer": get(after_step, "OPT"), "activations": get(after_forward, "ACT")}


def _text_batch(vocab: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (BATCH, seq))
    return {"input_ids": ids, "labels": ids}


CASES = {
    "gpt2": (transformers.GPT2LMHeadModel,
             transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64),
             lambda: _text_batch(256, 64), 64),
    "llama": (transformers.LlamaForCausalLM,
              transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=160, vocab_size=256,
                                       max_position_embeddings=64),
              lambda: _text_batch(256, 64), 64),
    "bert": (transformers.BertForMaskedLM,
             transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, vocab_size=256, max_position_embeddings=64),
             lambda: _text_batch(256, 64), 64),
    "vit": (transformers.ViTForImageClassification,
            transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                                   image_size=32, patch_size=4, num_labels=10),
            lambda: {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 10, (BATCH,))}, 65),
}


@pytest.mark.parametrize("family", list(CASES))
def test_predicted_memory_matches_memtracker(family):
    model_class, hf_config, make_batch, seq = CASES[family]
    torch.manual_seed(0)
    measured = measure_step(model_class(hf_config).train(), make_batch())
    spec = spec_from_hf(hf_config.to_dict(), family)
    predicted = predict_memory(spec, parse_config({}), Layout(), BATCH, seq,
                               device=cluster_preset("local").device).summary()
    for category in ("parameters", "gradients", "optimizer"):
        assert predicted[category] == pytest.approx(measured[category], rel=0.10), category
    assert predicted["activations"] == pytest.approx(measured["activations"], rel=0.25)
