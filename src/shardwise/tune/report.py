"""<results>/tune_report.html: one self-contained page of a tuning run in the run report's style: the planner's
accuracy, predicted against measured step time and peak memory per trial (plotted, and tabled with their errors),
each failure, and the best config. Like `shardwise report`, it needs matplotlib (an optional dependency)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import jinja2
from markupsafe import Markup

from ..observe.report import STYLE, png_data
from ..observe.report_plots import byte_unit
from .results import COLUMNS, REPORT_FILE, cells, number
from .tuner import TuneResult, TuneSettings

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>shardwise tune: {{ name }}</title>
{{ style }}</head><body>
<h1>shardwise tune: {{ name }}</h1>
<p>{{ root }}</p>
<h2>Summary</h2>
<table>{% for label, value in summary %}<tr><th>{{ label }}</th><td>{{ value }}</td></tr>{% endfor %}</table>
{% if plot %}<h2>Predicted and measured</h2>
<figure id="predicted-measured"><img src="data:image/png;base64,{{ plot }}" alt="predicted and measured">
</figure>{% else %}<p>No trial was measured, so there is nothing to plot.</p>{% endif %}
<h2>Trials</h2>
<table><tr>{% for name in columns %}<th>{{ name }}</th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for cell in row %}<td class="n">{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% if failures %}<h2>Failures</h2><table>{% for trial, kind, message in failures %}
<tr><td>trial {{ trial }}</td><td>{{ kind }}</td><td>{{ message }}</td></tr>{% endfor %}</table>{% endif %}
{% if calibration %}<h2>Calibration</h2>
<p>The planner's cluster constants fitted to these trials (cluster file {{ calibration.path }}): {{ calibration.scales }}.
Mean |error| of step time {{ calibration.before }} before, {{ calibration.after }} after.</p>
<table><tr><th>trial</th><th>measured s</th><th>predicted s before</th><th>error</th><th>after</th><th>error</th></tr>
{% for row in calibration.rows %}<tr>{% for cell in row %}<td class="n">{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</table>{% endif %}
<h2>Best config</h2>
<pre>{{ best }}</pre>
</body></html>
"""

def _figure(rows: Sequence[dict[str, Any]]):
    """Two panels, step time and peak memory: each measured trial at (predicted, measured), with the diagonal
    where they agree; None without a measured trial."""
    from matplotlib.figure import Figure

    done = [r for r in rows if r["measured_step_time_s"] is not None]
    if not done:
        return None
    fig = Figure(figsize=(7.5, 3.6), layout="constrained")
    memory_size, memory_unit = byte_unit(max(max(r["predicted_memory_bytes"], r["max_memory_bytes"] or 0)
                                             for r in done))
    panels = (("step time, s", "predicted_step_time_s", "measured_step_time_s", 1.0),
              (f"peak memory per rank, {memory_unit}", "predicted_memory_bytes", "max_memory_bytes", memory_size))
    for ax, (title, predicted, measured, unit) in zip(fig.subplots(1, 2), panels):
        points = [(r[predicted] / unit, r[measured] / unit, r["trial"]) for r in done if r[measured] is not None]
        xs, ys, labels = zip(*points)
        ax.scatter(xs, ys)
        for x, y, label in points:
            ax.annotate(str(label), (x, y), textcoords="offset points", xytext=(4, 4))
        top = max(*xs, *ys) * 1.1
        ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="predicted = measured")
        ax.set(xlim=(0, top), ylim=(0, top), xlabel="predicted", ylabel="measured", title=title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    return fig


def _calibration(calibrated) -> Optional[dict[str, Any]]:
    """The calibration section's cells from (Calibration, cluster file path), or None."""
    if calibrated is None:
        return None
    fitted, path = calibrated
    s = fitted.summary()
    rows = [[str(n), f"{m:.4f}", f"{b:.4f}", f"{b / m - 1:+.0%}", f"{a:.4f}", f"{a / m - 1:+.0%}"]
            for n, m, b, a in zip(fitted.trials, fitted.measured, fitted.before, fitted.after)]
    return {"path": str(path), "rows": rows, "before": number(s["mean_abs_error_before"], ".0%"),
            "after": number(s["mean_abs_error_after"], ".0%"),
            "scales": fitted.described()}


def render(result: TuneResult, settings: TuneSettings, calibrated=None) -> str:
    """The page; `calibrated` is (Calibration, cluster file path) when the trials were calibrated."""
    a = result.accuracy
    summary = [("script", " ".join([settings.script, *settings.script_args])),
               ("ranks", str(settings.nproc)), ("metric", settings.metric),
               ("steps per trial", f"{settings.steps} ({settings.warmup} warm-up)"),
               ("trials", f"{len(result.rows)} run, {a.trials} measured"), ("stopped", result.stopped),
               ("best", f"trial {result.best['trial']}" if result.best else "none measured"),
               ("Spearman's rho, step time", number(a.spearman_step_time, ".2f")),
               ("regret of the planner's pick", number(a.regret, ".2f")),
               ("mean |error|, step time", number(a.mean_abs_step_time_error, ".0%")),
               ("mean |error|, peak memory", number(a.mean_abs_memory_error, ".0%"))]
    figure = _figure(result.rows)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_TEMPLATE).render(
        style=Markup(STYLE), name=settings.results.name, root=str(settings.results.resolve()), summary=summary,
        plot=png_data(figure) if figure is not None else None, columns=COLUMNS,
        rows=[cells(r, result.best) for r in result.rows],
        failures=[(r["trial"], r["failure"], r["message"]) for r in result.rows if r["failure"]],
        best=json.dumps(result.best["config"], indent=2) if result.best else "(no trial was measured)",
        calibration=_calibration(calibrated))


def write_tune_report(result: TuneResult, settings: TuneSettings, calibrated=None) -> Path:
    path = settings.results / REPORT_FILE
    path.write_text(render(result, settings, calibrated), encoding="utf-8")
    return path
