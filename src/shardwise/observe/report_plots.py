"""The report's plots, drawn with matplotlib's object API (no pyplot: no global figure state, no display).

Each function returns a Figure, or None when the run recorded nothing it could draw.
"""

from __future__ import annotations

from typing import Callable, Optional

from .report_data import BREAKDOWN, MEMORY_MEASURED, MEMORY_STATE, RunData

try:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError as err:  # an optional dependency: only `shardwise report` needs it
    raise ImportError("the report draws its plots with matplotlib, which is not installed; fix: pip install "
                      "matplotlib") from err

_SIZE = (7.5, 3.6)
_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def byte_unit(largest: float) -> tuple[float, str]:
    """The largest binary unit in which `largest` is at least 1."""
    return next(((size, name) for size, name in _UNITS if largest >= size), _UNITS[-1])


def _figure(title: str, xlabel: str = "step", rows: int = 1, whole_x: bool = True) -> tuple[Figure, list]:
    """A figure of `rows` plots over one x axis; `whole_x`: ticks at whole numbers only (steps, ranks)."""
    fig = Figure(figsize=(_SIZE[0], _SIZE[1] * (1 + 0.45 * (rows - 1))), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    axes[0].set_title(title)
    axes[-1].set_xlabel(xlabel)
    if whole_x:
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, list(axes)


def loss_figure(run: RunData) -> Optional[Figure]:
    """Loss, with the learning rate, gradient norm and fp16 loss scale beneath it where recorded."""
    if not run.has("loss"):
        return None
    extras = [(key, label) for key, label in (("lr", "learning rate"), ("grad_norm", "gradient norm"),
                                             ("loss_scale", "loss scale")) if run.has(key)]
    fig, axes = _figure("loss", rows=1 + len(extras))
    for ax, (key, label) in zip(axes, [("loss", "loss"), *extras]):
        steps, values = run.series(key)
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if any(key == "loss_scale" for key, _ in extras):
        axes[-1].set_yscale("log", base=2)
    return fig


def step_time_figure(run: RunData) -> Optional[Figure]:
    """Where each step's time went: the breakdown stacked, the measured step time as a line over it."""
    if not run.has("step_time_s"):
        return None
    parts = [key for key in BREAKDOWN if run.has(key, within="breakdown")]
    fig, (ax,) = _figure("step time" if parts else "step time (its breakdown: set wall_clock_breakdown)")
    if parts:
        steps = [row["step"] for row in run.steps if row.get("breakdown")]
        values = [[(row["breakdown"].get(key) or 0.0) for row in run.steps if row.get("breakdown")] for key in parts]
        ax.stackplot(steps, values, labels=[key.removesuffix("_s").replace("_", " ") for key in parts], alpha=0.8)
    ax.plot(*run.series("step_time_s"), color="black", linewidth=1.2, label="step time")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return fig


def throughput_figure(run: RunData) -> Optional[Figure]:
    """Samples per second, and tokens per second on a second axis when the batch had a sequence dimension."""
    if not run.has("samples_per_s"):
        return None
    fig, (ax,) = _figure("throughput")
    lines = ax.plot(*run.series("samples_per_s"), label="samples/s")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    if run.has("tokens_per_s"):
        twin = ax.twinx()
        lines += twin.plot(*run.series("tokens_per_s"), color="tab:orange", linestyle="--", label="tokens/s")
        twin.set_ylabel("tokens/s")
        twin.set_ylim(bottom=0)
    ax.legend(handles=lines, loc="lower right")
    return fig


def memory_figure(run: RunData) -> Optional[Figure]:
    """Per rank, the largest recorded: model state by category stacked (parameters, gradients, optimizer
    state) beside the allocator's peak and current bytes; the host's resident set beneath, on its own scale."""
    memory = run.memory_by_rank()
    if not memory:
        return None
    ranks = list(memory)
    host = [memory[r].get("host_rss_bytes") for r in ranks]
    fig, axes = _figure("memory per rank (largest recorded)", "rank", rows=2 if any(v is not None for v in host) else 1)
    device = [key for key in MEMORY_MEASURED if key != "host_rss_bytes" and any(key in memory[r] for r in ranks)]
    size, unit = byte_unit(max((v for m in memory.values() for k, v in m.items() if k != "host_rss_bytes"), default=1))
    width = 0.8 / (1 + len(device))
    bottom = [0.0] * len(ranks)
    for key in MEMORY_STATE:
        heights = [memory[r].get(key, 0) / size for r in ranks]
        axes[0].bar([r - 0.4 + width / 2 for r in ranks], heights, width, bottom=bottom, label=_label(key))
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, key in enumerate(device, 1):
        axes[0].bar([r - 0.4 + width * (i + 0.5) for r in ranks], [memory[r].get(key, 0) / size for r in ranks],
                    width, label=_label(key), hatch="//" if key == "device_peak_bytes" else None)
    axes[0].set_ylabel(unit)
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    if len(axes) == 2:
        size, unit = byte_unit(max(v or 0 for v in host) or 1)
        axes[1].bar(ranks, [(v or 0) / size for v in host], 0.4, color="tab:brown")
        axes[1].set_ylabel(f"host RSS, {unit}")
    return fig


def comms_figure(run: RunData) -> Optional[Figure]:
    """Bytes a rank moves per step in each process group, stacked by collective."""
    totals = run.comms()
    if not totals:
        return None
    fig, (ax,) = _figure("bytes per process group (per rank and step)", "process group", whole_x=False)
    groups = list(dict.fromkeys(t.group for t in totals))
    size, unit = byte_unit(max(sum(t.bytes for t in totals if t.group == g) for g in groups) or 1)
    bottom = [0.0] * len(groups)
    for collective in dict.fromkeys(t.collective for t in totals):
        heights = [sum(t.bytes for t in totals if t.group == g and t.collective == collective) / size for g in groups]
        ax.bar(groups, heights, bottom=bottom, label=collective)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel(unit)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return fig


def _label(key: str) -> str:
    return key.removesuffix("_bytes").replace("_", " ")


# (name, what it shows, how to draw it, the config key that records it), in the order the report shows them.
PLOTS: list[tuple[str, str, Callable[[RunData], Optional[Figure]], str]] = [
    ("loss", "loss", loss_figure, "metrics_interval"),
    ("step_time", "step time and its breakdown", step_time_figure, "metrics_interval"),
    ("throughput", "throughput", throughput_figure, "metrics_interval"),
    ("memory", "memory per rank by category", memory_figure, "metrics_interval"),
    ("comms", "bytes per process group", comms_figure, "comms_logger"),
]
