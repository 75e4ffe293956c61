"""SMP's `nn` modules compute what SMP documents, in one process and split over 2 tensor-parallel ranks;
its Hugging Face translation functions, `utils.rmsg` and `patches.checkpoint`.

References are written out here with plain torch ops (matmul, softmax), after SMP's
reference implementations and its library's residuals, on each module's own weights.
Dropout is off wherever values are compared.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from shardwise.nn import (DistributedAttentionLayer, DistributedEmbedding, DistributedLinear, DistributedTransformer,
                          DistributedTransformerLayer, DistributedTransformerLMHead, DistributedTransformerOutputLayer,
                          FlashAttentionLayer, FusedLayerNorm)
from shardwise.nn.huggingface import bert, gpt2, gptj, gptneo, roberta
from shardwise.parallel.tensor import replace_registered
from shardwise.parallel.tensor import apply_tensor_parallel, full_state_dict, is_distributed_parameter, loss_context
from shardwise.runtime.devices import local_device
from shardwise.testing import run_distributed

HEADS, HEAD, HIDDEN, INNER, VOCAB, SEQ = 4, 8, 32, 64, 40, 6
SIZES = dict(num_attention_heads=HEADS, attention_head_size=HEAD, hidden_size=HIDDEN, attention_dropout_prob=0.0,
             hidden_dropout_prob=0.0)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return ((a - b).norm() / b.norm().clamp_min(1e-3)).item() < tol


def _softmax_attention(q, k, v, mask=None, causal=False, scale=None):
    """[N, H, S, D] tensors: softmax(q kᵀ·scale + mask [+ causal −inf]) v, spelled out."""
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores + mask
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _split(x, heads=HEADS):
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _reference_attention(layer: DistributedAttentionLayer, hidden, mask, cross=None):
    """SMP's AttentionLayer reference, with the residual its library adds in both layer-norm modes."""
    x = layer.pre_layernorm(hidden) if layer.pre_layernorm is not None else hidden
    source = x if cross is None else cross
    q, k, v = _split(layer.query(x)), _split(layer.key(source)), _split(layer.value(source))
    context = _softmax_attention(q, k, v, mask, causal=layer.causal_mask_size is not None and cross is None)
    out = layer.dense(context.transpose(1, 2).flatten(2)) + hidden
    return layer.layernorm(out) if layer.layernorm is not None else out


def _reference_output(layer: DistributedTransformerOutputLayer, inp, activation=F.gelu):
    x = layer.pre_layernorm(inp) if layer.pre_layernorm is not None else inp
    out = inp + layer.dense2(activation(layer.dense1(x)))
    return layer.layernorm(out) if layer.layernorm is not None else out


def _mask(rows: int, keys: int = SEQ) -> torch.Tensor:
    """SMP's additive [N, 1, 1, S] mask: the last key of row 0 masked."""
    mask = torch.zeros(rows, 1, 1, keys)
    mask[0, ..., -1] = -10000.0
    return mask


def test_fused_layer_norm_is_torch_layer_norm():
    torch.manual_seed(0)
    fused, plain = FusedLayerNorm(HIDDEN, eps=1e-6), nn.LayerNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        fused.weight.normal_(), fused.bias.normal_()
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(3, HIDDEN)
    assert torch.equal(fused(x), plain(x))
    assert not FusedLayerNorm(HIDDEN, elementwise_affine=False).weight


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_layer_is_softmax_attention(causal):
    torch.manual_seed(0)
    qkv = torch.randn(2, SEQ, 3, HEADS, HEAD)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    mask = _mask(2)
    by_head = FlashAttentionLayer(attention_dropout_prob=0.0, attention_head_size=HEAD)
    assert _close(by_head(qkv, mask, causal=causal), _softmax_attention(q, k, v, mask, causal))
    by_layer = FlashAttentionLayer(0.0, HEAD, scale_attn_by_layer_idx=True, layer_idx=2)
    assert _close(by_layer(qkv), _softmax_attention(q, k, v, scale=1 / (math.sqrt(HEAD) * 3)))
    custom = FlashAttentionLayer(0.0, scale=0.5, scale_attention_scores=True)  # `scale` overrides the rest
    assert _close(custom(qkv), _softmax_attention(q, k, v, scale=0.5))


def test_flash_attention_layer_errors_name_the_fix():
    with pytest.raises(ValueError, match="scale_attention_scores=True needs attention_head_size; fix: pass"):
        FlashAttentionLayer()
    with pytest.raises(ValueError, match="scale_attn_by_layer_idx=True needs layer_idx"):
        FlashAttentionLayer(attention_head_size=HEAD, scale_attn_by_layer_idx=True)
    with pytest.raises(ValueError, match=r"expects qkv of shape \[batch, seq, 3, heads, head_size\], got \[2, 6, 32\]"):
        FlashAttentionLayer(attention_head_size=HEAD)(torch.randn(2, SEQ, HIDDEN))
    with pytest.warns(sw.config.IneffectiveSettingsWarning, match="triton_flash_attention"):
        FlashAttentionLayer(attention_head_size=HEAD, triton_flash_attention=True)


@pytest.mark.parametrize("norms", [(False, True), (True, False), (True, True)], ids=["post", "pre", "pre+post"])
@pytest.mark.parametrize("causal", [None, SEQ], ids=["bidirectional", "causal"])
def test_attention_layer_reference_math(norms, causal):
    torch.manual_seed(0)
    layer = DistributedAttentionLayer(**SIZES, pre_layernorm=norms[0], post_layernorm=norms[1], causal_mask_size=causal)
    hidden, mask = torch.randn(2, SEQ, HIDDEN), _mask(2)
    assert _close(layer((hidden, mask)), _reference_attention(layer, hidden, mask))


def test_cross_attention_reads_keys_and_values_from_cross_states():
    torch.manual_seed(0)
    layer = DistributedAttentionLayer(**SIZES, cross_attention=True, causal_mask_size=SEQ)  # causal: self only
    hidden, cross, mask = torch.randn(2, SEQ, HIDDEN), torch.randn(2, SEQ + 3, HIDDEN), _mask(2, SEQ + 3)
    assert _close(layer((hidden, cross, mask)), _reference_attention(layer, hidden, mask, cross))


def test_alibi_biases_follow_smps_mask():
    """use_alibi adds SMP's generate_alibi_attn_mask biases: the same as passing them to FlashAttentionLayer."""
    torch.manual_seed(0)
    layer = DistributedAttentionLayer(**SIZES, post_layernorm=False, use_alibi=True, alibi_bias_max=8)
    hidden = torch.randn(2, SEQ, HIDDEN)
    slopes = 1.0 / 2 ** (torch.arange(1, HEADS + 1) * (8 / HEADS))
    alibi = (slopes.view(1, HEADS, 1, 1) * torch.arange(1 - SEQ, 1).view(1, 1, 1, SEQ))
    q, k, v = _split(layer.query(hidden)), _split(layer.key(hidden)), _split(layer.value(hidden))
    expected = layer.dense(_softmax_attention(q, k, v, alibi).transpose(1, 2).flatten(2)) + hidden
    assert _close(layer((hidden, None)), expected)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("norms", [(False, True), (True, False)], ids=["post", "pre"])
def test_output_layer_reference_math(activation, norms):
    torch.manual_seed(0)
    layer = DistributedTransformerOutputLayer(HIDDEN, INNER, 0.0, activation, pre_layernorm=norms[0],
                                              post_layernorm=norms[1])
    x = torch.randn(2, SEQ, HIDDEN)
    assert _close(layer(x), _reference_output(layer, x, {"gelu": F.gelu, "relu": F.relu}[activation]))


def test_module_argument_errors_name_the_fix():
    with pytest.raises(ValueError, match="activation='swish' is not supported; fix: use one of 'gelu', 'relu'"):
        DistributedTransformerOutputLayer(activation="swish")
    with pytest.raises(ValueError, match="at least one of pre_layernorm and post_layernorm must be True; fix"):
        DistributedTransformerLayer(pre_layernorm=False, post_layernorm=False)
    layer = DistributedAttentionLayer(**SIZES, causal_mask_size=4)
    with pytest.raises(ValueError, match="sequence length 6 exceeds causal_mask_size 4; fix"):
        layer((torch.randn(1, SEQ, HIDDEN), None))
    with pytest.warns(sw.config.IneffectiveSettingsWarning, match="fused_bias_gelu"):
        DistributedTransformerOutputLayer(HIDDEN, INNER, fused_bias_gelu=True)


def test_gptj_option_errors_name_the_fix():
    from transformers import GPTJConfig, GPTJForCausalLM

    for rotary_dim in (3, 2 * HEAD):
        with pytest.raises(ValueError, match=f"rotary_dim={rotary_dim} does not fit; fix: give self-attention an "
                                             f"even rotary_dim of at most attention_head_size={HEAD}, or 0"):
            DistributedAttentionLayer(**SIZES, rotary_dim=rotary_dim)
    with pytest.raises(ValueError, match="parallel_attn_output and rotary_dim take no cross attention; fix: drop"):
        DistributedTransformerLayer(**SIZES, add_cross_attention=True, parallel_attn_output=True)
    with pytest.raises(ValueError, match="use_lm_head_bias=True needs an untied head; fix: set "
                                         "tie_input_output_embedding=False"):
        DistributedTransformerLMHead(use_lm_head_bias=True)
    with sw.tensor_parallelism():
        tied = GPTJForCausalLM(GPTJConfig(n_layer=1, n_embd=HIDDEN, n_head=HEADS, rotary_dim=HEAD, vocab_size=VOCAB,
                                          n_positions=SEQ, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match="GPT-J with tie_word_embeddings=True has no stand-in .*; fix: set "
                                         "tie_word_embeddings=False"):
        replace_registered(tied)


def test_transformer_layer_and_stack_pass_smps_tuples():
    torch.manual_seed(0)
    layer = DistributedTransformerLayer(**SIZES, intermediate_size=INNER, add_cross_attention=True)
    hidden, cross, mask, cross_mask = torch.randn(2, SEQ, HIDDEN), torch.randn(2, 3, HIDDEN), _mask(2), _mask(2, 3)
    out, cross_out, mask_out, cross_mask_out = layer((hidden, cross, mask, cross_mask))
    attended = _reference_attention(layer.cross_attention, _reference_attention(layer.attention, hidden, mask),
                                    cross_mask, cross)
    assert _close(out, _reference_output(layer.output, attended))
    assert cross_out is cross and mask_out is mask and cross_mask_out is cross_mask
    stack = DistributedTransformer(3, **SIZES, intermediate_size=INNER, pre_layernorm=True, post_layernorm=True)
    final_norms = [layer.output.layernorm is not None for layer in stack.seq_layers]
    assert final_norms == [False, False, True] and all(layer.attention.layernorm is None for layer in stack.seq_layers)
    x = hidden
    for layer in stack.seq_layers:
        x = _reference_output(layer.output, _reference_attention(layer.attention, x, mask))
    out, mask_out = stack((hidden, mask))
    assert _close(out, x) and mask_out is mask


def test_linear_and_embedding_are_torch_layers():
    torch.manual_seed(0)
    linear = DistributedLinear(HIDDEN, INNER)
    x = torch.randn(2, HIDDEN)
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    embedding = DistributedEmbedding(VOCAB, HIDDEN, padding_idx=0, initializer_range=0.01)
    assert abs(embedding.weight[1:].std().item() - 0.01) < 2e-3 and not embedding.weight[0].any()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(embedding(ids), F.embedding(ids, embedding.weight, padding_idx=0))
    with pytest.warns(sw.config.IneffectiveSettingsWarning, match="_skip_allgather"):
        DistributedEmbedding(VOCAB, HIDDEN, _skip_allgather=True)


def _gpt2_head(**options) -> DistributedTransformerLMHead:
    return DistributedTransformerLMHead(num_layers=2, **SIZES, intermediate_size=INNER, vocab_size=VOCAB,
                                        num_positions=SEQ, causal_mask_size=SEQ, pre_layernorm=True,
                                        post_layernorm=True, **options)


def test_lm_head_translates_into_hugging_face_gpt2():
    """A GPT-2-shaped LMHead's state dict, translated, loads strictly into GPT2LMHeadModel and gives its logits
    and loss; Hugging Face's own keys pass through, and translating back gives the LMHead's state dict."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    head = _gpt2_head()
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=HIDDEN, n_head=HEADS, n_inner=INNER, vocab_size=VOCAB,
                                    n_positions=SEQ, activation_function="gelu", layer_norm_epsilon=1e-5,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    translated = gpt2.translate_state_dict_to_hf_gpt2(head.state_dict(), max_seq_len=SEQ)
    hf.load_state_dict(translated, strict=True)
    ids, attention = torch.randint(0, VOCAB, (2, SEQ)), torch.ones(2, SEQ, dtype=torch.long)
    attention[1, -2:] = 0  # right padding: every query keeps a key, so masked values agree however large
    loss, logits = head((ids, attention, None, None, ids))
    expected = hf(input_ids=ids, attention_mask=attention, labels=ids)
    assert _close(logits, expected.logits) and _close(loss, expected.loss)
    assert gpt2.translate_state_dict_to_hf_gpt2(hf.state_dict()).keys() == hf.state_dict().keys()
    back = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(translated)
    assert back.keys() == head.state_dict().keys()
    assert all(torch.equal(back[key], value) for key, value in head.state_dict().items())


def _hugging_face_family(family: str) -> tuple:
    """(model class, a small config, translation in, translation out, name in errors) of a stand-in's family."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTJConfig, GPTJForCausalLM

    sizes = dict(n_layer=2, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return {"gpt2": (GPT2LMHeadModel, GPT2Config(**sizes), gpt2.translate_hf_state_dict_to_smdistributed_gpt2,
                     gpt2.translate_state_dict_to_hf_gpt2, "GPT-2"),
            # rotary on half of each head: turned and passed dims both count
            "gptj": (GPTJForCausalLM, GPTJConfig(**sizes, rotary_dim=HEAD // 2),
                     gptj.translate_hf_state_dict_to_smdistributed_gptj, gptj.translate_state_dict_to_hf_gptj,
                     "GPT-J")}[family]


@pytest.mark.parametrize("family", ["gpt2", "gptj"])
def test_hugging_face_model_built_for_tensor_parallelism_is_replaced_by_the_lm_head_and_called_as_before(family):
    """SMP's stand-ins: built for tensor parallelism, a GPT2LMHeadModel or GPTJForCausalLM becomes a
    DistributedTransformerLMHead with `transformer.seq_layers`, takes Hugging Face's call and gives its output
    (loss and logits equal to the original's with the same weights, with padding, at default and at given
    positions); its state dict translates back to the original's exactly; one built outside is kept."""
    kind, config, to_smp, to_hf, name = _hugging_face_family(family)
    with sw.tensor_parallelism():  # what model_creation(tensor_parallelism=True) marks by, without init
        marked = kind(config)
    plain = kind(config)
    stand_in = replace_registered(marked)
    assert isinstance(stand_in, DistributedTransformerLMHead) and len(stand_in.transformer.seq_layers) == 2
    assert replace_registered(plain) is plain
    stand_in.load_state_dict(to_smp(plain.state_dict()), strict=True)
    ids, attention = torch.randint(0, VOCAB, (2, SEQ)), torch.ones(2, SEQ, dtype=torch.long)
    attention[1, -2:] = 0  # right padding: every query keeps a key, so masked values agree however large
    for positions in ({}, {"position_ids": torch.randint(0, SEQ, (2, SEQ))}):
        got, expected = (m(input_ids=ids, attention_mask=attention, labels=ids, **positions)
                         for m in (stand_in, plain))
        assert _close(got["loss"], expected.loss) and _close(got.logits, expected.logits)
    original = plain.state_dict()
    back = to_hf(stand_in.state_dict())
    assert back.keys() == original.keys() and all(torch.equal(back[key], original[key]) for key in original)
    assert to_hf(original).keys() == original.keys()  # Hugging Face's keys pass through
    again = to_smp(back)
    assert again.keys() == stand_in.state_dict().keys()
    assert all(torch.equal(again[key], value) for key, value in stand_in.state_dict().items())
    with pytest.raises(ValueError, match=f"the {name} stand-in takes input_ids, attention_mask, position_ids and "
                                         "labels, not inputs_embeds; fix"):
        stand_in(inputs_embeds=torch.randn(2, SEQ, HIDDEN))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_transformer_translates_into_hugging_face_encoders(family):
    """A post-layer-norm DistributedTransformer standing in for BertEncoder / RobertaEncoder: its keys,
    translated, load strictly into the encoder, and both compute the same."""
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    torch.manual_seed(0)
    kind, config, translate = {
        "bert": (BertModel, BertConfig, bert.translate_state_dict_to_hf_bert),
        "roberta": (RobertaModel, RobertaConfig, roberta.translate_state_dict_to_hf_roberta)}[family]
    model = kind(config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=INNER,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), add_pooling_layer=False)
    encoder = DistributedTransformer(2, **SIZES, intermediate_size=INNER, layernorm_epsilon=1e-12)
    state = {f"encoder.{k}": v for k, v in encoder.state_dict().items()}
    model.encoder.load_state_dict({k[len("encoder."):]: v for k, v in translate(state).items()}, strict=True)
    hidden, mask = torch.randn(2, SEQ, HIDDEN), _mask(2)
    assert _close(encoder((hidden, mask))[0], model.encoder(hidden, attention_mask=mask).last_hidden_state)
    to_smp = {"bert": bert.translate_hf_state_dict_to_smdistributed_bert,
              "roberta": roberta.translate_hf_state_dict_to_smdistributed_roberta}[family]
    assert to_smp(model.state_dict()).keys() == model.state_dict().keys()


def test_gptj_translations_keep_smps_names_and_prefixes():
    """SMP's GPT-J example imports the older name (with `max_seq_len`), its developer guide spells another; a
    `DistributedModel`'s prefix stays; `ln_f` is the last layer's norm; the old causal-mask buffers go."""
    hf = dict.fromkeys(["module.transformer.h.0.attn.q_proj.weight", "module.transformer.h.1.ln_1.bias",
                        "module.transformer.ln_f.weight", "module.transformer.wte.weight", "module.lm_head.bias",
                        "module.transformer.h.0.attn.bias"], torch.ones(1))
    translated = gptj.translate_hf_gptj_state_dict_to_smdistributed(hf, max_seq_len=SEQ)
    assert list(translated) == ["module.transformer.seq_layers.0.attention.query.weight",
                                "module.transformer.seq_layers.1.pre_layernorm.bias",
                                "module.transformer.seq_layers.1.layernorm.weight", "module.word_embedding.weight",
                                "module.lm_head.bias"]
    assert gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj(hf) == translated
    assert list(gptj.translate_state_dict_to_hf_gptj(translated, max_seq_len=SEQ)) == list(hf)[:-1]


def test_gptneo_translations_are_the_identity():
    state = {"transformer.h.0.attn.attention.q_proj.weight": torch.ones(1)}
    for translated in (gptneo.translate_state_dict_to_hf_gptneo(state, 8),
                       gptneo.translate_hf_state_dict_to_smdistributed_gptneo(state)):
        assert translated == state and translated is not state


def test_rmsg_prefixes_the_rank():
    assert sw.utils.rmsg("loss 1.5") == "[0] loss 1.5"
    assert run_distributed(_rmsg, 2, timeout=300) == ["[0] step", "[1] step"]


def _rmsg() -> str:
    return sw.utils.rmsg("step")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("strategy", ["each", "contiguous", "group_2"])
def test_patches_checkpoint_gives_the_same_gradients(strategy):
    torch.manual_seed(0)
    layers = nn.Sequential(*(_Block() for _ in range(3)))
    x = torch.randn(4, HIDDEN, requires_grad=True)

    def grads(run):
        torch.manual_seed(1)  # dropout draws the same masks; preserve_rng_state replays them in recompute
        for p in [x, *layers.parameters()]:
            p.grad = None
        run().square().sum().backward()
        return [p.grad.clone() for p in [x, *layers.parameters()]]

    plain = grads(lambda: layers(x))
    sequential = grads(lambda: sw.patches.checkpoint.checkpoint_sequential(layers, x, strategy=strategy))
    one = grads(lambda: sw.patches.checkpoint.checkpoint(layers, x))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, sequential, one, strict=True))


def test_patches_checkpoint_errors_name_the_fix():
    with pytest.raises(TypeError, match="checkpoint expects an nn.Module, got function; SMP checkpoints modules"):
        sw.patches.checkpoint.checkpoint(lambda x: x, torch.ones(1))
    with pytest.raises(ValueError, match=r"strategy='pairs' is not one of \"each\", \"contiguous\", \"group_<n>\""):
        sw.patches.checkpoint.checkpoint_sequential(nn.Sequential(nn.Identity()), torch.ones(1), strategy="pairs")


class _Stack(nn.Module):
    """Every shardwise.nn module at once: a split embedding, a cross-attending post-norm transformer, a
    split linear, and a GPT-2-style LM head with vocabulary-split embedding and head."""

    def __init__(self):
        super().__init__()
        self.embed = DistributedEmbedding(VOCAB, HIDDEN)
        self.encoder = DistributedTransformer(1, **SIZES, intermediate_size=INNER, add_cross_attention=True)
        self.bridge = DistributedLinear(HIDDEN, HIDDEN)
        self.lm = _gpt2_head(distribute_embedding=True, num_token_types=2, add_cross_attention=True)

    def forward(self, ids, labels):
        memory = self.embed(ids)
        memory = self.encoder((memory, memory, None, None))[0]
        types = torch.zeros_like(ids)
        loss, _ = self.lm((ids, None, types, None, self.bridge(memory), None, labels))
        return loss


def _stack() -> _Stack:
    torch.manual_seed(0)
    return _Stack()


def train_split(steps: int = 3) -> dict:
    """One rank of a 2-rank TP world: the split stack and the plain one, SGD on the same batches."""
    device = local_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("tp",))
    reference = _stack().to(device)
    model = apply_tensor_parallel(copy.deepcopy(reference), mesh["tp"])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, model)]
    losses = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(step)).to(device)
        with loss_context(model):
            loss = model(ids, ids)
            loss.backward()
        ref_loss = reference(ids, ids)
        ref_loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item() - ref_loss.item())
    full, ref = full_state_dict(model), reference.state_dict()
    split = {name for name, p in model.named_parameters() if is_distributed_parameter(p)}
    return {"loss_gap": max(map(abs, losses)), "names": sorted(full) == sorted(ref),
            "param_error": max(((full[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-3)).item() for k in ref),
            "split": sorted(split), "world": dist.get_world_size()}


def test_split_stack_trains_like_one_process():
    for result in run_distributed(train_split, 2, timeout=300):
        assert result["names"] and result["loss_gap"] < 1e-5 and result["param_error"] < 1e-5
        split = result["split"]
        for name in ("embed.weight", "bridge.weight", "bridge.bias", "lm.word_embedding.weight",
                     "encoder.seq_layers.0.attention.query.weight", "encoder.seq_layers.0.cross_attention.key.weight",
                     "encoder.seq_layers.0.output.dense1.weight", "lm.transformer.seq_layers.1.attention.dense.weight"):
            assert name in split, name
        assert not any("layernorm" in name or "position_embedding" in name for name in split)
