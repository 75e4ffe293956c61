"""`deepspeed <flags> train.py ...` runs as `shardwise run <flags> train.py ...`: DeepSpeed's launcher flags.

Parsing (DeepSpeed's spellings, the dashed ones, aliases of shardwise's flags and what conflicts), the
resolution of `--include` / `--exclude` / `--num_nodes` / `--num_gpus` against a hostfile or this node (each
refusal one line with its fix, and the same selections as DeepSpeed's own `parse_resource_filter`), the
devices a node's ranks see, and real launches of a tiny script: `--num_gpus 2` on this machine, and two
"nodes" started as DeepSpeed's `--hostfile --no_ssh --node_rank` lines start them.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from shardwise.cli import build_parser, main
from shardwise.launcher.from_args import deepspeed_selection
from shardwise.launcher import LaunchError, parse_hostfile_text, resolve
from shardwise.launcher import spec as spec_module
from shardwise.launcher.environment import visible_devices_env
from shardwise.launcher.hostfile import Host
from shardwise.launcher.resources import parse_filter, select

SEED_SCRIPT = """
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", default=-1, type=int)   # as DeepSpeed's launcher passes it
parser.add_argument("--deepspeed_config")
args = parser.parse_args()
print(json.dumps({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                  "local_rank_env": int(os.environ["LOCAL_RANK"]), "local_rank_arg": args.local_rank,
                  "deepspeed_config": args.deepspeed_config}))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SEED_SCRIPT))
    return str(path)


@pytest.fixture
def on_node_b(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    monkeypatch.setattr(socket, "getfqdn", lambda: "node-b.cluster")


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# three nodes of four devices\nnode-a slots=4\nnode-b slots=4\n\nnode-c slots=4 max_slots=8\n")
    return str(path)


def parse(*argv):
    return build_parser().parse_args(["run", *argv])


# --- parsing ----------------------------------------------------------------------------------------------


def test_deepspeed_spellings_are_aliases_of_the_shape_flags():
    args = parse("--num_gpus=4", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=6000",
                 "--nproc_per_node", "4", "-H", "hosts", "train.py", "--deepspeed_config", "ds.json")
    assert (args.num_gpus, args.node_rank, args.master_addr, args.master_port) == (4, 1, "10.0.0.1", 6000)
    assert (args.nproc_per_node, args.hostfile, args.script) == (4, "hosts", "train.py")
    assert args.script_args == ["--deepspeed_config", "ds.json"]  # everything after the script is the script's
    for spelling in ("--num_gpus", "--num-gpus", "--num_accelerators", "--num-accelerators"):
        assert parse(spelling, "2", "train.py").num_gpus == 2
    for spelling in ("-i", "--include"):
        assert parse(spelling, "worker-1:0,1", "train.py").include == "worker-1:0,1"
    assert parse("-e", "worker-0", "--num-nodes", "2", "--no-ssh", "train.py").exclude == "worker-0"


def test_the_same_flag_twice_with_two_values_is_one_line(script, capsys):
    assert main(["run", "--node-rank", "0", "--node_rank", "1", script]) == 2
    assert capsys.readouterr().err == ("shardwise run: --node-rank=0 and --node_rank=1 disagree; fix: give one of "
                                       "them\n")
    args = parse("--master_port", "6000", "--master-port", "6000", "train.py")  # the same value twice is fine
    assert args.master_port == 6000 and not getattr(args, "flag_conflicts", None)


def test_num_gpus_and_num_nodes_disagreeing_with_shardwise_flags_is_one_line(script, capsys):
    assert main(["run", "--num_gpus", "2", "--nproc-per-node", "4", script]) == 2
    assert capsys.readouterr().err == ("shardwise run: --nproc-per-node=4 and --num_gpus=2 disagree; fix: give one "
                                       "of them\n")
    with pytest.raises(LaunchError, match=r"^--nnodes=2 and --num_nodes=3 disagree; fix: give one of them$"):
        resolve(script, nnodes=2, num_nodes=3, master_addr="a")


@pytest.mark.parametrize("argv, passed", [
    (["--num_gpus=4"], True),                                   # a DeepSpeed command line
    (["--include", "localhost:0"], True),
    (["--no_ssh", "--hostfile", "h"], True),
    (["--num_gpus=4", "--no_local_rank"], False),
    (["--nproc-per-node", "4"], False),                         # shardwise's own flags: the script gets none
    (["--node_rank", "0", "--master_addr", "a"], False),        # aliases of shardwise's flags
    (["--pass-local-rank"], True),
])
def test_deepspeeds_local_rank_argument_comes_with_deepspeeds_command_lines(argv, passed):
    assert deepspeed_selection(parse(*argv, "train.py"))["local_rank_arg"] is passed


# --- hostfile, as DeepSpeed reads it ----------------------------------------------------------------------


def test_hostfile_comments_blank_lines_and_what_follows_slots():
    assert parse_hostfile_text("# c\n\nworker-0 slots=4 max_slots=8\n  worker-1 slots=4  # gpu box\n") == [
        Host("worker-0", 4), Host("worker-1", 4)]
    with pytest.raises(LaunchError, match="host 'worker-0' is listed twice; fix: list each node once"):
        parse_hostfile_text("worker-0 slots=4\nworker-0 slots=4\n")


# --- selection --------------------------------------------------------------------------------------------

POOL = {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3], "node-c": [0, 1, 2, 3]}


@pytest.mark.parametrize("kwargs, want", [
    (dict(include="node-a@node-b:0,2"), {"node-a": [0, 1, 2, 3], "node-b": [0, 2]}),
    (dict(include="node-c:3@node-a:1"), {"node-a": [1], "node-c": [3]}),        # the hostfile's order numbers them
    (dict(exclude="node-b"), {"node-a": [0, 1, 2, 3], "node-c": [0, 1, 2, 3]}),
    (dict(exclude="node-a:0,1@node-b:0,1@node-c:0,1"), {h: [2, 3] for h in POOL}),
    (dict(num_nodes=2), {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3]}),
    (dict(num_gpus=2), {h: [0, 1] for h in POOL}),
    (dict(num_nodes=1, num_gpus=3), {"node-a": [0, 1, 2]}),
])
def test_selection(kwargs, want):
    assert select(POOL, **kwargs) == want


@pytest.mark.deepspeed
@pytest.mark.parametrize("include, exclude", [
    ("node-a@node-b:0,2", ""), ("node-c:3@node-a:1", ""), ("node-b:1@node-b:3", ""), ("", "node-b"),
    ("", "node-a:0,1@node-c:2"), ("", "node-a@node-b@node-c:0"),
])
def test_selection_is_deepspeeds(include, exclude):
    runner = pytest.importorskip("deepspeed.launcher.runner")
    theirs = runner.parse_inclusion_exclusion({host: len(slots) for host, slots in POOL.items()}, include, exclude)
    assert select(POOL, include=include or None, exclude=exclude or None) == dict(theirs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(include="node-x:0"), "--include='node-x:0' names host 'node-x', which the hostfile does not list; fix: "
                               "use one of node-a, node-b, node-c"),
    (dict(include="node-a:4"), "--include='node-a:4': host 'node-a' has no slot 4 (the hostfile gives it 4: "
                               "0..3); fix: name slots below 4"),
    (dict(include="node-a:x"), "--include='node-a:x': 'node-a:x' is not NAME[:SLOT[,SLOT ...]]; fix: e.g. "
                               "--include 'worker-0@worker-1:0,2' (all of worker-0, slots 0 and 2 of worker-1)"),
    (dict(include="node-a", exclude="node-b"), "--include and --exclude cannot both be given (DeepSpeed refuses "
                                               "them together too); fix: give one of them"),
    (dict(include="node-a", num_gpus=2), "--num_nodes/--num_gpus cannot be combined with --include (as in "
                                         "DeepSpeed); fix: name the hosts and slots in the filter alone, or drop it"),
    (dict(exclude="node-a@node-b@node-c"), "--exclude='node-a@node-b@node-c' leaves no host with a slot; fix: "
                                           "select at least one slot"),
    (dict(num_nodes=4), "--num_nodes=4 but the hostfile lists 3 host(s); fix: use at most 3, or add hosts to the "
                        "hostfile"),
    (dict(num_gpus=8), "--num_gpus=8 exceeds the 4 slots the hostfile gives 'node-a'; fix: use at most 4"),
])
def test_selection_refusals_are_one_line_with_the_fix(kwargs, message):
    with pytest.raises(LaunchError) as err:
        select(POOL, **kwargs)
    assert str(err.value) == message


def test_filter_syntax():
    assert parse_filter("worker-0@worker-1:2,0@worker-1:1", "--include") == {"worker-0": [], "worker-1": [0, 1, 2]}


# --- resolution: the shape, this node, its devices ---------------------------------------------------------


def test_num_nodes_takes_the_first_hosts_and_this_node_finds_its_rank(script, hostfile, on_node_b):
    spec = resolve(script, hostfile=hostfile, num_nodes=2, local_rank_arg=True)
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank, spec.master_addr) == (2, 4, 1, "node-a")
    assert spec.visible_devices is None and spec.device_env == {}  # no slots picked: every device, as listed
    assert spec_module.entrypoint(spec)[1][:3] == ["-u", script, "--local_rank=${local_rank}"]


def test_the_seeds_no_ssh_line_numbers_the_node_by_node_rank(script, hostfile):
    spec = resolve(script, hostfile=hostfile, node_rank=2, master_addr="10.0.0.9", master_port=6000)
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank, spec.master_addr, spec.master_port) == (
        3, 4, 2, "10.0.0.9", 6000)


def test_include_picks_this_nodes_devices(script, hostfile, on_node_b, monkeypatch):
    monkeypatch.setattr(spec_module, "accelerator_type", lambda: "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = resolve(script, hostfile=hostfile, include="node-a:0,1@node-b:1,3")
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank) == (2, 2, 1)
    assert spec.visible_devices == (1, 3) and spec.device_env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    gpus = resolve(script, hostfile=hostfile, num_gpus=2)
    assert (gpus.nnodes, gpus.nproc_per_node, gpus.device_env) == (3, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_on_a_node_without_accelerators_a_selection_only_counts_processes(script, hostfile, on_node_b, monkeypatch):
    monkeypatch.setattr(spec_module, "accelerator_type", lambda: None)
    spec = resolve(script, hostfile=hostfile, include="node-a:0,1@node-b:1,3")
    assert (spec.nproc_per_node, spec.visible_devices, spec.device_env) == (2, None, {})
    monkeypatch.setattr(spec_module, "local_slots", lambda: None)
    local = resolve(script, include="localhost:0,1,2")
    assert (local.nnodes, local.nproc_per_node, local.device_env) == (1, 3, {})
    with pytest.raises(LaunchError, match=r"'localhost' has no accelerators, so no devices to exclude; fix: pass "
                                          r"--nproc-per-node"):
        resolve(script, exclude="localhost:0")


def test_without_a_hostfile_include_picks_this_machines_devices(script, monkeypatch):
    monkeypatch.setattr(spec_module, "local_slots", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(spec_module, "accelerator_type", lambda: "xpu")
    spec = resolve(script, include="localhost:1")   # the seed's `deepspeed --include localhost:1`
    assert (spec.nnodes, spec.nproc_per_node, spec.device_env) == (1, 1, {"ZE_AFFINITY_MASK": "1"})
    assert resolve(script, exclude="localhost:0").device_env == {"ZE_AFFINITY_MASK": "1,2,3"}
    with pytest.raises(LaunchError) as err:
        resolve(script, include="worker-1:0,1")
    assert str(err.value) == ("--include='worker-1:0,1' names host 'worker-1', which this node alone (no --hostfile) "
                              "does not list; fix: pass --hostfile listing the hosts, or select this node as "
                              "'localhost'")


def test_num_gpus_and_num_nodes_without_a_hostfile_are_the_shape(script):
    assert resolve(script, num_gpus=3).nproc_per_node == 3
    spec = resolve(script, num_nodes=2, num_gpus=2, node_rank=1, master_addr="10.0.0.1")
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank) == (2, 2, 1)


def test_devices_count_within_what_a_scheduler_already_shows():
    assert visible_devices_env((1, 3), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "cuda") == {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert visible_devices_env((0, 1), {}, "hpu") == {"HABANA_VISIBLE_MODULES": "0,1"}
    assert visible_devices_env((0,), {}, "mps") == {}
    with pytest.raises(LaunchError, match=r"slot 2 is not among the 2 devices CUDA_VISIBLE_DEVICES=4,5 shows; fix"):
        visible_devices_env((0, 2), {"CUDA_VISIBLE_DEVICES": "4,5"}, "cuda")


@pytest.mark.parametrize("kwargs, message", [
    (dict(exclude="node-b"), "hostfile {h}: the selection leaves this node (node-b) no slots; fix: run on the "
                             "selected hosts only (node-a, node-c), or select this one"),
    (dict(include="node-a@node-b:0,1"), "hostfile {h}: the selected nodes have different numbers of slots (node-a=4, "
                                        "node-b=2), and shardwise runs as many processes on every node; fix: give "
                                        "every node the same slots=N, or select as many slots on each"),
    (dict(include="node-a:0@node-b:0", nproc_per_node=2),
     "--nproc-per-node=2 disagrees with hostfile {h} (1); fix: drop --nproc-per-node or edit the hostfile or the "
     "selection"),
])
def test_resolution_refusals_are_one_line_with_the_fix(script, hostfile, on_node_b, kwargs, message):
    with pytest.raises(LaunchError) as err:
        resolve(script, hostfile=hostfile, **kwargs)
    assert str(err.value) == message.format(h=hostfile)


# --- real launches -----------------------------------------------------------------------------------------


def test_num_gpus_2_launches_two_ranks_that_get_deepspeeds_local_rank(script, tmp_path, capsys):
    """`deepspeed --num_gpus=2 train.py --deepspeed_config ds.json` with `deepspeed` replaced by `shardwise run`."""
    run_dir = tmp_path / "run"
    code = main(["run", "--num_gpus=2", "--run-dir", str(run_dir), script, "--deepspeed_config", "ds.json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in range(2):
        got = json.loads((run_dir / f"logs/rank{rank}/stdout.log").read_text())
        assert got == {"rank": rank, "world": 2, "local_rank_env": rank, "local_rank_arg": rank,
                       "deepspeed_config": "ds.json"}


@pytest.mark.slow
def test_two_nodes_started_by_the_seeds_no_ssh_lines(script, tmp_path):
    """`deepspeed --hostfile=hostfile --no_ssh --node_rank=N --master_addr=... --master_port=... train.py` on two
    "nodes" of this machine."""
    from test_launcher import _cli, _free_port

    hosts = tmp_path / "hostfile"
    hosts.write_text("node-0 slots=2\nnode-1 slots=2\n")
    run_dir = tmp_path / "run"
    common = [f"--hostfile={hosts}", "--no_ssh", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
              "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"),
                                                                  os.path.dirname(__file__)) if p)}
    node1 = _cli("run", *common, "--node_rank=1", script, env=env)
    node0 = _cli("run", *common, "--node_rank=0", script, env=env)
    out0, err0 = node0.communicate(timeout=120)
    out1, err1 = node1.communicate(timeout=120)
    assert node0.returncode == 0 and node1.returncode == 0, err0 + err1
    for rank in range(4):
        got = json.loads((run_dir / f"logs/rank{rank}/stdout.log").read_text())
        assert (got["rank"], got["world"], got["local_rank_arg"]) == (rank, 4, rank % 2)
