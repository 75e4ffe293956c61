"""The seeds' reference points: SMP's GPT-2 layouts (seed 001) and MiCS vs ZeRO-3 for the ViT (seed 000),
and, over their plans, that every config the planner proposes runs as written.

SMP's layouts use optimizer state sharding (ZeRO-1) in fp16. Like SMP, shardwise's ZeRO-1 in
fp16 keeps fp16 parameters and gradients on every replica and shards the fp32 master copy with
the optimizer states (2a + 2a + 12a/n, `planner/wrapping.py`, measured), so SMP's layouts fit on
40 GB A100s; the same degrees also fit with ZeRO-2.
"""

import functools

import pytest

from shardwise.config import ConfigError, config_problems, ineffective_settings, parse_config
from shardwise.config import validate as validation
from shardwise.planner import cluster_preset, evaluate, model_state_bytes, plan, resolve_model
from shardwise.planner.wrapping import optimizer_share
from shardwise.config.layout import layout_for
from shardwise.config.layout import validate

# Seed 001's table: nodes of p4d.24xlarge, TP, PP, batch per model replica (prescaled), microbatches, active.
# Every row uses optimizer state sharding, per-layer checkpointing and prescaled_batch; SMP trains GPT-2 in fp16.
REFERENCE = {
    "gpt2-10b": dict(nodes=16, tp=4, pp=1, batch=40, microbatches=1, active=None),
    "gpt2-30b": dict(nodes=16, tp=8, pp=1, batch=32, microbatches=1, active=None),
    "gpt2-60b": dict(nodes=32, tp=8, pp=2, batch=56, microbatches=4, active=2),
}


def _reference(name):
    ref = REFERENCE[name]
    cluster = cluster_preset(f"{ref['nodes']}xp4d.24xlarge")
    dp = cluster.world_size // (ref["tp"] * ref["pp"])
    config = {"tensor_parallel_degree": ref["tp"], "prescaled_batch": True, "shard_optimizer_state": True,
              "fp16": True, "microbatches": ref["microbatches"]}
    if ref["pp"] > 1:
        config.update(pipeline_parallel_degree=ref["pp"], active_microbatches=ref["active"])
    return resolve_model(name), cluster, config, ref["batch"] * dp


def _fresh_plan(name):
    spec, cluster, _, global_batch = _reference(name)
    return plan(spec, cluster, global_batch=global_batch, precision="fp16")


_plan = functools.cache(_fresh_plan)   # a plan is frozen: the tests that only read it share one per seed


@pytest.mark.parametrize("name", list(REFERENCE))
def test_smp_degrees_fit_with_sharded_data_parallelism(name):
    result = _plan(name)
    wanted = (REFERENCE[name]["tp"], REFERENCE[name]["pp"], "each")
    found = [e for e in result.fitting if (e.layout.tp, e.layout.pp, e.checkpointing) == wanted and e.zero_stage >= 2]
    assert found, f"SMP's {name} degrees are not among the {len(result.fitting)} fitting layouts"


@pytest.mark.parametrize("name", list(REFERENCE))
def test_smp_reference_layout_fits(name):
    """SMP's own config, as given, fits; and the plan lists its degrees with ZeRO-1 among the fitting layouts."""
    spec, cluster, config, global_batch = _reference(name)
    exact = evaluate(spec, cluster, config, global_batch=global_batch, checkpointing="each")
    assert exact.fits, exact.reason
    wanted = (REFERENCE[name]["tp"], REFERENCE[name]["pp"], "each", 1)
    assert any((e.layout.tp, e.layout.pp, e.checkpointing, e.zero_stage) == wanted for e in _plan(name).fitting)


def test_zero1_in_half_precision_keeps_smps_model_states():
    """Per rank, a parameters over n replicas: fp16 parameters 2a and gradients 2a, fp32 masters and Adam
    moments 12a × the busiest rank's share of the whole tensors ZeRO-1 deals: for gpt2-10b over 32 replicas
    3 % more than 1/n, as its embedding alone is two thirds of a share."""
    spec, cluster, config, _ = _reference("gpt2-10b")
    parsed = parse_config(config)
    layout = layout_for(parsed, cluster.topology)
    a = spec.parameters / layout.tp
    states = model_state_bytes(a, parsed, layout, optimizer_share(spec, parsed, layout))
    assert states["parameters"] == states["gradients"] == 2 * a
    assert states["optimizer"] == pytest.approx(12 * a / layout.dp, rel=0.05)


def test_plain_ddp_of_10b_does_not_fit():
    result = _plan("gpt2-10b")
    ddp = [e for e in result.considered if (e.layout.tp, e.layout.pp, e.zero_stage) == (1, 1, 0)]
    assert ddp and not any(e.fits for e in ddp)
    assert all("GiB more than the 40 GiB" in e.reason for e in ddp)


def test_mics_groups_of_4_beat_zero3_over_32_gpus_for_the_vit():
    """Seed 000: 8 × g4dn.12xlarge, batch 4 per GPU, fp32, per-layer checkpointing; measured ~14 % faster."""
    spec, cluster = resolve_model("vit-630m"), cluster_preset("8xg4dn.12xlarge")
    zero3, mics = (evaluate(spec, cluster, {"sharded_data_parallel_degree": g}, global_batch=128,
                            checkpointing="each") for g in (32, 4))
    assert zero3.fits and mics.fits
    assert (zero3.layout.dp_shard, mics.layout.dp_shard, mics.layout.dp_replicate) == (32, 4, 8)
    gain = 1 - mics.step_time / zero3.step_time
    print(f"predicted MiCS speed-up over ZeRO-3: {gain:.1%} (seed 000 measured ~14%)")
    assert 0 < gain < 0.3


@pytest.mark.parametrize("name", list(REFERENCE))
def test_every_planned_config_runs_as_written(name):
    """`shardwise run`'s own validation accepts every config the plan predicts, with the layout the plan
    shows; no config, predicted or rejected, sets a key without effect (no IneffectiveSettingsWarning),
    and no two evaluations are the same config."""
    result = _plan(name)
    for e in result.considered:
        config, _ = config_problems(e.config)
        assert ineffective_settings(config) == [], e.config
        if e.memory is not None:
            assert validate(e.config, result.cluster.topology)[1] == e.layout
    predicted = [(tuple(sorted(e.config.items())), e.checkpointing) for e in result.considered if e.memory is not None]
    assert len(predicted) == len(set(predicted))


def _offloading(result):
    return [e for e in result.fitting if e.config.get("offload_activations")]


def test_activation_offloading_is_proposed_now_that_it_is_built():
    assert _offloading(_plan("gpt2-60b"))


def test_evaluate_refuses_what_run_refuses():
    spec, cluster, config, global_batch = _reference("gpt2-60b")
    with pytest.raises(ConfigError, match=r"^invalid shardwise config: fp16=True: bf16 and fp16 cannot both be on"):
        evaluate(spec, cluster, {**config, "bf16": True, "fp16": True}, global_batch=global_batch,
                 checkpointing="each")


def test_any_feature_a_release_lacks_leaves_the_plan(monkeypatch):
    """The planner asks the release, not a list of its own: were sequence parallelism unavailable, no
    fitting layout would use it and `--explain` would say why."""
    assert any(e.config.get("sequence_parallel") for e in _plan("gpt2-10b").fitting)
    monkeypatch.setattr(validation, "unavailable_features",
                        lambda config: [("sequence_parallel", True)] if config.sequence_parallel else [])
    result = _fresh_plan("gpt2-10b")
    assert not any(e.config.get("sequence_parallel") for e in result.fitting)
    assert any("sequence_parallel=True: this feature is not available yet" in (e.reason or "")
               for e in result.considered)
