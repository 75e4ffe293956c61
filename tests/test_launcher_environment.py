"""SLURM and Kubernetes PyTorchJob environments give `shardwise run` its shape when no flag does."""

from __future__ import annotations

import argparse

import pytest

from shardwise.launcher.from_args import scheduler_shape
from shardwise.launcher import LaunchError
from shardwise.launcher.environment import Environment, detect, expand_nodelist

SLURM = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "gpu[07-08,10]", "SLURM_NTASKS_PER_NODE": "1(x3)", "SLURM_GPUS_ON_NODE": "4"}
PYTORCHJOB = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"}
PET = {**PYTORCHJOB, "PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "3",
       "PET_MASTER_ADDR": "pet-master", "PET_MASTER_PORT": "29400"}


def _flags(**given) -> argparse.Namespace:
    shape = dict(nproc_per_node=None, nnodes=None, node_rank=None, master_addr=None, master_port=None, hostfile=None)
    return argparse.Namespace(command="run", **{**shape, **given})


def test_nodelists_expand():
    assert expand_nodelist("gpu[07-08,10],login1") == ["gpu07", "gpu08", "gpu10", "login1"]
    assert expand_nodelist("a-[9-10]-ib") == ["a-9-ib", "a-10-ib"]


@pytest.mark.parametrize("env, want", [
    (SLURM, Environment("SLURM", nnodes=3, node_rank=2, master_addr="gpu07", nproc_per_node=4)),
    ({**SLURM, "SLURM_GPUS_ON_NODE": "", "SLURM_NTASKS_PER_NODE": "2(x3)", "MASTER_PORT": "3000"},
     Environment("SLURM", nnodes=3, node_rank=2, master_addr="gpu07", master_port=3000, nproc_per_node=2)),
    (PYTORCHJOB, Environment("Kubernetes PyTorchJob", nnodes=2, node_rank=1, master_addr="job-master-0",
                             master_port=23456)),
    (PET, Environment("Kubernetes PyTorchJob", nnodes=4, node_rank=3, master_addr="pet-master", master_port=29400,
                      nproc_per_node=8)),
    ({**PYTORCHJOB, "LOCAL_RANK": "0"}, None),  # a torchrun rank, not a node
    ({"PATH": "/bin"}, None),
])
def test_detected_from_fake_environments(env, want):
    assert detect(env) == want


def test_flags_win_and_the_environment_is_named(monkeypatch, capsys):
    monkeypatch.setattr("os.environ", {**SLURM})
    assert scheduler_shape(_flags(nproc_per_node=2)) == dict(nproc_per_node=2, nnodes=3, node_rank=2,
                                                             master_addr="gpu07", master_port=None)
    assert "launch environment: SLURM (nnodes=3, node_rank=2, master_addr=gpu07, nproc_per_node=4)" in \
        capsys.readouterr().out
    assert scheduler_shape(_flags(hostfile="hosts"))["nnodes"] is None  # a hostfile says the shape itself


def test_a_malformed_variable_is_one_line():
    with pytest.raises(LaunchError, match="SLURM_NNODES='many' is not a number"):
        detect({**SLURM, "SLURM_NNODES": "many"})
