"""`shardwise demo`: a small GPT-2 on 4 CPU ranks with MiCS and activation checkpointing learns."""

import re

import pytest

from shardwise.cli import main


def _losses(out):
    return [float(m) for m in re.findall(r"^step +\d+/\d+ +loss ([\d.]+)", out, flags=re.M)]


def test_demo_default_run_trains_with_mics_and_learns_the_rule(tmp_path, capsys):
    """The README's first command as it stands: 40 steps, reported every 5, and the rule learnt."""
    run_dir = tmp_path / "demo"
    code = main(["demo", "--run-dir", str(run_dir)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "layout: pp=1 × dp_replicate=2 × dp_shard=2 × tp=1" in out
    assert "MiCS / ZeRO-2D (ZeRO-3 in partition groups of 2, 2 replicas)" in out
    losses = _losses(out)
    assert len(losses) == 9  # steps 1, 5, 10, ..., 40
    assert 5.3 < losses[0] < 5.8  # ≈ ln(256): a fresh model guesses uniformly
    assert losses[-1] < 1.0
    summary = next(line for line in out.splitlines() if line.startswith("done:"))
    assert f"loss {losses[0]:.3f} → {losses[-1]:.3f}" in summary and "tokens/s" in summary
    assert "40 steps on 4 ranks (dp 4)" in summary
    for rank in range(4):
        assert (run_dir / f"logs/rank{rank}/stdout.log").is_file()
    assert "step" not in (run_dir / "logs/rank3/stdout.log").read_text()  # only rank 0 reports


def test_demo_rejects_a_config_that_does_not_fit_before_starting(tmp_path, capsys):
    code = main(["demo", "--nproc-per-node", "3", "--run-dir", str(tmp_path / "demo")])
    assert code == 2
    assert "sharded_data_parallel_degree=2: must divide the data-parallel degree 3" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: '0' is not a whole number above 0; fix: pass a whole number above 0"),
    (["--steps", "-1"], "argument --steps: '-1' is not a whole number above 0; fix: pass a whole number above 0"),
    (["--batch-size", "0"], "argument --batch-size: '0' is not a whole number above 0; fix: pass a whole number above 0"),
    (["--lr", "-1"], "argument --lr: '-1' is not a number above 0; fix: pass a number above 0"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a number above 0; fix: pass a number above 0"),
])
def test_demo_rejects_bad_training_flags_before_starting(tmp_path, capsys, monkeypatch, argv, message):
    """argparse's exit 2 and one error line naming the flag, before any rank or run directory exists."""
    from shardwise.cli import demo

    monkeypatch.setattr(demo, "launch_from_args", lambda *a: pytest.fail("demo launched"))
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv, "--run-dir", str(tmp_path / "demo")])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"shardwise demo: error: {message}"
    assert not (tmp_path / "demo").exists()
