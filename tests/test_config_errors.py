"""Every bad config is one `ConfigError` whose message names the key, the value, the rule and a fix.

The messages are the product here (a user reads them instead of a traceback),
so each case checks the text, not only the type.
"""

from __future__ import annotations

import re
import textwrap

import pytest
import torch.distributed as dist

import shardwise as sw
from shardwise.cli import main
from shardwise.config import ConfigError, ShardwiseConfig, load_config, parse_config, unavailable_features
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster
from shardwise.config.layout import validate


def _message(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return str(info.value)


def _problems(message: str) -> list[str]:
    return re.findall(r"^\s+\S+=.*; fix: .*$", message, flags=re.M)


# (config, cluster (nodes, devices per node) or None for the field rules only, expected message)
CASES = {
    "tp not a power of two": (
        {"tensor_parallel_degree": 3}, None,
        "tensor_parallel_degree=3: must be a power of two; fix: use 2 or 4"),
    "tp larger than a node": (
        {"tensor_parallel_degree": 8}, (2, 4),
        "tensor_parallel_degree=8: must not exceed the 4 devices per node (TP stays inside a node); "
        "fix: use a power of two ≤ 4"),
    "degrees do not divide the world": (
        {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 4}, (3, 2),
        "pipeline_parallel_degree × tensor_parallel_degree=8: must divide the world size 6; "
        "fix: choose degrees whose product divides the number of processes"),
    "partition group does not divide dp": (
        {"sharded_data_parallel_degree": 3}, (1, 4),
        "sharded_data_parallel_degree=3: must divide the data-parallel degree 4 (= world 4 / (tp 1 × pp 1)); "
        "fix: use a divisor of 4: 1, 2, 4"),
    "microbatches below one": (
        {"microbatches": 0}, None,
        "microbatches=0: input should be greater than or equal to 1; fix: use 1 or more"),
    "wrong type": (
        {"microbatches": "two"}, None,
        "microbatches='two': input should be a valid integer; fix: use a whole number"),
    "unknown key, close to a known one": (
        {"sharded_data_paralel_degree": 2}, None,
        "sharded_data_paralel_degree=2: unknown key; fix: did you mean 'sharded_data_parallel_degree'?"),
    "unknown key, close to nothing": (
        {"frobnicate": 2}, None,
        "frobnicate=2: unknown key; fix: remove it; valid keys are listed in the README's config reference"),
    "bf16 and fp16": (
        {"bf16": True, "fp16": True}, None,
        "fp16=True: bf16 and fp16 cannot both be on; fix: set only one of them"),
    "ZeRO-1 together with a partition group": (
        {"shard_optimizer_state": True, "sharded_data_parallel_degree": 2}, None,
        "shard_optimizer_state=True: conflicts with sharded_data_parallel_degree > 1"),
    "ZeRO stage too low for a partition group": (
        {"zero_stage": 1, "sharded_data_parallel_degree": 2}, None,
        "zero_stage=1: sharded_data_parallel_degree > 1 shards parameters or gradients (stage 2 or 3)"),
    "sequence parallelism without tensor parallelism": (
        {"sequence_parallel": True}, None,
        "sequence_parallel=True: needs tensor_parallel_degree > 1 (it shards what tensor parallelism leaves whole); "
        "fix: set tensor_parallel_degree to 2 or more, or drop sequence_parallel"),
    "sequence parallelism with pipeline stages in fp16": (
        {"sequence_parallel": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "fp16": True}, None,
        "sequence_parallel=True: is not available with fp16 under a pipeline yet (it does not train the same "
        "weights as one process there); fix: use bf16, or drop sequence_parallel"),
    "sequence parallelism with a module-graph pipeline cut": (
        {"sequence_parallel": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2,
         "pipeline_cut": "graph"}, None,
        "sequence_parallel=True: is not available with pipeline_cut 'graph' yet; "
        "fix: cut along the blocks (pipeline_cut: blocks), or drop sequence_parallel"),
    "regathered sequence shards without sequence parallelism": (
        {"tensor_parallel_degree": 2, "sequence_parallel_regather": True}, None,
        "sequence_parallel_regather=True: needs sequence_parallel (it keeps the sequence shards of the inputs "
        "sequence parallelism gathers); fix: set sequence_parallel: true, or drop sequence_parallel_regather"),
    "regathered sequence shards under autocast": (
        {"tensor_parallel_degree": 2, "sequence_parallel": True, "sequence_parallel_regather": True, "bf16": True},
        (1, 2), "sequence_parallel_regather=True: is not available under autocast (a lone replica in bf16/fp16 "
        "without zero_stage): each linear keeps its own cast copy of the gathered input; fix: set zero_stage to 1 "
        "or more, or drop sequence_parallel_regather"),
    "ddp off with several replicas": (
        {"ddp": False}, (1, 4),
        "ddp=False: gradients must be synchronised across the 4 data-parallel ranks"),
}


@pytest.mark.parametrize("case", CASES)
def test_rule_violation_message(case):
    config, cluster, expected = CASES[case]
    if cluster is None:
        message = _message(parse_config, config)
    else:
        message = _message(layout_for, parse_config(config), Cluster(*cluster))
        assert expected in _message(validate, config, Cluster(*cluster))  # what init, check-config and run call
    assert message.startswith("invalid shardwise config: ")
    assert expected in message


def test_field_rule_and_layout_problems_are_reported_together():
    """A broken field does not hide the layout: it is computed from the well-typed keys (here tp = 1)."""
    message = _message(validate, {"tensor_parallel_degree": "x", "microbatches": 0, "bf16": True, "fp16": True,
                                  "sharded_data_parallel_degree": 3}, Cluster(1, 4))
    assert message.splitlines() == [
        "invalid shardwise config:",
        "  tensor_parallel_degree='x': input should be a valid integer; fix: use a whole number",
        "  microbatches=0: input should be greater than or equal to 1; fix: use 1 or more",
        "  fp16=True: bf16 and fp16 cannot both be on; fix: set only one of them",
        "  sharded_data_parallel_degree=3: must divide the data-parallel degree 4 (= world 4 / (tp 1 × pp 1)); "
        "fix: use a divisor of 4: 1, 2, 4",
    ]


def test_every_problem_is_reported_at_once():
    """One pass lists each problem on its own line, so a user fixes them all in one go."""
    message = _message(parse_config, {"tensor_parallel_degree": 3, "microbatches": 0, "bogus": 1,
                                      "bf16": True, "fp16": True})
    lines = message.splitlines()
    assert lines[0] == "invalid shardwise config:"
    assert [line.strip().split("=")[0] for line in lines[1:]] == [
        "bogus", "microbatches", "tensor_parallel_degree", "fp16"]
    assert len(_problems(message)) == 4


@pytest.mark.parametrize("name, text, where", [
    ("bad.json", '{\n  "ddp": true,\n  "microbatches": 2,,\n}\n', "malformed JSON at line 3, column 21"),
    ("bad.yaml", "ddp: true\nmicrobatches: 2\n  bf16: [true\n", "malformed YAML at line 3, column 7"),
    ("list.yaml", "- ddp\n- bf16\n", "top level is a list, not a mapping"),
])
def test_malformed_file_names_the_file_and_line(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    message = _message(load_config, path)
    assert f"config='{path}': {where}" in message
    assert "; fix: " in message


def test_missing_file_and_malformed_override():
    assert "file does not exist; fix: pass the path of a JSON or YAML config file" in _message(
        load_config, "no/such/config.yaml")
    assert "--set='microbatches': override is not of the form key=value" in _message(
        load_config, None, ["microbatches"])


def test_file_and_overrides_are_validated_together(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent("""\
        sharded_data_parallel_degree: 2
        microbatches: 2
    """))
    assert load_config(path, ["microbatches=4"]).microbatches == 4
    assert "microbatches=-1: input should be greater than or equal to 1" in _message(
        load_config, path, ["microbatches=-1"])


def test_sagemaker_distribution_form_drops_nothing_silently():
    """SageMaker's `distribution` dict gives its parameters; a key beside them is an error, not dropped."""
    def form(**beside):
        return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"microbatches": 2}}},
                "mpi": {"enabled": True}, **beside}
    assert load_config(form()).microbatches == 2
    assert _message(load_config, form(bf16=True, horovod=True)).splitlines() == [
        "invalid shardwise config:",
        "  bf16=True: sits beside smdistributed, so the SageMaker form would drop it; "
        "fix: move it into smdistributed.modelparallel.parameters",
        "  horovod=True: sits beside smdistributed, so the SageMaker form would drop it; "
        "fix: move it into smdistributed.modelparallel.parameters",
    ]


def _pending_keys() -> list[tuple[str, object]]:
    """Keys whose feature is not built yet, found by turning each key on by itself (the list shrinks as
    features land)."""
    defaults = ShardwiseConfig()
    pending = []
    for key, value in defaults.model_dump().items():
        changed = (not value) if isinstance(value, bool) else value + 1 if isinstance(value, int) else None
        if changed is not None:
            pending += unavailable_features(defaults.model_copy(update={key: changed}))
    return sorted(set(pending))


@pytest.mark.parametrize("key, value", _pending_keys())
def test_unavailable_feature_is_refused_at_init_before_anything_starts(key, value):
    try:
        message = _message(sw.init, {key: value})
    finally:
        if sw.is_initialized():  # only if init wrongly accepted it
            sw.shutdown()
    assert f"{key}={value!r}: this feature is not available yet" in message
    assert not dist.is_initialized()


@pytest.mark.parametrize("key, value", _pending_keys())
def test_check_config_and_run_refuse_what_init_refuses(key, value, tmp_path, capsys):
    """One validation, so check-config never accepts a config that run or init then refuses."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not start')\n")
    expected = f"{key}={value!r}: this feature is not available yet in this shardwise release; fix: remove the key"
    for command in (["check-config"], ["run", "--run-dir", str(tmp_path / "run")]):
        argv = [*command, "--nproc-per-node", "4", "--set", f"{key}={str(value).lower()}"]
        code = main(argv + ([str(script)] if command[0] == "run" else []))
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), argv
        assert err.startswith(f"shardwise {command[0]}: invalid shardwise config: {expected}")
    assert not (tmp_path / "run").exists()
