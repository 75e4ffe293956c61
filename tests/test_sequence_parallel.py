"""Sequence parallelism: same math as one process, the blocks' activations divided by tp, and each
all-reduce of plain tensor parallelism replaced by a reduce-scatter and an all-gather.

The same-math cases train GPT-2 and Llama through the public API (test_tensor_parallel_runtime.py's
loop) with the models' built-in plans; BERT (post-norm blocks) runs at the parallel-layer level.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from shardwise.config import ConfigError
from shardwise.parallel.recompute.apply import apply_activation_checkpointing
from shardwise.parallel.tensor import SequencePlan, TensorParallelPlan, builtin_plan, loss_context
from shardwise.parallel.tensor.plan import assignments, match
from shardwise.parallel.tensor.sequence import shard_sequence
from shardwise.testing import run_distributed
from shardwise.torch_internals import TorchDispatchMode
from test_tensor_parallel import MODELS, ROWS, SEQ, USER_PLANS, _check, _inputs, _setup, block_collectives, train
from test_tensor_parallel_runtime import _check as _check_runtime
from test_tensor_parallel_runtime import train_all

SP = {"tensor_parallel_degree": 2, "sequence_parallel": True}
ZERO3 = {**SP, "sharded_data_parallel_degree": 2}

# config, blocks checkpointed
CASES = {
    "tp2": (SP, False),
    "tp2-zero1": ({**SP, "shard_optimizer_state": True}, False),
    "tp2-clipping": ({**SP, "gradient_clipping": 0.5}, False),
    "tp2-prescaled-checkpointing": ({**SP, "prescaled_batch": True}, True),
    "tp2-zero3-checkpointing-microbatches": ({**ZERO3, "microbatches": 2}, True),
    "tp2-zero3-prescaled": ({**ZERO3, "prescaled_batch": True}, False),
    "tp4-prescaled": ({**SP, "tensor_parallel_degree": 4, "prescaled_batch": True}, False),
    "tp2-regather": ({**SP, "sequence_parallel_regather": True}, False),
    "tp2-zero3-regather-microbatches": ({**ZERO3, "sequence_parallel_regather": True, "microbatches": 2}, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_math_as_one_process(name):
    config, checkpoint = CASES[name]
    _check_runtime(run_distributed(train_all, 4, config, ("gpt2", "llama"), "sgd", checkpoint, timeout=300)[0])


@pytest.mark.slow
def test_mics_on_8_ranks_with_checkpointing():
    """TP 2 inside, MiCS over dp 4: partition groups of 2, replicated across the 2 groups."""
    _check_runtime(run_distributed(train_all, 8, ZERO3, ("gpt2", "llama"), "sgd", True, timeout=600)[0])


def test_bert_post_norm_blocks_with_model_loss():
    """BERT normalises after each residual add, inside the attention and MLP output modules."""
    for result in run_distributed(train, 2, "bert", 2, True, model_loss=True, sequence=True):
        _check(result)


@pytest.mark.parametrize("kind, norm_weights", [("gpt2", 4), ("llama", 2)])
def test_reduce_scatter_and_all_gather_instead_of_all_reduce(kind, norm_weights):
    """Forward: attention and MLP all-gather their input and reduce-scatter their output. Backward mirrors
    it, plus the all-gather of the gradient of the block's input slice (the first block enters the sequence
    shards) and one all-reduce per norm weight (vectors of the hidden size, not activations)."""
    assert run_distributed(block_collectives, 2, kind, True)[0] == {
        "forward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
        "backward": {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2, "all_reduce": norm_weights},
    }


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_regather_gathers_each_column_parallel_input_again_in_backward(kind):
    """Backward adds one all-gather per gathered input (attention's and the MLP's), shared by the projections
    that read it, issued asynchronously through c10d (`_allgather_base_`); forward is unchanged."""
    assert run_distributed(block_collectives, 2, kind, True, True)[0] == {
        "forward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
        "backward": {"all_gather_into_tensor": 3, "_allgather_base_": 2, "reduce_scatter_tensor": 2,
                     "all_reduce": 2 if kind == "llama" else 4},
    }


class _Backward(TorchDispatchMode):
    """The order of the regather's all-gathers and the matmuls in a backward pass."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_allgather_base_":
            self.events.append("gather")
        elif name in ("mm", "addmm", "bmm", "baddbmm"):
            self.events.append("matmul")
        return func(*args, **(kwargs or {}))


def regather_order(kind: str) -> list[str]:
    """Two blocks, the second fed the first's output, forward then backward: what backward issues, in order."""
    _, _, _, model = _setup(kind, 2, True, 256, fsdp=False, sequence=True, regather=True)
    hidden = torch.randn(ROWS, SEQ, 64, device=next(model.parameters()).device, requires_grad=True)
    if kind == "gpt2":
        blocks, extra = model.transformer.h, {}
    else:
        blocks = model.model.layers
        extra = {"position_embeddings": model.model.rotary_emb(hidden, torch.arange(SEQ, device=hidden.device)[None])}
    out = hidden
    for block in blocks[:2]:
        out = block(out, **extra)
        out = out[0] if isinstance(out, tuple) else out
    with _Backward() as order:
        out.sum().backward()
    return order.events


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_regather_starts_each_gather_before_backward_needs_it(kind):
    """When backward first needs a gathered input (the second block's MLP input), it gathers it and at once starts
    the gather of the one forward gathered before it (the block's attention input); each later one starts when
    backward reaches the one after it, across blocks too, so the last (the first block's attention input) starts
    before that block's MLP weight gradients and all its attention's matmuls run: with each gathered only where
    it is needed, only the input projection's two matmuls would follow it."""
    events = run_distributed(regather_order, 2, kind)[0]
    gathers = [i for i, e in enumerate(events) if e == "gather"]
    assert len(gathers) == 4
    assert gathers[1] == gathers[0] + 1
    assert events[gathers[-1]:].count("matmul") >= 6


def _activation(snapshot: dict) -> int:
    return sum(by_kind.get("Activation", 0) for by_kind in snapshot.values())


FORWARDS = 3


def activation_bytes(kind: str, sequence: bool, checkpoint: bool, regather: bool = False) -> dict:
    """MemTracker's activation bytes on this rank after forward: in all, and per norm and block."""
    _, _, _, model = _setup(kind, 2, True, 256, fsdp=False, sequence=sequence, regather=regather)
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    if checkpoint:
        for block in blocks:
            apply_activation_checkpointing(block)
    norms = builtin_plan(model).sequence.norms
    # A module keeps what it allocates and holds at its end, less what others free meanwhile: a collective's
    # buffers, released whenever the backend finishes it (so also inside a later module), only ever lower
    # that. Over several forwards the most a module kept is what it keeps itself.
    kept: dict[str, int] = {}
    gc.collect()  # earlier tests' garbage in this pooled worker must not be freed inside a tracked forward
    gc.disable()
    try:
        for forward in range(FORWARDS):
            tracker = MemTracker()
            tracker.track_external(model)
            with loss_context(model), tracker:
                output = model(input_ids=_inputs(kind, ROWS, 0, 256)["input_ids"])
                if forward == 0:
                    live = _activation(tracker.get_tracker_snapshot())
                    stats = {s.mod_fqn.partition(".")[2]: s for s in tracker.memory_tracking.values()}
            for s in tracker.memory_tracking.values():
                name = s.mod_fqn.partition(".")[2]
                net = _activation(s.snapshots["Post-Forward"][-1]) - _activation(s.snapshots["Pre-Forward"][0])
                kept[name] = max(kept.get(name, net), net)
            del output  # its graph, and the activations in it, go before the next forward
    finally:
        gc.enable()
    return {"live": live,
            "norms": {name: kept[name] for name in stats if any(match(pattern, name) for pattern in norms)},
            "blocks": {name: stats[name].output_mem for name, block in model.named_modules()
                       if any(block is b for b in blocks)}}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_norm_and_residual_activations_divided_by_tp_memtracker(kind):
    """Per rank at TP 2: every norm keeps half the bytes and every block outputs half the residual stream.
    Those norm inputs are all the forward keeps less (the inputs the column-parallel layers gather stay
    whole: torch keeps them for the weight gradients). With checkpointed blocks, which keep only their
    inputs, half of every block's input is saved."""
    whole, split = (run_distributed(activation_bytes, 2, kind, sequence, False)[0] for sequence in (False, True))
    assert len(split["norms"]) == 4 and len(split["blocks"]) == 2
    assert {name: 2 * b for name, b in split["norms"].items()} == whole["norms"]
    assert {name: 2 * b for name, b in split["blocks"].items()} == whole["blocks"]
    assert whole["live"] - split["live"] == sum(whole["norms"].values()) // 2
    whole, split = (run_distributed(activation_bytes, 2, kind, sequence, True)[0] for sequence in (False, True))
    assert whole["live"] - split["live"] == sum(whole["blocks"].values()) // 2


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_regather_keeps_half_of_each_gathered_input_memtracker(kind):
    """Per rank at TP 2 with sequence_parallel_regather: each block's two gathered inputs (attention's and the
    MLP's, the residual stream's size whole) are kept as this rank's half, so the forward keeps a block output's
    half less per gathered input; the norms and block outputs are as without it."""
    split, regathered = (run_distributed(activation_bytes, 2, kind, True, False, regather)[0]
                         for regather in (False, True))
    assert (regathered["norms"], regathered["blocks"]) == (split["norms"], split["blocks"])
    assert split["live"] - regathered["live"] == 2 * sum(split["blocks"].values())


def odd_sequence() -> str:
    _, _, _, model = _setup("vit", 2, True, 0, fsdp=False, sequence=True)
    with pytest.raises(ValueError) as info:
        model(pixel_values=_inputs("vit", ROWS, 0, 0)["pixel_values"])
    return str(info.value)


def test_sequence_length_must_divide_by_tp():
    """The tiny ViT's 16 patches and class token make 17 positions."""
    assert run_distributed(odd_sequence, 2) == [
        "sequence_parallel: the sequence length 17 does not divide by tensor_parallel_degree 2; "
        "fix: pad or cut the inputs to a multiple of 2 positions, or set sequence_parallel to false"] * 2


def _plan_error(model, plan: TensorParallelPlan) -> str:
    """The plan is checked before any hook, style or collective (so no process group is needed)."""
    with pytest.raises(ConfigError) as info:
        shard_sequence(model, None, plan, assignments(model, plan), {})
    return str(info.value)


def test_plan_without_sequence_section():
    assert ("sequence_parallel=True: the tensor-parallel plan 'user' does not say where the sequence may be "
            "sharded; fix: give TensorParallelPlan(..., sequence=SequencePlan(blocks=..., norms=...)), or set "
            "sequence_parallel to false") in _plan_error(MODELS["mlp"](), TensorParallelPlan(USER_PLANS["mlp"]))


def test_norm_outside_the_blocks():
    """The final norm sees the whole sequence: as a 'shard' its weights' gradients would be summed tp times."""
    model = MODELS["gpt2"]()
    plan = dataclasses.replace(builtin_plan(model), sequence=SequencePlan("transformer.h.*", ("transformer.ln_f",)))
    assert ("tensor_parallel_plan.sequence.norms['transformer.ln_f']='transformer.ln_f': must be a module inside "
            "the blocks 'transformer.h.*' without another style; fix: list only the norms inside the blocks"
            ) in _plan_error(model, plan)
