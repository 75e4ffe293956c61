"""The joints between the layers: everything under `parallel/` gets plain values from `compose`, and the runtime,
the planner and the config checks take every layout decision from one `Decisions` object."""

from __future__ import annotations

import ast
import pathlib

import pytest
from torch import nn

from shardwise.config import parse_config
from shardwise.config.decisions import Decisions, Wrapping
from shardwise.config.effects import ineffective_settings
from shardwise.config.layout import layout_for
from shardwise.planner import wrapping as planned
from shardwise.topology import Cluster

PARALLEL = pathlib.Path(__file__).resolve().parents[1] / "src" / "shardwise" / "parallel"
# The global runtime and the config object: only compose.py, which turns the config into plain values, may read them.
FORBIDDEN = {"shardwise.runtime.state": None, "shardwise.config.schema": {"ShardwiseConfig"},
             "shardwise.config": {"ShardwiseConfig"}}


def _imports(path: pathlib.Path, root: pathlib.Path) -> list[tuple[str, set[str]]]:
    """(absolute module, names imported from it) for every import in `path`, at any depth (`root`: the
    `parallel` folder, in the `shardwise` package)."""
    package = ".".join(("shardwise", *path.relative_to(root.parent).with_suffix("").parts[:-1]))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((module, {alias.name for alias in node.names}))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, set()) for alias in node.names)
    return found


def _offenders(root: pathlib.Path) -> list[str]:
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "compose.py" and path.parent == root:
            continue
        for module, names in _imports(path, root):
            banned = FORBIDDEN.get(module, set())
            if module in FORBIDDEN and (banned is None or names & banned):
                offenders.append(f"{path.relative_to(root)} imports {sorted(names) or module} from {module}")
    return offenders


def test_nothing_under_parallel_reads_the_runtime_or_the_config_but_compose():
    offenders = _offenders(PARALLEL)
    assert not offenders, "\n".join(offenders)


def test_the_check_names_a_module_that_reads_the_runtime_or_the_config(tmp_path):
    (tmp_path / "parallel" / "sharding").mkdir(parents=True)
    (tmp_path / "parallel" / "compose.py").write_text("from ..config.schema import ShardwiseConfig\n")
    (tmp_path / "parallel" / "sharding" / "rogue.py").write_text("from ...runtime.state import current\n")
    (tmp_path / "parallel" / "typed.py").write_text("from ..config import ShardwiseConfig, parse_config\n")
    (tmp_path / "parallel" / "fine.py").write_text("from ..config.schema import SINGLE_STAGE_SCHEDULES\n")
    assert _offenders(tmp_path / "parallel") == [
        "sharding/rogue.py imports ['current'] from shardwise.runtime.state",
        "typed.py imports ['ShardwiseConfig', 'parse_config'] from shardwise.config"]


CASES = [  # (config, world): MiCS with and without a pipeline, hpZ, ZeRO-1 in bf16, DDP with tensor parallelism
    ({"sharded_data_parallel_degree": 2, "cross_group_reduce_dtype": "bf16", "cross_group_overlap": "forward"}, 8),
    ({"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2, "cross_group_reduce_dtype": "bf16"}, 8),
    ({"zero_stage": 3, "zero_hpz_partition_size": 2}, 8),
    ({"shard_optimizer_state": True, "bf16": True}, 4),
    ({"tensor_parallel_degree": 2}, 4),
]


@pytest.mark.parametrize("data,world", CASES)
def test_planner_and_checks_read_the_runtimes_decisions(data, world, monkeypatch):
    """The planner's and config/effects.py's answers change when, and only when, the one Decisions object's do:
    each asks it, so they cannot disagree with the runtime, which builds by it."""
    config = parse_config(data)
    layout = layout_for(config, Cluster(1, world))
    decisions = Decisions(config, layout)
    link_bytes = planned.cross_group_bytes(config, layout)
    assert link_bytes == ({"fp32": 4, "bf16": 2}[decisions.cross_group.dtype] if decisions.cross_group else 4)
    assert planned.replicated_by_fsdp(config, layout) == (decisions.wrapping().value == "replicate")

    # Turn MiCS's own reduction off in the object alone: the planner follows it.
    monkeypatch.setattr(Decisions, "cross_group", property(lambda self: None))
    assert planned.cross_group_bytes(config, layout) == 4


def test_mics_keys_are_named_ineffective_where_no_world_could_run_the_cross_group_reduction():
    under_pipeline = parse_config({"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2,
                                   "cross_group_reduce_dtype": "bf16"})
    alone = parse_config({"sharded_data_parallel_degree": 2, "cross_group_reduce_dtype": "bf16"})
    assert "cross_group_reduce_dtype" in dict(ineffective_settings(under_pipeline))
    assert "cross_group_reduce_dtype" not in dict(ineffective_settings(alone))


@pytest.fixture
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "SHARDWISE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    yield
    import shardwise as sw
    sw.shutdown()


@pytest.mark.parametrize("config,forced,expected", [({}, Wrapping.SHARDED, "FSDP"),
                                                    ({"zero_stage": 3}, Wrapping.SINGLE, "Linear")])
def test_the_runtime_wraps_as_the_decisions_object_says(one_process, monkeypatch, config, forced, expected):
    """Each config alone would get the other wrapping; told otherwise by the object alone, the runtime follows it."""
    import shardwise as sw

    monkeypatch.setattr(Decisions, "wrapping", lambda self, trains=True: forced)
    sw.init(config)
    model = sw.DistributedModel(nn.Linear(4, 4))
    assert type(model.module).__name__.startswith(expected)
