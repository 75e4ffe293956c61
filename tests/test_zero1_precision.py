"""ZeRO-1 in bf16/fp16 keeps what SMP keeps: half-precision replicas, fp32 masters of each rank's share.

With `shard_optimizer_state` and `bf16` or `fp16`, every data-parallel replica
stores parameters and gradients in the compute dtype and the user's optimizer
(AdamW; SGD with momentum under tensor parallelism) steps fp32 master copies of
only this rank's share (parallel/zero1/master_weights.py). On 4
gloo ranks, through the seed's loop:

- same math: losses and final parameters match one plain PyTorch process doing
  the same mixed-precision arithmetic (`reference`): parameters rounded to the
  compute dtype, floating inputs cast to it and logits returned in fp32, each
  replica's gradient of each microbatch summed in fp32 and averaged, fp32 masters
  of the rounded initial weights stepped by AdamW and rounded back — with
  microbatches, global-norm clipping, fp16 loss scaling, and an fp16 overflow
  forced into one parameter on one rank, which must skip the step on every rank;
- bytes (MemTracker): parameters 2a, gradients 2a, optimizer (masters + AdamW
  moments) 12a/n per rank;
- why microbatches accumulate in fp32 (the error of accumulating them in bf16),
  and that they do;
- tensor parallelism 2 × 2 replicas and pipeline stages 2 × 2 replicas; the
  optimizer's state_dict round trip; weights loaded after the optimizer was
  built; the errors a user can meet.

Tolerances. Without tensor parallelism both sides run the same kernels, on one
thread each, on the same rows in the same dtypes, and here they agree bit for bit;
what may differ is the order of the fp32 sums over replicas (gloo's reduce against
one process's loop). Losses and gradient norms must agree within 1e-5 relative
and every parameter tensor within 1e-3 norm-relative, which leaves room for a sum that lands on a
bf16 rounding boundary and flips one element by one bf16 ulp (2^-8 relative).
With tensor parallelism the row-parallel layers add partial products in bf16
across the two ranks, a rounding one process never makes: losses within 1e-3,
gradient norms within 1e-2 and parameter tensors within 2e-2 after SGD (measured:
4e-4, 3e-3 and 1.3e-2, the worst on near-zero biases; Adam would turn the
different rounding of their tiny gradients into full-size steps). Counting a
parameter TP leaves whole on both TP ranks would put the norm 23 % off.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from shardwise.torch_internals import TorchDispatchMode

import shardwise as sw
from shardwise.parallel.zero1 import shares
from shardwise.testing import run_distributed
from tiny_models import build, dataset, loss_fn, make_optimizer, relative_error

WORLD, ROWS, STEPS = 4, 2, 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
INIT_SCALE = 2.0 ** 16  # torch's GradScaler default, which shardwise's fp16 loss scaler keeps
FORCED = "transformer.ln_f.bias"  # a small GPT-2 tensor: exactly one rank owns it
LOSS_TOLERANCE, PARAM_TOLERANCE = 1e-5, 1e-3


def _rows(data, step: int, index: int, rows: int, replicas: int):
    """The rows replica `index` of `replicas` trains on in `step`: consecutive slices of the global batch."""
    start = (step * replicas + index) * rows
    return data[start:start + rows]


class HalfPrecision(nn.Module):
    """The reference's mixed precision: floating inputs in the compute dtype, logits returned in fp32."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, inputs: torch.Tensor) -> dict:
        inputs = inputs.to(self.dtype) if inputs.is_floating_point() else inputs
        return {"logits": self.model(inputs)["logits"].float()}


@torch.no_grad()
def _reference_step(masters, trainable, total, optimizer, clip, dtype) -> float:
    """Clip the fp32 gradients by their global norm, step the masters, round them into the parameters;
    returns the norm."""
    norm = torch.stack([g.norm() ** 2 for g in total]).sum().sqrt()
    if clip is not None:
        coef = min(1.0, clip / (float(norm) + 1e-6))
        total = [g * coef for g in total]
    for master, grad in zip(masters, total):
        master.grad = grad
    optimizer.step()
    for param, master in zip(trainable, masters):
        param.copy_(master.to(dtype))
    return float(norm)


@functools.cache
def reference(kind: str, precision: str, optimizer: str = "adamw", replicas: int = WORLD, rows: int = ROWS,
              microbatches: int = 1, clip: float | None = None, overflow: tuple[int, int] | None = None) -> dict:
    """One plain process: the mixed-precision arithmetic above, replica by replica and microbatch by
    microbatch; `overflow` = (step, replica) puts an inf into one gradient there (fp16 skips that step).

    On one thread, as the harness's workers run: a bf16 matmul split over two threads sums in
    another order and rounds differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(kind, precision, optimizer, replicas, rows, microbatches, clip, overflow)
    finally:
        torch.set_num_threads(threads)


def half_model(kind: str, dtype: torch.dtype, **sizes) -> nn.Module:
    """The tiny model with its parameters rounded to `dtype`, as ZeRO-1 stores them."""
    model = build(kind, freeze_key_bias=True, **sizes)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def _reference(kind, precision, optimizer_name, replicas, rows, microbatches, clip, overflow) -> dict:
    dtype = DTYPES[precision]
    model = half_model(kind, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in trainable]
    optimizer = make_optimizer(optimizer_name, masters)
    scale = INIT_SCALE if precision == "fp16" else 1.0
    data = dataset(kind, STEPS * replicas * rows)
    losses, norms, half = [], [], HalfPrecision(model, dtype)
    for step in range(STEPS):
        total, step_losses = [torch.zeros_like(m) for m in masters], []
        batches = [[piece.chunk(microbatches) for piece in _rows(data, step, r, rows, replicas)]
                   for r in range(replicas)]
        for mb in range(microbatches):
            summed = [torch.zeros_like(m) for m in masters]
            for replica, (inputs, targets) in enumerate(batches):
                model.zero_grad()
                loss = loss_fn(kind, half, inputs[mb], targets[mb])
                (loss / microbatches * scale).backward()
                if overflow == (step, replica):
                    model.get_parameter(FORCED).grad.view(-1)[0] = float("inf")
                step_losses.append(loss.item())
                for s, p in zip(summed, trainable):
                    s += p.grad.float()
            for t, s in zip(total, summed):
                t += s / replicas
        losses.append(sum(step_losses) / len(step_losses))
        total = [t / scale for t in total]
        if all(torch.isfinite(t).all() for t in total):
            norms.append(_reference_step(masters, trainable, total, optimizer, clip, dtype))
        else:
            scale /= 2
    return {"losses": losses, "norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _checksum(model) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters())


class SeedLoop:
    """One rank of the seed's loop: `sw.init(config)`, the model, the user's optimizer and a @step function
    whose microbatches call `after_backward(model)` right after `model.backward`; `before_optimizer(model)`
    runs before the optimizer exists (so its gradient hooks run before ZeRO-1's)."""

    def __init__(self, config: dict, kind: str = "gpt2", optimizer: str = "adamw", freeze_key_bias: bool = True,
                 before_optimizer=lambda model: None, **sizes):
        sw.init(config)
        self.kind = kind
        self.model = sw.DistributedModel(build(kind, freeze_key_bias=freeze_key_bias, **sizes))
        before_optimizer(self.model)
        self.optimizer = sw.DistributedOptimizer(make_optimizer(optimizer, self.model.parameters()))
        self.data = dataset(kind, STEPS * ROWS * sw.dp_size())
        self.after_backward = lambda model: None
        self.train_step = sw.step(self._microbatch)

    def _microbatch(self, model, inputs, targets):
        loss = loss_fn(self.kind, model, inputs, targets)
        model.backward(loss)
        self.after_backward(model)
        return loss

    def step(self, index: int) -> float | None:
        """Optimizer step `index` on this rank's rows; returns the mean loss of its microbatches (None on a
        pipeline stage that does not compute the loss)."""
        self.optimizer.zero_grad()
        batch = _rows(self.data, index, sw.dp_rank(), ROWS, sw.dp_size())
        loss = self.train_step(self.model, *batch).reduce_mean()
        self.optimizer.step()
        return None if loss is None else loss.item()

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.model.full_state_dict().items()}


def _with_inf(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def train_zero1(kind: str, config: dict, optimizer: str = "adamw", overflow: tuple[int, int] | None = None) -> dict:
    """One rank of the seed's loop under `config`; `overflow` = (step, rank) forces an inf gradient there
    (as backward computes it: ZeRO-1 sends gradients on while backward still runs)."""
    loop = SeedLoop(config, kind, optimizer)
    model, losses, skipped, norms = loop.model, [], [], []
    for step in range(STEPS):
        forced = (dict(model.named_parameters())[FORCED].register_hook(_with_inf)
                  if overflow == (step, sw.rank()) else None)
        before = _checksum(model)
        losses.append(loop.step(step))
        if forced is not None:
            forced.remove()
        skipped.append(_checksum(model) == before)
        if loop.optimizer.grad_norm is not None and not skipped[-1]:
            norms.append(float(loop.optimizer.grad_norm))
    scaler = model.loss_scaler
    return {"losses": losses, "norms": norms, "state": model.full_state_dict(), "skipped": skipped,
            "scale": None if scaler is None else float(scaler.get_scale()),
            "dtypes": {str(p.dtype) for p in model.parameters()},
            "tensor_parallel": any(isinstance(p, DTensor) for p in model.parameters()),
            "names": sorted(model.sharded_state_dict())}


def _assert_same_math(ranks: list[dict], want: dict, loss_tol: float, param_tol: float,
                      norm_tol: float = LOSS_TOLERANCE) -> None:
    losses = torch.tensor([r["losses"] for r in ranks if r["losses"][0] is not None]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want["losses"]), rtol=loss_tol, atol=0)
    for result in ranks:  # the global gradient norm, where clipping computes it
        assert result["norms"] == [] or result["norms"] == pytest.approx(want["norms"], rel=norm_tol)
    names = set(want["state"])  # state_dict names stay the user's model's (a pipeline stage holds some)
    assert set().union(*(r["names"] for r in ranks)) == names and all(set(r["names"]) <= names for r in ranks)
    for rank, result in enumerate(ranks):
        errors = {k: relative_error(result["state"][k], v) for k, v in want["state"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= param_tol, f"rank {rank}: {worst} differs by {errors[worst]:.2e} (relative)"


CASES = {
    "bf16": {"bf16": True},
    "bf16-microbatches-clipping": {"bf16": True, "microbatches": 2, "gradient_clipping": 0.5},
    "fp16-microbatches-clipping": {"fp16": True, "microbatches": 2, "gradient_clipping": 0.5},
    # each rank adds its microbatches up in fp32 and reduces the sums once: the same fp32 sums, in another order
    "bf16-microbatches-clipping-local": {"bf16": True, "microbatches": 2, "gradient_clipping": 0.5,
                                         "accumulate_gradients_locally": True},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_matches_one_process_doing_the_same_mixed_precision(kind, case):
    config = {"shard_optimizer_state": True, **CASES[case]}
    ranks = run_distributed(train_zero1, WORLD, kind, config, timeout=300)
    precision = "bf16" if config.get("bf16") else "fp16"
    want = reference(kind, precision, microbatches=config.get("microbatches", 1),
                     clip=config.get("gradient_clipping"))
    _assert_same_math(ranks, want, LOSS_TOLERANCE, PARAM_TOLERANCE)
    assert all(r["dtypes"] == {str(DTYPES[precision])} for r in ranks)


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    """An inf in one tensor's gradient on rank 2 reaches only that tensor's owner; every rank must still
    skip step 1 and halve its loss scale, then train on as the reference does."""
    ranks = run_distributed(train_zero1, WORLD, "gpt2", {"shard_optimizer_state": True, "fp16": True},
                            overflow=(1, 2), timeout=300)
    for result in ranks:
        assert result["skipped"] == [False, True, False]
        assert result["scale"] == INIT_SCALE / 2
    _assert_same_math(ranks, reference("gpt2", "fp16", overflow=(1, 2)), LOSS_TOLERANCE, PARAM_TOLERANCE)


@pytest.mark.parametrize("kind", ["gpt2", "vit"])
def test_composes_with_tensor_parallelism(kind):
    """TP 2 inside, ZeRO-1 over 2 replicas, SGD with momentum, clipping: each replica is one TP group
    training on its two ranks' rows; parameters stay DTensors in bf16 with the user's names, and the
    global norm counts each split piece once and each whole parameter once."""
    config = {"tensor_parallel_degree": 2, "shard_optimizer_state": True, "bf16": True, "gradient_clipping": 0.5}
    ranks = run_distributed(train_zero1, WORLD, kind, config, "sgd", timeout=300)
    _assert_same_math(ranks, reference(kind, "bf16", "sgd", replicas=2, rows=2 * ROWS, clip=0.5), 1e-3, 2e-2, 1e-2)
    assert all(r["dtypes"] == {"torch.bfloat16"} and r["tensor_parallel"] for r in ranks)


def test_composes_with_pipeline_parallelism():
    """2 stages × 2 replicas, AdamW, clipping, the tied embedding and head on different stages (counted
    once in the norm): bit for bit the reference on 2 replicas. (A schedule runs its microbatches itself,
    so they accumulate in bf16 until the last one's backward sends them; one microbatch here.)"""
    config = {"pipeline_parallel_degree": 2, "shard_optimizer_state": True, "bf16": True, "gradient_clipping": 0.5}
    ranks = run_distributed(train_zero1, WORLD, "gpt2", config, timeout=300)
    _assert_same_math(ranks, reference("gpt2", "bf16", replicas=2, clip=0.5), LOSS_TOLERANCE, PARAM_TOLERANCE)


# (losses, parameters, norms). GPT-2's embedding is tied to the head on the other stage: its copies' gradients add
# up in fp32 across the stages, where one process's autograd adds the two uses in bf16 first: one bf16 rounding of
# that gradient (2^-9 relative) apart, 8.7e-5 of the clip norm measured.
PIPELINE_LOCAL_TOLERANCES = {"llama": (LOSS_TOLERANCE, PARAM_TOLERANCE), "gpt2": (1e-4, PARAM_TOLERANCE, 2e-4)}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_pipeline_microbatches_accumulated_locally_sum_in_fp32(kind):
    """With accumulate_gradients_locally the schedule's two microbatches add up in fp32 on each stage's ranks, as
    the reference sums them: the same math, where accumulating them in bf16 would round each sum to 8 bits (Llama,
    untied). GPT-2's tied embedding and head sum their copies across the stages in fp32 too (its tolerances:
    PIPELINE_LOCAL_TOLERANCES)."""
    config = {"pipeline_parallel_degree": 2, "shard_optimizer_state": True, "bf16": True, "gradient_clipping": 0.5,
              "microbatches": 2, "accumulate_gradients_locally": True}
    ranks = run_distributed(train_zero1, WORLD, kind, config, timeout=300)
    want = reference(kind, "bf16", replicas=2, microbatches=2, clip=0.5)
    _assert_same_math(ranks, want, *PIPELINE_LOCAL_TOLERANCES[kind])


# ----- microbatch accumulation -----

ACCUMULATION_ROWS, ACCUMULATION_SIZES = 64, {"layers": 2, "hidden": 64, "heads": 4}


def _microbatch_gradients(model: nn.Module, dtype: torch.dtype, microbatches: int) -> list[list[torch.Tensor]]:
    """Each microbatch's half-precision gradients (loss divided by the microbatches, as model.backward does)."""
    inputs, targets = dataset("gpt2", ACCUMULATION_ROWS)[:]
    grads = []
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        model.zero_grad()
        (loss_fn("gpt2", HalfPrecision(model, dtype), x, y) / microbatches).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    return grads


def _fp32_sum(per_microbatch: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(g.float() for g in grads) for grads in zip(*per_microbatch)]


def _norm_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = sum(float((g.double() - w.double()).norm()) ** 2 for g, w in zip(got, want))
    return (diff / sum(float(w.double().norm()) ** 2 for w in want)) ** 0.5


def test_half_precision_accumulation_loses_what_bf16_computes():
    """Why microbatches accumulate in fp32: summing m microbatches' bf16 gradients in bf16 errs like √m and by
    m = 32 exceeds the error of the bf16 forward and backward themselves (against the fp32 model on the
    same weights). Prints docs/sharding.md's table."""
    errors = {}
    for name, dtype in DTYPES.items():
        model = half_model("gpt2", dtype, **ACCUMULATION_SIZES)
        exact = build("gpt2", freeze_key_bias=True, **ACCUMULATION_SIZES)  # fp32, on the rounded weights
        exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        loss_fn("gpt2", exact, *dataset("gpt2", ACCUMULATION_ROWS)[:]).backward()
        own = _norm_error(_fp32_sum(_microbatch_gradients(model, dtype, 1)),
                          [p.grad for p in exact.parameters() if p.requires_grad])
        for m in (2, 4, 8, 32):
            per = _microbatch_gradients(model, dtype, m)
            half = [functools.reduce(torch.add, grads) for grads in zip(*per)]
            errors[name, m] = _norm_error(half, _fp32_sum(per)) / own
        print(f"\n{name}: own error {own:.1e}; half-precision accumulation / own: "
              + ", ".join(f"m={m} {errors[name, m]:.2f}" for m in (2, 4, 8, 32)))
    assert errors["bf16", 2] < errors["bf16", 8] < errors["bf16", 32] and errors["bf16", 32] > 0.5


def accumulated_master_gradients(microbatches: int) -> float:
    """One rank: the master gradients after one @step against the fp32 sum of the same microbatches'
    bf16 gradients computed here by a plain copy of the model."""
    config = {"shard_optimizer_state": True, "bf16": True, "microbatches": microbatches}
    loop = SeedLoop(config, **ACCUMULATION_SIZES)
    loop.train_step(loop.model, *dataset("gpt2", ACCUMULATION_ROWS)[:])
    masters = [p.grad for group in loop.optimizer.param_groups for p in group["params"] if p.dtype == torch.float32]
    plain = half_model("gpt2", torch.bfloat16, **ACCUMULATION_SIZES)
    plain.load_state_dict(loop.model.state_dict())
    return _norm_error(masters, _fp32_sum(_microbatch_gradients(plain, torch.bfloat16, microbatches)))


def test_microbatches_accumulate_in_fp32_master_gradients():
    """On one rank (all masters its own), eight microbatches' gradients sum in fp32: exactly the plain sum."""
    assert run_distributed(accumulated_master_gradients, 1, 8, timeout=120) == [0.0]


# ----- bytes -----

SIZES = {"layers": 4, "hidden": 64, "heads": 4}


def _by_name(tracker: MemTracker) -> dict[str, int]:
    snapshot = tracker.get_tracker_snapshot()[torch.device("cpu")]
    return {getattr(category, "value", category): int(value) for category, value in snapshot.items()}


def _settled(tracker: MemTracker) -> dict[str, int]:
    """The tracker's bytes once two snapshots 20 ms apart agree: gloo's worker thread drops its reference to a
    reduce's buffer shortly after the reduce's `wait()` returns, so a buffer just waited for may still count."""
    last = _by_name(tracker)
    for _ in range(100):
        time.sleep(0.02)
        now = _by_name(tracker)
        if now == last:
            return now
        last = now
    return last


def _gradient_bytes(model: nn.Module) -> int:
    return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)


def _watch_gradients(seen: list[int]):
    """A `before_optimizer` for SeedLoop: record the half-precision gradient bytes alive each time a gradient
    has accumulated, before ZeRO-1's hook on it may send (and free) its bucket."""
    def watch(model: nn.Module) -> None:
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda _: seen.append(_gradient_bytes(model)))
    return watch


def measure_model_states(config: dict) -> dict:
    """This rank's bytes after backward and after the second AdamW step (the first creates the moments), and
    the most bytes of half-precision gradients alive at once."""
    alive: list[int] = []
    loop = SeedLoop(config, freeze_key_bias=False, before_optimizer=_watch_gradients(alive), **SIZES)
    masters = [p for group in loop.optimizer.param_groups for p in group["params"]]
    loop.step(0)
    tracker, snapshots = MemTracker(), {}
    tracker.track_external(loop.model.get_module(), loop.optimizer.optimizer, *masters)  # masters count as "Other"
    loop.after_backward = lambda model: snapshots.update(backward=_settled(tracker))
    with tracker:
        loop.step(1)
    snapshots["step"] = _by_name(tracker)
    snapshots["gradients_alive"] = max(alive)
    snapshots["owned"], snapshots["owned_tensors"] = sum(m.numel() for m in masters), len(masters)
    snapshots["master_dtypes"] = {str(m.dtype) for m in masters}
    return snapshots


def test_model_states_per_rank_are_smps():
    """Parameters 2a and gradients at most 2a on every rank; masters (4) and AdamW moments (8) for this rank's
    share only, which ZeRO-1 deals in whole tensors: within 12 bytes × the largest tensor of 12a/n, and 12a
    over all ranks (plus AdamW's 4-byte step counter per tensor). By the end of backward the half-precision
    gradients are gone, sent to their owners, whose fp32 master gradients (4 bytes per owned parameter, and
    its flag) backward allocated; the step releases those."""
    config = {"shard_optimizer_state": True, "bf16": True}
    ranks = run_distributed(measure_model_states, WORLD, config, timeout=300)
    shapes = [p.shape for p in build("gpt2", **SIZES).parameters()]
    a, largest = sum(s.numel() for s in shapes), max(s.numel() for s in shapes)
    for rank, got in enumerate(ranks):
        assert got["master_dtypes"] == {"torch.float32"}
        assert got["step"]["Parameter"] == 2 * a, f"rank {rank}: parameters are not 2 bytes each"
        assert 0 < got["gradients_alive"] <= 2 * a, f"rank {rank}: gradients are not 2 bytes each"
        assert got["backward"]["Gradient"] == 0
        assert got["backward"]["Temp"] == 4 * got["owned"] + 4 * got["owned_tensors"], f"rank {rank}: fp32 gradients"
        assert got["step"].get("Gradient", 0) == 0 and got["step"].get("Temp", 0) == 0
        optimizer = got["step"]["Optstate"] + got["step"]["Other"]
        assert optimizer == 12 * got["owned"] + 4 * got["owned_tensors"], f"rank {rank}: optimizer {optimizer} bytes"
        assert abs(12 * got["owned"] - 12 * a / WORLD) <= 12 * largest, f"rank {rank}: share {got['owned']} of {a}"
    assert sum(r["owned"] for r in ranks) == a and sum(r["owned_tensors"] for r in ranks) == len(shapes)


# ----- overlap with backward -----

SMALL_BUCKET = 8 * 1024  # bytes of fp32: the 64-wide GPT-2's matrices travel alone, its vectors in groups


def small_buckets(build_loop, *args, **kwargs):
    """`build_loop(*args, **kwargs)` with ZeRO-1's buckets of SMALL_BUCKET bytes (read when the optimizer is
    built); the pooled worker gets the default back."""
    default, shares.BUCKET_BYTES = shares.BUCKET_BYTES, SMALL_BUCKET
    try:
        return build_loop(*args, **kwargs)
    finally:
        shares.BUCKET_BYTES = default


class Collectives(TorchDispatchMode):
    """Counts the c10d calls of `op` (e.g. "reduce_") issued while active, and the bytes they carry."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.calls = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.overloadpacket.__name__ == self.op:
            self.calls += 1
            self.bytes += sum(t.nbytes for t in args[0])
        return func(*args, **(kwargs or {}))


def reduces_during_backward(microbatches: int, local: bool = False) -> dict:
    """One @step under ZeRO-1 in bf16 with small buckets (`local`: accumulate_gradients_locally): the reduces
    issued by the time backward reaches the token embedding (whose gradient comes last), and in all; the
    half-precision gradient bytes alive at most; after each microbatch's backward, the elements of the buckets'
    local fp32 sums and the gradients left on the parameters; the buckets, and how many hold an embedding."""
    config = {"shard_optimizer_state": True, "bf16": True, "microbatches": microbatches,
              "accumulate_gradients_locally": local}
    alive: list[int] = []
    loop = small_buckets(SeedLoop, config, freeze_key_bias=False, before_optimizer=_watch_gradients(alive), **SIZES)
    counter, before_embedding, after_backward = Collectives("reduce_"), [], []
    transformer = loop.model.get_module().transformer
    transformer.wte.weight.register_hook(lambda grad: before_embedding.append(counter.calls))
    buckets = loop.optimizer._update.masters.buckets.buckets
    loop.after_backward = lambda model: after_backward.append(
        (sum(b.sums.numel() for b in buckets if b.sums is not None), _gradient_bytes(model)))
    with counter:
        loop.step(0)
    embeddings = {id(transformer.wte.weight), id(transformer.wpe.weight)}
    return {"before_embedding": before_embedding, "calls": counter.calls, "bytes": counter.bytes,
            "buckets": len(buckets), "gradients_alive": max(alive), "after_backward": after_backward,
            "embedding_buckets": sum(any(id(p) in embeddings for p in b.params) for b in buckets)}


def pipeline_reduces(microbatches: int) -> dict:
    """One @step on 2 stages × 2 replicas with small buckets: the reduces issued by the time the schedule is
    done (all microbatches' backward), and in all; the buckets, and how many hold a weight tied across stages."""
    config = {"pipeline_parallel_degree": 2, "shard_optimizer_state": True, "bf16": True,
              "microbatches": microbatches}
    loop = small_buckets(SeedLoop, config, freeze_key_bias=False, **SIZES)
    update = loop.optimizer._update
    counter, at_schedule_end, end_round = Collectives("reduce_"), [], update.after_backward_passes
    update.after_backward_passes = lambda: (at_schedule_end.append(counter.calls), end_round())
    with counter:
        loop.step(0)
    buckets, tied = update.masters.buckets.buckets, loop.model._strategy.ties.held()
    return {"at_schedule_end": at_schedule_end, "calls": counter.calls, "buckets": len(buckets),
            "tied_buckets": sum(any(id(p) in tied for p in b.params) for b in buckets)}


def test_pipeline_sends_each_bucket_once_during_the_last_backward():
    """Under a pipeline the schedule's two microbatches accumulate in the gradients, and each bucket goes once
    per step, during the last microbatch's backward, except those holding the embedding tied to the head on
    the other stage, which go once the schedule has summed the copies."""
    for got in run_distributed(pipeline_reduces, WORLD, 2, timeout=300):
        assert got["tied_buckets"] == 1 and got["calls"] == got["buckets"]
        assert got["at_schedule_end"] == [got["buckets"] - got["tied_buckets"]]


def test_gradients_travel_while_backward_runs():
    """As DDP's buckets: every microbatch's backward sends each bucket as soon as its gradients are complete,
    so all but the embeddings' buckets are on their way before backward reaches the token embedding; each
    bucket goes once per microbatch, carrying 4 bytes per parameter (and a flag per tensor); and small
    buckets free the half-precision gradients as backward goes, keeping a fraction of 2a alive."""
    a = sum(p.numel() for p in build("gpt2", **SIZES).parameters())
    tensors = len(list(build("gpt2", **SIZES).parameters()))
    for got in run_distributed(reduces_during_backward, WORLD, 2, timeout=300):
        assert got["buckets"] > 2 * WORLD
        assert got["calls"] == 2 * got["buckets"] and got["bytes"] == 2 * 4 * (a + tensors)
        first, second = got["before_embedding"]
        assert first >= got["buckets"] - got["embedding_buckets"]
        assert second - got["buckets"] >= got["buckets"] - got["embedding_buckets"]
        assert got["gradients_alive"] < 2 * a / 4


def test_gradients_accumulated_locally_travel_once_during_the_last_backward():
    """With accumulate_gradients_locally the first microbatch's backward sends nothing: its gradients are added
    into fp32 sums of the whole model on every rank (4 bytes and a flag per tensor, the half-precision gradients
    freed as they are added); the last microbatch's backward sends each bucket once, as soon as it is complete,
    with 4 bytes per parameter: half the reduces and bytes of sending every microbatch."""
    a = sum(p.numel() for p in build("gpt2", **SIZES).parameters())
    tensors = len(list(build("gpt2", **SIZES).parameters()))
    for got in run_distributed(reduces_during_backward, WORLD, 2, True, timeout=300):
        assert got["calls"] == got["buckets"] and got["bytes"] == 4 * (a + tensors)
        first, second = got["before_embedding"]
        assert first == 0 and second >= got["buckets"] - got["embedding_buckets"]
        assert got["after_backward"][0] == (a + tensors, 0)
        assert got["after_backward"][1] == (0, 0)
        assert got["gradients_alive"] < 2 * a / 4


# ----- state, loading, errors -----


def _distance(x: dict, y: dict) -> float:
    return sum(float((x[k].double() - y[k].double()).norm()) ** 2 for k in y) ** 0.5


def resume_and_errors() -> dict:
    """Step twice, then rewind to the state saved after step 1 and redo step 2; load other weights after
    the optimizer exists and step; meet the two user errors."""
    loop = SeedLoop({"shard_optimizer_state": True, "bf16": True})
    model, optimizer = loop.model, loop.optimizer
    loop.step(0)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    loop.step(1)
    first = loop.weights()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    loop.step(1)
    again = loop.weights()

    other = {k: v.to(torch.bfloat16) for k, v in build("gpt2", freeze_key_bias=True, seed=99).state_dict().items()}
    model.load_state_dict(other)
    loop.step(0)
    moved = loop.weights()
    with pytest.raises(RuntimeError, match="backward sends the gradients to fp32 master copies, which "
                                           "optimizer.step.. clips; set gradient_clipping in the config instead"):
        model.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="holds 0 fp32 master tensors but this rank owns"):
        optimizer.load_state_dict({**saved[1], "fp32_master_params": []})
    return {"rewound": max(relative_error(again[k], v) for k, v in first.items()),
            "to_loaded": _distance(moved, other), "to_replaced": _distance(moved, again)}


def test_state_dict_resume_loaded_weights_and_errors():
    """The optimizer's state_dict carries the fp32 masters: rewinding redoes step 2 bit for bit. Weights
    loaded after the optimizer was built are where the next step starts. Clipping by hand and a state
    saved for another layout are refused with the fix."""
    for result in run_distributed(resume_and_errors, WORLD, timeout=300):
        assert result["rewound"] == 0
        assert result["to_loaded"] < 0.1 * result["to_replaced"], "the old masters overwrote the loaded weights"


def halve_then_step(config: dict) -> dict:
    """After a step, halve every weight in place through the parameters (DTensors under tensor parallelism),
    then step again: how far the result lies from the halved weights and from the unhalved ones."""
    loop = SeedLoop(config)
    loop.step(0)
    before = loop.weights()
    with torch.no_grad():
        for param in loop.model.parameters():
            param.mul_(0.5)
    halved = loop.weights()
    loop.step(1)
    moved = loop.weights()
    return {"to_halved": _distance(moved, halved), "to_before": _distance(moved, before)}


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_changed_after_the_optimizer_exists_are_where_the_next_step_starts(tp):
    """The fp32 masters adopt weights written outside the optimizer. A write through a tensor-parallel DTensor
    counts on the DTensor's own version counter, not its local tensor's: the masters must ask the parameter."""
    config = {"shard_optimizer_state": True, "bf16": True, "tensor_parallel_degree": tp}
    for result in run_distributed(halve_then_step, WORLD, config, timeout=300):
        assert result["to_halved"] < 0.1 * result["to_before"], "the old masters overwrote the changed weights"
