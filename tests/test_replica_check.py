"""The replica check (`replica_check_interval`): a parameter that drifts apart on the ranks holding copies
of it stops training with one error naming it and two ranks, the same on every rank."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.runtime.replica_check import fingerprint
from shardwise.testing import DistributedTestError, run_distributed
from tiny_models import build, dataset, make_optimizer, seed_step


def test_fingerprint_sees_every_bit_and_every_position():
    x = torch.randn(64)
    assert fingerprint(x) == fingerprint(x.clone())
    assert fingerprint(x) != fingerprint(x.flip(0))
    nudged = x.clone()
    nudged[17] = torch.nextafter(nudged[17], torch.tensor(float("inf")))
    assert fingerprint(x) != fingerprint(nudged)
    assert fingerprint(x.bfloat16()) != fingerprint(nudged.bfloat16().flip(0))


def train_and_nudge(config: dict, steps: int, nudge_rank: int, name: str) -> None:
    """Train GPT-2 for `steps`; after the first, `nudge_rank` changes its copy of parameter `name` slightly."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    loader = sw.data_loader(dataset("gpt2", 2 * steps * sw.dp_size()), batch_size=2, shuffle=False)
    for step, (inputs, targets) in enumerate(loader):
        opt.zero_grad()
        train_step(model, inputs, targets)
        opt.step()
        if step == 0 and sw.rank() == nudge_rank:
            with torch.no_grad():
                param = dict(model.named_parameters())[name]
                local = param.to_local() if hasattr(param, "to_local") else param
                local.view(-1)[0] += 1e-3


def failure(config: dict, steps: int, nudge_rank: int, name: str) -> str:
    with pytest.raises(DistributedTestError) as err:
        run_distributed(train_and_nudge, 4, {"replica_check_interval": 1, **config}, steps, nudge_rank, name)
    return str(err.value)


def test_a_drifted_replica_of_a_plain_parameter_names_it_and_the_ranks():
    message = failure({}, 2, 2, "transformer.h.0.ln_1.weight")
    assert ("ReplicaMismatchError: replica check after step 2: parameter 'transformer.h.0.ln_1.weight' differs "
            "between ranks 0 and 2, which hold copies over dp_replicate; the ranks no longer train the same model (fix: report "
            "it with the config, or look for code that changes parameters on some ranks only)") in message


def test_a_drifted_replica_of_a_shard_names_the_replica_axis():
    """MiCS: ranks 1 and 3 hold the same shard of every parameter in two partition groups of 2."""
    message = failure({"sharded_data_parallel_degree": 2}, 2, 3, "transformer.h.1.mlp.c_fc.weight")
    assert ("replica check after step 2: parameter 'transformer.h.1.mlp.c_fc.weight' differs between ranks 1 and 3, "
            "which hold copies over dp_replicate") in message


def test_a_norm_replicated_over_tensor_parallelism():
    message = failure({"tensor_parallel_degree": 2}, 2, 1, "transformer.ln_f.bias")
    assert "parameter 'transformer.ln_f.bias' differs between ranks 0 and 1, which hold copies over tp" in message


def test_no_check_runs_between_intervals():
    """Checked every 3 steps, a drift after the first step is named after the third: no check ran after the
    second (it would have named step 2), and the check does run on its interval."""
    message = failure({"replica_check_interval": 3}, 3, 1, "transformer.h.0.ln_1.weight")
    assert "replica check after step 3: parameter 'transformer.h.0.ln_1.weight' differs between ranks 0 and 1" \
           in message
