"""What the planner says a transformer block keeps for backward, against what autograd keeps, measured.

A saved-tensors hook (saved_tensors.py) counts the bytes Hugging Face's GPT-2 (with and without dropout), Llama,
BERT and ViT blocks keep during one training forward on this CPU, in fp32 and in bf16 (parameters in bf16, no
autocast: FSDP2's mixed precision, or pure bf16), and on each rank of a tensor-parallel pair with and without
sequence parallelism; `block_activations` with the CPU's kernels must give them within 2 %: the count is per tensor PyTorch saves, so a dtype path the planner did not know (an eager RMSNorm
keeping its input upcast to fp32 under bf16) shows here, not only in a peak. Training runs without a key/value
cache (DistributedModel turns it off), so these do too. What a selective checkpointing policy keeps (torch
hands a policy each op's output) must be `kept_matmul_bytes` exactly.

Under autocast (fp32 parameters, bf16 matmuls, as DDP runs bf16) the blocks also keep each weight's bf16 copy
and the residual stream in fp32. GPT-2's blocks are checked so. This CPU's autocast also runs GELU in fp32 and
attention in the widest of its inputs' dtypes (Llama's rotary makes Q and K fp32), which CUDA's does not and the
planner does not count: BERT, ViT and Llama keep 6–8 % more here under autocast.
"""

from __future__ import annotations

import pytest
import torch

from saved_tensors import local, peak_saved_in_blocks
from shardwise.planner.activations import Numerics, block_activations
from shardwise.planner.families import spec_from_hf
from shardwise.planner.hardware import local_node

ROWS, SEQ, WIDE = 2, 64, dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512)


def _built(case: str):
    """(model, its inputs, tokens a block sees per sequence) for one case, its weights seeded."""
    import transformers as hf

    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (ROWS, SEQ))
    if case.startswith("gpt2"):
        dropout = 0.1 if case == "gpt2 dropout" else 0.0
        config = hf.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=512, n_positions=SEQ, resid_pdrop=dropout,
                               embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                               attn_implementation="sdpa")
        return hf.GPT2LMHeadModel(config), {"input_ids": tokens, "use_cache": False}, SEQ
    if case == "llama":
        config = hf.LlamaConfig(**WIDE, num_key_value_heads=2, vocab_size=512, max_position_embeddings=SEQ,
                                attn_implementation="sdpa")
        return hf.LlamaForCausalLM(config), {"input_ids": tokens, "use_cache": False}, SEQ
    if case == "bert":
        config = hf.BertConfig(**WIDE, vocab_size=512, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        return hf.BertForMaskedLM(config), {"input_ids": tokens}, SEQ
    config = hf.ViTConfig(**WIDE, image_size=32, patch_size=4, num_channels=3, num_labels=4, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return hf.ViTForImageClassification(config), {"pixel_values": torch.randn(ROWS, 3, 32, 32)}, 65


@pytest.mark.parametrize("case", ["gpt2", "gpt2 dropout", "llama", "bert", "vit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_blocks_kept_bytes_are_what_autograd_keeps(case, dtype):
    model, inputs, seq = _built(case)
    model.to(dtype).train()
    inputs = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    kept = peak_saved_in_blocks(model, lambda: model(**inputs))
    spec = spec_from_hf(model.config.to_dict(), case)
    per_token = block_activations(spec, seq, Numerics(dtype.itemsize), local_node(2)["device"].kernels).per_rank(1)
    assert kept == pytest.approx(per_token * ROWS * seq * model.config.num_hidden_layers, rel=0.02)


@pytest.mark.parametrize("case", ["gpt2", "gpt2 dropout"])
def test_under_autocast_blocks_keep_weight_copies_and_an_fp32_residual_stream(case):
    model, inputs, seq = _built(case)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = peak_saved_in_blocks(model, lambda: model(**inputs))
    spec = spec_from_hf(model.config.to_dict(), case)
    numerics = Numerics(2, residual=4, weight_copies=2)
    per_token = block_activations(spec, seq, numerics, local_node(2)["device"].kernels).per_rank(1)
    layers = model.config.num_hidden_layers
    copies = numerics.weight_copies * spec.layer_parameters * layers
    assert kept == pytest.approx(per_token * ROWS * seq * layers + copies, rel=0.02)


def _tensor_parallel_kept(case: str, sequence_parallel: bool, regather: bool = False) -> tuple[int, int]:
    """One rank of a tensor-parallel pair: the bytes its blocks keep in one training forward, and the tokens they
    see (SMP's tensor parallelism gathers the pair's batches: each rank runs both)."""
    import shardwise as sw

    sw.init({"tensor_parallel_degree": 2, "sequence_parallel": sequence_parallel,
             "sequence_parallel_regather": regather})
    model, inputs, seq = _built(case)
    inner = sw.DistributedModel(model).get_module()
    kept = peak_saved_in_blocks(inner, lambda: inner(**inputs))
    return kept, 2 * ROWS * seq


@pytest.mark.parametrize("case", ["gpt2", "llama"])
@pytest.mark.parametrize("sequence_parallel, regather", [(False, False), (True, False), (True, True)])
def test_a_tensor_parallel_blocks_kept_bytes_are_what_autograd_keeps(case, sequence_parallel, regather):
    """On 2 ranks: heads and MLP units split in two, the norms' outputs whole (torch keeps the input each
    column-parallel linear gathered) unless gathered again in backward, the norms' inputs and statistics split
    over the sequence with sequence parallelism, whole without."""
    from shardwise.testing import run_distributed

    results = run_distributed(_tensor_parallel_kept, 2, case, sequence_parallel, regather, timeout=300)
    model, _, seq = _built(case)
    spec = spec_from_hf(model.config.to_dict(), case)
    per_token = block_activations(spec, seq, Numerics(4), local_node(2)["device"].kernels).per_rank(
        2, sequence_parallel, regather)
    for kept, tokens in results:
        assert kept == pytest.approx(per_token * tokens * model.config.num_hidden_layers, rel=0.02)


def _counting(policy: str, tally: list[int]) -> type:
    """`policy` (a runtime name) as a policy class that adds up the bytes of every output it keeps in forward."""
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import CheckpointPolicy

    from shardwise.parallel.recompute.selective import checked_policy

    named = checked_policy(policy)

    class Counting:
        def __init__(self) -> None:
            self.decide = named() if isinstance(named, type) else (
                lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE if op in named else
                CheckpointPolicy.PREFER_RECOMPUTE)

        def __call__(self, ctx, op, *args, **kwargs):
            decision = self.decide(ctx, op, *args, **kwargs)
            if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                tally[0] += sum(local(t).untyped_storage().nbytes() for t in tree_leaves(ctx.op_output)
                                if torch.is_tensor(t))
            return decision

    return Counting


@pytest.mark.parametrize("case, policy", [("gpt2", "matmul"), ("llama", "matmul"), ("llama", "alternate_matmul")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_what_a_selective_policy_keeps_is_what_the_planner_counts(case, policy, dtype):
    import shardwise as sw
    from shardwise.planner.activations import kept_matmul_bytes
    from tiny_models import blocks

    model, inputs, seq = _built(case)
    model.to(dtype).train()
    tally = [0]
    for block in blocks(model):
        sw.set_activation_checkpointing(block, policy=_counting(policy, tally))
    model(**inputs)
    spec = spec_from_hf(model.config.to_dict(), case)
    per_token = kept_matmul_bytes(spec, seq, Numerics(dtype.itemsize), local_node(2)["device"].kernels, 1, False,
                                  policy)
    assert tally[0] == per_token * ROWS * seq * model.config.num_hidden_layers


def _tensor_parallel_policy_kept(case: str, policy: str, sequence_parallel: bool) -> int:
    import shardwise as sw
    from tiny_models import blocks

    sw.init({"tensor_parallel_degree": 2, "sequence_parallel": sequence_parallel})
    model, inputs, _ = _built(case)
    tally = [0]
    for block in blocks(model):
        sw.set_activation_checkpointing(block, policy=_counting(policy, tally))
    inner = sw.DistributedModel(model).get_module()
    inner(**inputs)
    return tally[0]


@pytest.mark.parametrize("case, policy", [("gpt2", "matmul"), ("llama", "alternate_matmul")])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_what_a_policy_keeps_under_tensor_parallelism_is_what_the_planner_counts(case, policy, sequence_parallel):
    """On each rank of a tensor-parallel pair the policies also keep the collectives' outputs: each output
    projection's all-reduce, or with sequence parallelism its reduce-scatter and the all-gather of each
    column-parallel linear's input."""
    from shardwise.planner.activations import kept_matmul_bytes
    from shardwise.testing import run_distributed

    kept = run_distributed(_tensor_parallel_policy_kept, 2, case, policy, sequence_parallel, timeout=300)
    model, _, seq = _built(case)
    spec = spec_from_hf(model.config.to_dict(), case)
    per_token = kept_matmul_bytes(spec, seq, Numerics(4), local_node(2)["device"].kernels, 2, sequence_parallel,
                                  policy)
    assert kept == [per_token * 2 * ROWS * seq * model.config.num_hidden_layers] * 2
