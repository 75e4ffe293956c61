"""SMP v1's `@smp.step` surface: its arguments, `smp_slice` and return structures, against one plain process.

One 2-rank DDP world with microbatches=2 runs the same loss through every form of
the decorator — bare, called, `non_split_inputs` (a class-weight vector passed
whole, a float and a string passed through), `input_split_axes` (a batch on dim 1,
also through **kwargs), an `smp_slice` object, `detach_outputs=False` — returning
a tensor, a tuple or a dict. Each matches one plain process on the global batch:
the loss (mean over ranks of `reduce_mean()`), every gradient, and the logits
(`concat()` of this rank's rows). A 2-stage pipeline returns tuples and dicts
with the same structure on both ranks (values on the last stage only).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import VOCAB, TinyStack, build, dataset, relative_error

ROWS = 4  # per rank; 2 per microbatch
TOLERANCE = 1e-5
SCALE = 0.5


def class_weights() -> torch.Tensor:
    """One weight per token class: no batch dim, so it must reach every microbatch whole."""
    return torch.linspace(0.5, 1.5, VOCAB)


def weighted_loss(model, ids: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, scale: float):
    """A mean over tokens (so microbatch means average to the batch mean); the logits and the loss."""
    logits = model(ids)["logits"]
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten(), reduction="none")
    return logits, (per_token * weights[targets[:, 1:].flatten()]).mean() * scale


class Rows:
    """A batch that is no tensor, list or dict: SMP splits it by calling its `smp_slice`."""

    def __init__(self, ids: torch.Tensor, targets: torch.Tensor):
        self.ids, self.targets = ids, targets

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> "Rows":
        size = self.ids.size(axis) // num_mb
        return Rows(self.ids.narrow(axis, mb * size, size), self.targets.narrow(axis, mb * size, size))


def step_functions() -> dict:
    """Every form of the decorator, each computing `weighted_loss` and returning it in its own structure."""
    seen: list = []  # the non-tensor arguments each microbatch received

    @sw.step
    def bare(model, ids, targets):
        _, loss = weighted_loss(model, ids, targets, class_weights(), SCALE)
        model.backward(loss)
        return loss

    @sw.step()
    def called(model, ids, targets):
        logits, loss = weighted_loss(model, ids, targets, class_weights(), SCALE)
        model.backward(loss)
        return logits, loss

    @sw.step(non_split_inputs=["weights"])
    def whole(model, ids, targets, weights, scale, tag):
        seen.append((tuple(weights.shape), scale, tag))
        logits, loss = weighted_loss(model, ids, targets, weights, scale)
        model.backward(loss)
        return {"loss": loss, "logits": logits, "rows": len(ids), "nothing": None}

    @sw.step(input_split_axes={"ids_t": 1, "targets_t": 1})
    def transposed(model, ids_t, targets_t):
        logits, loss = weighted_loss(model, ids_t.t(), targets_t.t(), class_weights(), SCALE)
        model.backward(loss)
        return [loss, logits]

    @sw.step(non_split_inputs=["weights"], input_split_axes={"ids_t": 1, "targets_t": 1})
    def keywords(model, **batch):
        logits, loss = weighted_loss(model, batch["ids_t"].t(), batch["targets_t"].t(), batch["weights"], SCALE)
        model.backward(loss)
        return {"out": (logits, loss)}

    @sw.step
    def sliced(model, rows):
        logits, loss = weighted_loss(model, rows.ids, rows.targets, class_weights(), SCALE)
        model.backward(loss)
        return loss, logits

    @sw.step(detach_outputs=False)
    def attached(model, ids, targets):
        logits, loss = weighted_loss(model, ids, targets, class_weights(), SCALE)
        model.backward(loss)
        return {"loss": loss, "logits": logits}

    def calls(model, ids, targets):
        """name -> (call, where the loss and the logits are in its result)."""
        t = (ids.t().contiguous(), targets.t().contiguous())
        return {
            "bare": (lambda: bare(model, ids, targets), lambda out: (out, None)),
            "called": (lambda: called(model, ids, targets), lambda out: (out[1], out[0])),
            "whole": (lambda: whole(model, ids, targets, class_weights(), SCALE, "tag"),
                      lambda out: (out["loss"], out["logits"])),
            "transposed": (lambda: transposed(model, *t), lambda out: (out[0], out[1])),
            "keywords": (lambda: keywords(model, ids_t=t[0], targets_t=t[1], weights=class_weights()),
                         lambda out: (out["out"][1], out["out"][0])),
            "sliced": (lambda: sliced(model, Rows(ids, targets)), lambda out: (out[0], out[1])),
            "attached": (lambda: attached(model, ids, targets), lambda out: (out["loss"], out["logits"])),
        }

    return {"calls": calls, "seen": seen}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def my_rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids, targets = dataset("stack", ROWS * sw.dp_size())[:]
    mine = slice(sw.dp_rank() * ROWS, (sw.dp_rank() + 1) * ROWS)
    return ids[mine], targets[mine]


def every_form() -> dict:
    """One rank: each decorator form's loss, gradients and logits on this rank's rows, and what it returned."""
    sw.init({"microbatches": 2})
    model = sw.DistributedModel(build("stack"))
    opt = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids, targets = my_rows()
    forms = step_functions()
    results = {}
    for name, (call, parts) in forms["calls"](model, ids, targets).items():
        opt.zero_grad()
        out = call()
        loss, logits = parts(out)
        results[name] = {
            "loss": loss.reduce_mean().item(), "microbatches": len(loss),
            "grads": {n: _plain(p.grad) for n, p in model.named_parameters()},
            "logits": None if logits is None else _plain(logits.concat()),
            "grad_fn": [o.grad_fn is not None for o in loss.outputs],
            "types": sorted({type(leaf).__name__ for leaf in _leaves(out) if leaf is not None}),
        }
    results["whole"]["rows"] = parts_of(forms["calls"](model, ids, targets)["whole"][0]())
    results["seen"] = forms["seen"]
    results["errors"] = call_errors(model, ids, targets)
    return results


def _leaves(out) -> list:
    if isinstance(out, dict):
        return [leaf for value in out.values() for leaf in _leaves(value)]
    if isinstance(out, (tuple, list)):
        return [leaf for value in out for leaf in _leaves(value)]
    return [out]


def parts_of(out: dict) -> dict:
    return {"rows": out["rows"].outputs, "rows_sum": out["rows"].reduce_sum().item(), "nothing": out["nothing"]}


def call_errors(model, ids, targets) -> dict:
    """The one-line errors of bad calls: an axis the tensor lacks, rows microbatches cannot split, a result
    whose structure changes between microbatches."""

    @sw.step(input_split_axes={"ids": 2})
    def no_such_dim(model, ids):
        return model(ids)["logits"].sum()

    ran: list = []

    @sw.step
    def changing(model, ids):
        ran.append(ids)
        loss = model(ids)["logits"].sum()
        return loss if len(ran) == 1 else (loss,)

    cases = {
        "axis": lambda: no_such_dim(model, ids),
        "rows": lambda: sw.step(lambda model, ids: model(ids))(model, ids[:3]),
        "structure": lambda: changing(model, ids),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
        except ValueError as err:
            messages[name] = str(err)
    return messages


@functools.cache
def distributed_forms() -> list[dict]:
    return run_distributed(every_form, 2, timeout=300)


@functools.cache
def reference() -> dict:
    """One plain process on both ranks' rows: the loss, every gradient and the logits."""
    model = build("stack")
    ids, targets = dataset("stack", 2 * ROWS)[:]
    logits, loss = weighted_loss(model, ids, targets, class_weights(), SCALE)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "logits": logits.detach()}


FORMS = ("bare", "called", "whole", "transposed", "keywords", "sliced", "attached")


@pytest.mark.parametrize("form", FORMS)
def test_every_form_matches_one_process(form):
    want = reference()
    ranks = [r[form] for r in distributed_forms()]
    assert all(r["microbatches"] == 2 for r in ranks)
    assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(want["loss"], rel=TOLERANCE)
    for rank, r in enumerate(ranks):
        for name, grad in want["grads"].items():
            assert relative_error(r["grads"][name], grad) <= TOLERANCE, (form, rank, name)
        if r["logits"] is not None:
            assert relative_error(r["logits"], want["logits"][rank * ROWS:(rank + 1) * ROWS]) <= TOLERANCE
        assert r["types"] == ["StepOutput"]  # every tensor leaf of the returned structure
        assert r["grad_fn"] == [form == "attached"] * 2  # detach_outputs=False keeps the graphs


def test_non_split_and_non_tensor_arguments_reach_every_microbatch_whole():
    for r in distributed_forms():
        # whole's microbatches, twice: once in the compared run, once in `parts_of`
        assert r["seen"] == [((VOCAB,), SCALE, "tag")] * 4
        assert r["whole"]["rows"] == {"rows": [2, 2], "rows_sum": 4, "nothing": None}


def test_bad_calls_are_one_line_errors():
    assert distributed_forms()[0]["errors"] == {
        "axis": "@step cannot split argument 'ids' along dim 2: it holds a tensor of shape (4, 8); give its batch "
                "dim in input_split_axes or list it in non_split_inputs",
        "rows": "@step cannot split a batch of 3 rows into 2 equal microbatches; make the per-rank batch size a "
                "multiple of microbatches=2",
        "structure": "the @step function returned Tensor for microbatch 0 but (Tensor,) for microbatch 1; return "
                     "the same structure for every microbatch",
    }


def test_bad_options_are_one_line_errors():
    def train_step(model, inputs, targets):
        return model(inputs)

    cases = {
        "string": (lambda: sw.step(non_split_inputs="mask"), TypeError,
                   ("@step(non_split_inputs='mask'): give a list of the step function's argument names, "
                    "e.g. non_split_inputs=['mask']")),
        "axes": (lambda: sw.step(input_split_axes=[1]), TypeError,
                 ("@step(input_split_axes=[1]): give a dict of argument name -> batch dim, "
                  "e.g. input_split_axes={'inputs': 1}")),
        "detach": (lambda: sw.step(detach_outputs="no"), TypeError,
                   "@step(detach_outputs='no'): give True or False"),
        "unknown": (lambda: sw.step(non_split_inputs=["mask"])(train_step), ValueError,
                    ("@step(non_split_inputs=...): train_step has no argument 'mask'; name arguments as in its "
                     "signature (model, inputs, targets)")),
        "both": (lambda: sw.step(["inputs"], {"inputs": 1})(train_step), ValueError,
                 ("@step: 'inputs' is in both non_split_inputs and input_split_axes; an argument is either passed "
                  "whole or split along one axis")),
    }
    for name, (call, error, message) in cases.items():
        with pytest.raises(error) as caught:
            call()
        assert str(caught.value) == message, name


class ScaledStack(TinyStack):
    """A stack whose forward takes a float too: under a pipeline it reaches every stage as it is."""

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> dict:
        return {"logits": super().forward(ids)["logits"] * scale}


class ScaledRows(Rows):
    """Rows whose microbatches each carry a scale of their own (which the pipeline cannot send)."""

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> Rows:
        sliced = super().smp_slice(num_mb, mb, axis)
        return ScaledRows(sliced.ids, sliced.targets) if mb == 0 else Rows(sliced.ids, sliced.targets)


def pipelined() -> dict:
    """One rank of 2 stages: tuple and dict results, their losses and this stage's gradients."""
    sw.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(1234)
    model = sw.DistributedModel(ScaledStack(layers=2))
    opt = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids, targets = dataset("stack", 2 * ROWS)[:]
    forms = step_functions()["calls"](model, ids, targets)
    results = {}
    for name in ("called", "whole", "transposed", "sliced", "attached"):
        opt.zero_grad()
        call, parts = forms[name]
        out = call()
        loss, logits = parts(out)
        results[name] = {
            "holds": loss.holds_loss, "loss": loss.reduce_mean(), "logits": logits.concat(),
            "lengths": (len(loss), len(logits)), "grad_fn": [o.grad_fn is not None for o in loss.outputs],
            "grads": {n: _plain(p.grad) for n, p in model.named_parameters()},
            "shape": type(out).__name__ + (f"{sorted(out)}" if isinstance(out, dict) else f"{len(out)}"),
        }

    @sw.step
    def per_microbatch_scale(model, rows):
        loss = model(rows.ids, scale=2.0 if isinstance(rows, ScaledRows) else 1.0)["logits"].mean()
        model.backward(loss)
        return loss

    try:
        per_microbatch_scale(model, ScaledRows(ids, targets))
    except TypeError as err:
        results["error"] = str(err)
    return results


def test_pipeline_returns_every_output_on_pp_rank_0_as_smp_did():
    """The loss is computed outside the model, on the last stage; pp rank 0, where SMP's scripts log, gets the
    loss and the logits too (detached copies), and still knows it did not compute them (`holds_loss`)."""
    torch.manual_seed(1234)
    plain = ScaledStack(layers=2)
    ids, targets = dataset("stack", 2 * ROWS)[:]
    logits, loss = weighted_loss(plain, ids, targets, class_weights(), SCALE)
    loss.backward()
    ranks = run_distributed(pipelined, 2, timeout=300)
    for name in ("called", "whole", "transposed", "sliced", "attached"):
        first, last = (r[name] for r in ranks)
        assert first["shape"] == last["shape"] and (first["holds"], last["holds"]) == (False, True)
        assert first["lengths"] == last["lengths"] == (2, 2)
        assert first["grad_fn"] == [False] * 2 and last["grad_fn"] == [name == "attached"] * 2
        for r in (first, last):
            assert r["loss"].item() == pytest.approx(loss.item(), rel=TOLERANCE)
            assert relative_error(r["logits"], logits.detach()) <= TOLERANCE
        grads = {n: p.grad for n, p in plain.named_parameters()}
        for r in (first, last):
            assert r["grads"] and all(relative_error(g, grads[n]) <= TOLERANCE for n, g in r["grads"].items())
    for r in ranks:
        assert r["error"] == ("under pipeline parallelism the model's input 'scale' may differ between "
                              "microbatches only as a tensor with a batch dim, but it is a float; pass the model "
                              "its tensors instead")


def global_model_step() -> bool:
    """SMP's own examples call a global model inside the step function; with one live model that is the one."""
    sw.init({"microbatches": 2})
    model = sw.DistributedModel(build("gpt2"))
    ids = torch.arange(4 * 8).reshape(4, 8) % VOCAB

    @sw.step
    def train_step(ids):
        loss = model(ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    @sw.step
    def passed_in(model, ids):
        loss = model(ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    first = train_step(ids).reduce_mean()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    second = passed_in(model, ids).reduce_mean()
    same = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    sw.shutdown()
    return bool(torch.equal(first, second)) and same


def test_a_step_function_may_use_the_one_global_model():
    assert all(run_distributed(global_model_step, 2, timeout=300))
