"""`shardwise plan`: the ranked table, --explain, --json, --out, and one-line errors."""

import json

import pytest
import yaml

from shardwise.cli import main
from shardwise.config import parse_config
from shardwise.planner import cluster_preset
from shardwise.config.layout import layout_for

SMALL = ["plan", "--model", "gpt2", "--cluster", "2xp4d.24xlarge", "--global-batch", "64", "--seq", "512"]


def _run(capsys, *extra):
    code = main([*SMALL, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_ranks_the_top_layouts(capsys):
    code, out, _ = _run(capsys, "--top", "3")
    assert code == 0
    assert "gpt2 (0.12B parameters) on 2xp4d.24xlarge (16 × A100-SXM4-40GB)" in out
    for column in ("tp", "pp", "params", "grads", "optim", "act", "other", "total GiB", "step s", "tokens/s", "MFU"):
        assert column in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["1", "2", "3"]


def test_explain_shows_time_parts_collectives_and_rejections(capsys):
    code, out, _ = main(["plan", "--model", "gpt2-10b", "--cluster", "2xp4d.24xlarge", "--global-batch", "16",
                         "--explain"]), *capsys.readouterr()
    assert code == 0
    assert "step time by part" in out and "collectives of #1" in out
    assert "rejected layouts" in out
    assert "pp=1 dp_replicate=16 dp_shard=1 tp=1 DDP ckpt=none: needs" in out
    assert "tensor_parallel_degree=16: must not exceed the 8 devices per node" in out


def test_json_lists_every_layout_with_a_runnable_config(capsys):
    code, out, _ = _run(capsys, "--json")
    assert code == 0
    rows = json.loads(out)
    cluster = cluster_preset("2xp4d.24xlarge").topology
    assert rows[0]["fits"] and {"config", "layout", "memory_bytes", "step_time_s", "fits"} <= set(rows[0])
    assert set(rows[0]["memory_bytes"]) == {"parameters", "gradients", "optimizer", "activations", "other", "total"}
    seen_fit_end = False
    for row in rows:
        seen_fit_end |= not row["fits"]
        assert row["fits"] != seen_fit_end, "fitting layouts come first"
        assert ("reason" in row) == (not row["fits"])
        if row["memory_bytes"] is not None:
            assert layout_for(parse_config(row["config"]), cluster).degrees() == row["layout"]
    times = [row["step_time_s"] for row in rows if row["fits"]]
    assert times == sorted(times)


@pytest.mark.parametrize("suffix,load", [(".json", json.loads), (".yaml", yaml.safe_load)])
def test_out_writes_the_best_config(capsys, tmp_path, suffix, load):
    path = tmp_path / f"best{suffix}"
    code, out, err = _run(capsys, "--json", "--out", str(path))
    assert code == 0 and f"wrote the best config to {path}" in err
    best = json.loads(out)[0]["config"]
    assert load(path.read_text()) == best
    parse_config(best)


def test_custom_cluster_from_flags(capsys):
    code = main(["plan", "--model", "gpt2", "--nodes", "2", "--devices-per-node", "8", "--device-memory-gib", "40",
                 "--peak-tflops", "312", "--intra-node-gbs", "300", "--inter-node-gbs", "50", "--top", "1"])
    out, _ = capsys.readouterr()
    assert code == 0 and "on 2xcustom (16 × custom device)" in out


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt2-10", "--cluster", "p4d.24xlarge"],
     "unknown model 'gpt2-10' (did you mean 'gpt2-10b'?)"),
    (["--model", "gpt2", "--cluster", "16xp4d.24xlarg"],
     "unknown cluster preset 'p4d.24xlarg' (did you mean 'p4d.24xlarge'?)"),
    (["--model", "gpt2"], "no --cluster preset given; pass --cluster [N x]PRESET"),
    (["--model", "gpt2", "--cluster", "g4dn.12xlarge", "--precision", "bf16"],
     "precision 'bf16' is not supported by T4-16GB"),
    (["--model", "os:getcwd", "--cluster", "p4d.24xlarge"], "getcwd() returned str, not a torch.nn.Module"),
    (["--model", "gpt2", "--cluster", "p4d.24xlarge", "--out", "best.txt"],
     "--out 'best.txt': use a .json, .yaml or .yml"),
])
def test_bad_input_is_one_line_on_stderr_with_exit_2(capsys, args, message):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("shardwise plan: ") and message in err and err.count("\n") == 1


def test_link_efficiency_flag_reaches_the_plan_and_refuses_a_share_above_one(capsys):
    def best_step(*flags) -> float:
        assert main(["plan", "--model", "gpt2", "--cluster", "2xp4d.24xlarge", "--json", *flags]) == 0
        return min(e["step_time_s"] for e in json.loads(capsys.readouterr().out) if e["fits"])

    assert best_step("--link-efficiency", "0.2") > best_step("--link-efficiency", "1")
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--model", "gpt2", "--cluster", "local", "--link-efficiency", "1.5"])
    assert stop.value.code == 2 and "'1.5' is above 1; fix: pass a share in (0, 1]" in capsys.readouterr().err
