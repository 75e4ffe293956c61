"""The recorder's parts one at a time: bus-bandwidth factors, the comms summary, the breakdown's arithmetic,
flattened sinks, the progress display's plain lines, the config's notices and errors, and the comms watch on
c10d and functional collectives (the one part that needs a process group)."""

from __future__ import annotations

import io

import pytest

from shardwise.config import ConfigError, ShardwiseConfig, ineffective_settings
from shardwise.observe.comms import Collective, bus_factor, summary
from shardwise.observe.progress import ProgressDisplay
from shardwise.observe.sinks import flat
from shardwise.observe.timing import StepClock
from shardwise.topology import Cluster
from shardwise.config.layout import validate


@pytest.mark.parametrize(("collective", "ranks", "factor"), [
    ("all_reduce", 4, 1.5), ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875), ("all_to_all", 2, 0.5),
    ("broadcast", 4, 1.0), ("all_reduce", 1, 1.0)])
def test_bus_factors_are_nccl_tests(collective, ranks, factor):
    assert bus_factor(collective, ranks) == factor


def test_comms_summary_adds_up_per_collective_and_group():
    log = [Collective("all_reduce", "dp", 4, 100, issued=0.0, done=1e-6),
           Collective("all_reduce", "dp", 4, 300, issued=1.0, done=1.0 + 3e-6),
           Collective("all_gather", "shard", 2, 50, issued=2.0, done=None)]  # still in flight at 2.5
    rows = {(r["collective"], r["group"]): r for r in summary(log, now=2.5)}
    dp = rows["all_reduce", "dp"]
    assert (dp["count"], dp["bytes"]) == (2, 400)
    assert dp["algbw_gbps"] == pytest.approx(400 / 4e-6 / 1e9)
    assert dp["busbw_gbps"] == pytest.approx(dp["algbw_gbps"] * 1.5)
    assert rows["all_gather", "shard"]["time_s"] == pytest.approx(0.5)


def test_exposed_communication_is_taken_from_the_phase_it_fell_in():
    clock = StepClock()
    clock.add("data_wait", 0.0, 1.0)
    clock.add("step", 1.0, 5.0)
    clock.add("forward", 1.5, 2.5)
    clock.add("optimizer", 6.0, 7.0)
    parts = clock.breakdown(end=8.0, exposed=[(4.0, 4.5), (6.5, 6.75)])
    assert parts == {"forward_s": 1.0, "backward_s": 2.5, "optimizer_s": 0.75, "data_wait_s": 1.0,
                     "exposed_comm_s": 0.75, "other_s": 2.0}
    assert sum(parts.values()) == clock.elapsed(8.0) == 8.0


def test_sinks_flatten_nested_records():
    assert flat({"step": 1, "breakdown": {"forward_s": 0.5}}) == {"step": 1, "breakdown/forward_s": 0.5}


RECORD = {"step": 5, "loss": 2.34567, "step_time_s": 0.25, "samples_per_s": 32.0, "tokens_per_s": 2048.0}


def test_progress_without_a_terminal_prints_plain_lines_at_its_cadence():
    out = io.StringIO()
    display = ProgressDisplay(total=10, every=5, stream=out)
    for step in range(1, 11):
        display.write({**RECORD, "step": step})
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/10", "5/10", "10/10"]
    assert lines[1].startswith("step 5/10  loss 2.346  step 250 ms  2,048 tokens/s  ETA ")
    assert "ETA" not in lines[-1]


def test_progress_shows_samples_when_the_batch_has_no_sequence():
    out = io.StringIO()
    ProgressDisplay(total=None, stream=out).write({**RECORD, "loss": None, "tokens_per_s": None, "step": 1})
    assert out.getvalue() == "step 1  step 250 ms  32.0 samples/s\n"


def test_recording_keys_without_recording_are_named():
    config = ShardwiseConfig(metrics_interval=0, comms_logger=True, metrics_sinks=["csv"])
    assert ineffective_settings(config) == [("metrics_sinks", "needs metrics_interval >= 1"),
                                            ("comms_logger", "needs metrics_interval >= 1")]
    config = ShardwiseConfig(peak_tflops=312.0, wandb_project="runs")
    assert ineffective_settings(config) == [("peak_tflops", "MFU needs flops_profiler"),
                                            ("wandb_project", "needs wandb in metrics_sinks")]
    assert ineffective_settings(ShardwiseConfig(flops_profiler=True, peak_tflops=312.0)) == []


def test_an_unknown_sink_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="metrics_sinks") as info:
        validate({"metrics_sinks": ["prometheus"]}, Cluster())
    assert "'csv', 'tensorboard' or 'wandb'" in str(info.value)


def _collectives_seen() -> list[tuple]:
    """A c10d all-reduce, a functional all-reduce and a functional all-gather of 8 floats over the world."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from shardwise.observe.comms import CollectiveWatch

    world = dist.group.WORLD
    with CollectiveWatch({world.group_name: ("world", dist.get_world_size())}) as watch:
        dist.all_reduce(torch.ones(8))
        funcol.all_reduce(torch.ones(8), "sum", world).wait()
        funcol.all_gather_tensor(torch.ones(8), 0, world).wait()
    watch.close()
    return [(c.name, c.group, c.nbytes, c.done is not None) for c in watch.collectives]


def test_the_watch_sees_c10d_and_functional_collectives_to_their_completion():
    from shardwise.testing import run_distributed

    seen = run_distributed(_collectives_seen, 2)
    assert seen[0] == seen[1] == [("all_reduce", "world", 32, True), ("all_reduce", "world", 32, True),
                                  ("all_gather", "world", 64, True)]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_rich_bar_that_ends_with_the_run():
    out = _Terminal()
    display = ProgressDisplay(total=10, stream=out)
    for step in range(1, 11):
        display.write({**RECORD, "step": step})
    assert not display.bar.live.is_started  # stopped at the last step
    assert "10/10" in out.getvalue() and "loss 2.346" in out.getvalue() and "2,048 tokens/s" in out.getvalue()
