"""SMP v1's config keys and the SageMaker estimator's `distribution` dict, taken as SMP and SageMaker took them.

Every key SMP's own config schema accepts validates here with SMP's meaning, or
with a note at `init` naming what shardwise does instead; SMP's other spellings
(`partitions`, `pipeline`, `fp16_params`, 0/1 booleans, strings) translate to
shardwise's; and `shardwise run --config distribution.json` launches the
estimator's whole dict.
"""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest

import shardwise as sw
from shardwise.cli import main
from shardwise.config import ConfigError, IneffectiveSettingsWarning, ineffective_settings, load_dict, parse_config
from shardwise.config.sources import merge_sources, read_distribution
from shardwise.launcher import resolve
from shardwise.topology import Cluster
from shardwise.config.layout import validate

HEAD = "these settings have no effect in this layout: "
FIX = "; fix: remove them, or set what they need"


def _message(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def _noted(data: dict) -> dict[str, str]:
    return dict(ineffective_settings(parse_config(data)))


# Every key of SMP v1's config schema (smdistributed/modelparallel/backend/config.yaml) with SMP's default (the
# documented one where the documentation gives another), `partitions` being its other name for
# pipeline_parallel_degree.
SMP_DEFAULTS = {
    "pipeline_parallel_degree": 1, "tensor_parallel_degree": 1, "microbatches": 1, "pipeline": "interleaved",
    "horovod": False, "ddp": False, "sharded_data_parallel_degree": 1, "sdp_reduce_bucket_size": int(5e8),
    "sdp_param_persistence_threshold": int(1e6), "sdp_max_live_parameters": int(1e9),
    "sdp_hierarchical_allgather": True, "sdp_gradient_clipping": 1.0, "_sharded_data_parallelism_config": None,
    "ddp_port": None, "ddp_dist_backend": "auto", "contiguous": True, "placement_strategy": "cluster",
    "optimize": "speed", "auto_partition": True, "default_partition": 0, "prescaled_batch": False,
    "memory_weight": 0.8, "active_microbatches": 3, "fast_mode": False, "static_mode": False, "fp16": False,
    "bf16": False, "fp16_params": False, "tensor_parallel_seed": 0, "offload_activations": False,
    "_shard_offloaded_activations": True, "shard_optimizer_state": False, "delayed_parameter_initialization": False,
    "skip_tracing": False, "activation_loading_horizon": 4, "task_level_activation_loading_horizon": 4,
    "herring": False, "_match_weights": False, "_fp32_grad_accumulation": False, "checkpoint_attentions": False,
    "load_partition": False, "partition_file": None,
}


def test_every_key_of_smps_schema_validates_with_smps_default():
    config, layout = validate(SMP_DEFAULTS, Cluster(1, 1))
    assert layout.shape == (1, 1, 1, 1)
    # SMP's `pipeline` is held as the schedule it names
    assert set(config.model_dump(exclude_unset=True)) == set(SMP_DEFAULTS) - {"pipeline"} | {"pipeline_schedule"}
    assert parse_config({"partitions": 2}).pipeline_parallel_degree == 2


def test_an_smp_example_scripts_config_validates_and_names_only_what_changes_nothing():
    """The smp.init() dict of SageMaker's GPT-2 example (TP 2 × PP 2 on 8 GPUs), as its script builds it."""
    script_config = {
        "ddp": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 4,
        "shard_optimizer_state": 1 > 0, "prescaled_batch": 1 > 0, "fp16": 0 > 0, "bf16": 1 > 0,
        "offload_activations": 0 > 0, "delayed_parameter_initialization": 1 > 0, "optimize": "speed",
        "placement_strategy": "cluster", "activation_loading_horizon": 4, "skip_tracing": 0 > 0,
        "auto_partition": True, "default_partition": 0, "static_mode": 1 > 0, "fast_mode": 0 > 0,
        "sharded_data_parallel_degree": 1, "ddp_dist_backend": "auto", "sdp_hierarchical_allgather": False,
        "sdp_gradient_clipping": 1.0, "checkpoint_attentions": False, "_match_weights": 0 > 0,
        "_fp32_grad_accumulation": 0 > 0, "active_microbatches": 4,
    }
    config, layout = validate(script_config, Cluster(1, 8))
    assert (layout.shape, layout.placement, config.dtype_name) == ((2, 2, 1, 2), "DPT", "bf16")
    assert dict(ineffective_settings(config)) == {
        "active_microbatches": "1f1b runs rounds of 4 microbatches with or without it",
        "sdp_gradient_clipping": "needs sharded_data_parallel_degree > 1; gradient_clipping clips without it",
        "sdp_hierarchical_allgather": "needs sharded_data_parallel_degree > 1",
    }


# --- pipeline keys --------------------------------------------------------------------------------------------

def test_partitions_is_the_pipeline_degree_and_a_different_second_value_is_named():
    assert parse_config({"partitions": 2, "pipeline_parallel_degree": 2}).pipeline_parallel_degree == 2
    assert _message({"partitions": 2, "pipeline_parallel_degree": 4}) == (
        "invalid shardwise config: partitions=2: conflicts with pipeline_parallel_degree=4 (both set the same "
        "thing); fix: give only one of partitions and pipeline_parallel_degree, or make them agree")


@pytest.mark.parametrize("pipeline, schedule", [("simple", "gpipe"), ("interleaved", "1f1b")])
def test_smps_pipeline_picks_the_schedule_of_the_same_order(pipeline, schedule):
    assert parse_config({"pipeline": pipeline, "partitions": 2}).pipeline_schedule == schedule
    other = {"pipeline": pipeline, "partitions": 2, "pipeline_schedule": "interleaved_1f1b"}
    if pipeline == "interleaved":
        assert parse_config(other).pipeline_schedule == "interleaved_1f1b"
    else:
        assert _message(other) == (
            "invalid shardwise config: pipeline='simple': conflicts with pipeline_schedule='interleaved_1f1b' "
            "('simple' is gpipe, 'interleaved' any other schedule); fix: give only one of pipeline and "
            "pipeline_schedule")


@pytest.mark.parametrize("settings, active, pipeline_round", [
    ({"microbatches": 8, "pipeline_schedule": "gpipe"}, 4, 4),          # SMP's default: partitions + 2
    ({"microbatches": 3, "pipeline_schedule": "gpipe"}, 3, 3),          # ... capped by the microbatches
    ({"microbatches": 6, "pipeline_schedule": "gpipe", "active_microbatches": 9}, 6, 6),  # above: all of them
    ({"microbatches": 10, "pipeline_schedule": "gpipe"}, 4, 2),         # the default rounds down to a divisor
    ({"microbatches": 8}, 4, 8),                                        # 1f1b keeps pp in flight anyway
    ({"microbatches": 8, "pipeline_schedule": "interleaved_1f1b"}, 4, 8),  # ... as interleaved schedules do
])
def test_active_microbatches_takes_smps_default_and_cap(settings, active, pipeline_round):
    config = parse_config({"partitions": 2, **settings})
    assert (config.effective_active_microbatches, config.pipeline_round) == (active, pipeline_round)


def test_pipeline_partition_keys_are_validated_as_smp_did_and_memory_weight_steers_the_graph_cut():
    assert _message({"partitions": 2, "memory_weight": 1.5, "default_partition": 2}).splitlines() == [
        "invalid shardwise config:",
        "  memory_weight=1.5: input should be less than or equal to 1; fix: use 1.0 or less",
        "  default_partition=2: must be a pipeline stage, below pipeline_parallel_degree (2); fix: use 0 to 1",
    ]
    keys = {"auto_partition": False, "default_partition": 1, "memory_weight": 0.2}
    assert _noted({"partitions": 2, **keys}) == {}  # the cut of the model's kind reads each of them
    assert _noted({"partitions": 2, "pipeline_cut": "blocks", **keys}) == {"memory_weight": (
        "the block-list cut balances by pipeline_balance; this key steers the module-graph cut (pipeline_cut graph)")}
    assert _noted({"partitions": 2, "pipeline_cut": "graph", "pipeline_balance": "compute"}) == {
        "pipeline_balance": "the module-graph cut balances by memory_weight"}
    assert _noted({"auto_partition": False}) == {"auto_partition": "needs pipeline_parallel_degree > 1"}


# --- precision keys -------------------------------------------------------------------------------------------

def test_fp16_params_is_smps_earlier_fp16():
    config = parse_config({"fp16_params": True})
    assert (config.fp16, config.dtype_name, _noted({"fp16_params": True})) == (True, "fp16", {})
    assert _message({"fp16_params": True, "bf16": True}) == (
        "invalid shardwise config: fp16_params=True: is SMP's earlier fp16, and bf16 and fp16 cannot both be on; "
        "fix: set only one of bf16 and fp16_params")


# --- sharded data parallelism ---------------------------------------------------------------------------------

def test_sdp_gradient_clipping_clips_under_sharded_data_parallelism():
    sharded = {"sharded_data_parallel_degree": 2}
    assert parse_config({**sharded, "sdp_gradient_clipping": 0.5}).gradient_clipping == 0.5
    assert parse_config({**sharded, "sdp_gradient_clipping": 0.0}).gradient_clipping is None  # 0: off
    assert parse_config(sharded).gradient_clipping is None
    assert _message({**sharded, "sdp_gradient_clipping": 0.5, "gradient_clipping": 1.0}) == (
        "invalid shardwise config: sdp_gradient_clipping=0.5: conflicts with gradient_clipping=1.0 (both set the "
        "same thing); fix: give only one of sdp_gradient_clipping and gradient_clipping, or make them agree")
    assert _noted({"sdp_gradient_clipping": 0.5}) == {
        "sdp_gradient_clipping": "needs sharded_data_parallel_degree > 1; gradient_clipping clips without it"}


def test_sharding_knobs_fsdp2_has_not_are_named_with_what_it_does():
    knobs = {"sdp_reduce_bucket_size": 5e7, "sdp_param_persistence_threshold": 0, "sdp_max_live_parameters": "1e8",
             "sdp_hierarchical_allgather": 0}
    assert _noted({"sharded_data_parallel_degree": 2, **knobs}) == {
        "sdp_reduce_bucket_size": "FSDP2 reduce-scatters each sharding unit's gradients at once",
        "sdp_param_persistence_threshold": "FSDP2 shards every parameter of a sharding unit",
        "sdp_max_live_parameters": "FSDP2 gathers one sharding unit ahead of the one running",
        "sdp_hierarchical_allgather": "torch's collectives choose how an all-gather crosses nodes",
    }
    assert set(_noted(knobs).values()) == {"needs sharded_data_parallel_degree > 1"}


# --- keys without a counterpart -------------------------------------------------------------------------------

def test_keys_without_a_counterpart_are_named_once_at_init_with_what_shardwise_does(monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "SHARDWISE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    inert = {"horovod": True, "ddp_port": 29761, "ddp_dist_backend": "nccl", "tensor_parallel_seed": 7,
             "checkpoint_attentions": True, "_fp32_grad_accumulation": True, "contiguous": False,
             "skip_tracing": True, "deterministic_server": True, "fast_mode": True, "static_mode": True,
             "_match_weights": True}
    try:
        with pytest.warns(IneffectiveSettingsWarning) as caught:
            sw.init(inert)
    finally:
        sw.shutdown()
    data_parallel = "gradients are synchronised with torch.distributed, as ddp does"
    assert [str(w.message) for w in caught] == [HEAD + ", ".join([
        f"horovod ({data_parallel})",
        "contiguous (pipeline stages are always contiguous runs of blocks)",
        "ddp_port (ranks meet on the launcher's port: shardwise run --master-port, or MASTER_PORT)",
        "ddp_dist_backend (the backend follows the device: NCCL on CUDA, gloo on CPU)",
        "tensor_parallel_seed (tensor-parallel modules draw from torch's generator, seeded by torch.manual_seed)",
        "checkpoint_attentions (checkpoint modules with sw.set_activation_checkpointing)",
        "_fp32_grad_accumulation (fp16 keeps fp32 master weights and reduces gradients in fp32)",
    ]) + FIX]


def test_optimize_memory_is_named_where_tensor_parallelism_keeps_whole_activations():
    why = "tensor-parallel ranks keep whole activations between split layers; sequence_parallel shards them"
    assert _noted({"tensor_parallel_degree": 2, "optimize": "memory"}) == {"optimize": why}
    assert _noted({"tensor_parallel_degree": 2, "optimize": "memory", "sequence_parallel": True}) == {}
    assert _noted({"tensor_parallel_degree": 2, "optimize": "speed"}) == {}
    assert _noted({"tensor_parallel_degree": 2}) == {}


# --- SMP's spellings of values --------------------------------------------------------------------------------

def test_booleans_as_0_1_or_strings_and_numbers_as_strings_are_taken_as_smp_configs_write_them():
    config = parse_config({"ddp": 1, "shard_optimizer_state": 0, "fp16": "true", "prescaled_batch": "False",
                           "microbatches": "4", "sdp_reduce_bucket_size": 5e8, "memory_weight": 1,
                           "sdp_gradient_clipping": "0.5"})
    assert (config.ddp, config.shard_optimizer_state, config.fp16, config.prescaled_batch) == (True, False, True,
                                                                                              False)
    assert (config.microbatches, config.sdp_reduce_bucket_size, config.memory_weight) == (4, 500_000_000, 1.0)
    assert config.sdp_gradient_clipping == 0.5
    assert _message({"ddp": 2, "microbatches": "2.5"}).splitlines() == [
        "invalid shardwise config:",
        "  ddp=2: input should be a valid boolean; fix: use true or false",
        "  microbatches='2.5': input should be a valid integer; fix: use a whole number",
    ]


def test_init_and_the_launcher_agree_on_a_boolean_written_two_ways():
    merged, conflicts = merge_sources({"ddp": 1, "fp16": "true"}, {"ddp": True, "fp16": True}, "run/config.json")
    assert conflicts == [] and parse_config(merged).fp16
    _, conflicts = merge_sources({"fp16": 0}, {"fp16": True}, "run/config.json")
    assert [str(p) for p in conflicts] == [
        "fp16=0: init() passes 0 but the launcher's config (run/config.json) sets True; fix: give the key one "
        "value: drop it from init() or from the `shardwise run` config, or make them equal"]



def test_a_conflict_on_a_key_without_effect_keeps_the_launchers_value_and_says_so():
    """SMP's estimator overrode the script's init(); where the key changes nothing here, so does shardwise."""
    with pytest.warns(IneffectiveSettingsWarning, match=r"differ on skip_tracing \(False vs True\)"):
        merged, conflicts = merge_sources({"skip_tracing": False, "ddp": True}, {"skip_tracing": True},
                                          "run/config.json")
    assert conflicts == [] and merged == {"skip_tracing": True, "ddp": True}

# --- the estimator's distribution dict ------------------------------------------------------------------------

def distribution(parameters, enabled=True, **mpi) -> dict:
    return {"smdistributed": {"modelparallel": {"enabled": enabled, "parameters": parameters}},
            "mpi": {"enabled": True, **mpi}}


def test_the_distribution_dict_gives_its_parameters_and_processes_per_host(tmp_path):
    parameters = {"partitions": 2, "microbatches": 4, "ddp": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error", IneffectiveSettingsWarning)  # nothing is ignored here
        read = read_distribution(distribution(parameters, processes_per_host=8))
    assert (read.parameters, read.processes_per_host) == (parameters, 8)
    file = tmp_path / "smp.json"  # the SageMaker SDK also takes the parameters as a JSON file's path
    file.write_text(json.dumps(parameters))
    assert load_dict(distribution(str(file))) == parameters


def test_what_only_sagemakers_mpi_launcher_used_is_named_once():
    with pytest.warns(IneffectiveSettingsWarning) as caught:
        assert load_dict(distribution({"microbatches": 2}, enabled="false", enabled_too=True,
                                      custom_mpi_options="--mca btl_vader_single_copy_mechanism none")) == {}
    torchrun = "shardwise run (or torchrun) starts the processes, not MPI"
    assert [str(w.message) for w in caught] == [
        HEAD + "smdistributed.modelparallel.parameters (enabled is not true, so SageMaker would not pass them "
        "either; set smdistributed.modelparallel.enabled to true to use them), "
        f"mpi.enabled_too ({torchrun}), mpi.custom_mpi_options ({torchrun})" + FIX]


def test_a_distribution_sagemaker_would_refuse_is_one_error():
    bad = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": [1]}, "dataparallel": {}},
           "mpi": {"processes_per_host": 0}, "bf16": True}
    with pytest.raises(ConfigError) as info:
        load_dict(bad)
    assert str(info.value).splitlines() == [
        "invalid shardwise config:",
        "  bf16=True: sits beside smdistributed, so the SageMaker form would drop it; "
        "fix: move it into smdistributed.modelparallel.parameters",
        "  smdistributed.dataparallel={}: is another SageMaker library than model parallelism; "
        "fix: drop it; shardwise takes smdistributed.modelparallel",
        "  mpi.processes_per_host=0: must be a positive integer; fix: give the number of processes (devices) per "
        "node, e.g. 8",
        "  smdistributed.modelparallel.parameters=[1]: is neither a dict of config keys nor the path of a JSON "
        "file of them; fix: give the config keys as a dict",
    ]


def test_processes_per_host_is_the_default_processes_per_node_and_the_flag_wins(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert resolve(str(script), processes_per_host=8).nproc_per_node == 8
    assert resolve(str(script), nproc_per_node=2, processes_per_host=8).nproc_per_node == 2


ENV_SCRIPT = """
import json, os
with open(os.environ["SHARDWISE_CONFIG"]) as f:
    print(json.dumps({"world": int(os.environ["WORLD_SIZE"]), "config": json.load(f)}))
"""


def test_shardwise_run_launches_the_estimators_distribution_dict_as_is(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ENV_SCRIPT))
    config = tmp_path / "distribution.json"
    config.write_text(json.dumps(distribution({"partitions": 2, "microbatches": "2", "ddp": 1}, processes_per_host=2,
                                              custom_mpi_options="-x NCCL_DEBUG=WARN")))
    code = main(["run", "--config", str(config), "--run-dir", str(tmp_path / "run"), str(script)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "layout: pp=2 × dp_replicate=1 × dp_shard=1 × tp=1" in out
    assert json.loads(next(line for line in out.splitlines() if line.startswith("{"))) == {
        "world": 2, "config": {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}}
    assert ("shardwise run: warning: " + HEAD + "mpi.custom_mpi_options (shardwise run (or torchrun) starts the "
            "processes, not MPI)" + FIX) in err.splitlines()
