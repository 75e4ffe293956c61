"""`shardwise report RUN_DIR`: one self-contained HTML page of a run — summary, plots, comms, layout, config.

The plots are PNGs inlined as data URIs, so the page can be copied off a cluster or attached to an issue
as one file. Plots of metrics the run did not record are left out and listed as such.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from statistics import median
from typing import Any, Optional

import jinja2
from markupsafe import Markup

from .report_data import RunData, read_run
from .report_plots import PLOTS, byte_unit

REPORT_FILE = "report.html"

# The pages' style (the run report's and the tuning report's).
STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
table { border-collapse: collapse; } td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.5em 0; } img { max-width: 100%; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; }
</style>"""

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>shardwise report: {{ name }}</title>
{{ style }}</head><body>
<h1>shardwise report: {{ name }}</h1>
<p>{{ root }}</p>
<h2>Summary</h2>
<table>{% for label, value in summary %}<tr><th>{{ label }}</th><td>{{ value }}</td></tr>{% endfor %}</table>
<h2>Plots</h2>
{% for plot in plots %}<figure id="{{ plot.name }}">
<img src="data:image/png;base64,{{ plot.png }}" alt="{{ plot.title }}"></figure>
{% endfor %}{% if missing %}<p>Not recorded in this run (config key that records it):
{{ missing | join(", ") }}.</p>{% endif %}
{% if comms %}<h2>Communication per rank and step</h2>
<table><tr><th>group</th><th>collective</th><th>calls</th><th>{{ comms_unit }}</th><th>seconds</th>
<th>algbw GB/s</th><th>busbw GB/s</th></tr>
{% for row in comms %}<tr><td>{{ row[0] }}</td><td>{{ row[1] }}</td>
{% for cell in row[2:] %}<td class="n">{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</table>{% endif %}
<h2>Layout</h2>
<pre>{{ layout }}</pre>
<h2>Config</h2>
<p>The keys the run was given (everything else had its default):</p>
<pre>{{ config }}</pre>
</body></html>
"""


def _number(value: Optional[float], digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _median(run: RunData, key: str) -> Optional[float]:
    values = run.series(key)[1]
    return median(values) if values else None


def summary(run: RunData) -> list[tuple[str, str]]:
    """The run in a few numbers: its shape and outcome, and each rate's median over the recorded steps."""
    launch = run.launches[0] if run.launches else {}
    rows = [("started", launch.get("started", "–")),
            ("ranks", f"{launch['world_size']} ({launch['nnodes']} node(s) × {launch['nproc_per_node']})"
             if "world_size" in launch else "–"),
            ("exit code", str(launch.get("exit_code", "–"))),
            ("wall time", f"{launch['seconds']:.1f} s" if "seconds" in launch else "–")]
    if run.steps:
        last = run.steps[-1]
        rows += [("steps recorded", f"{len(run.steps)} (steps {run.steps[0]['step']}–{last['step']})"),
                 ("last loss", _number(run.series("loss")[1][-1] if run.has("loss") else None, 6)),
                 ("skipped steps", str(last.get("skipped_steps", "–")))]
        rows += [(f"{label} (median)", _number(_median(run, key)))
                 for key, label in (("step_time_s", "step time, s"), ("samples_per_s", "samples/s"),
                                    ("tokens_per_s", "tokens/s"), ("tflops_per_s", "TFLOP/s per rank"),
                                    ("mfu", "MFU")) if run.has(key)]
    return rows


def png_data(figure) -> str:
    """A figure as base64 PNG, for an <img src="data:image/png;base64,..."> (the page stays one file)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def render(run: RunData) -> str:
    """The report page of `run` as HTML text."""
    plots, missing = [], []
    for name, title, draw, key in PLOTS:
        figure = draw(run)
        if figure is None:
            missing.append(f"{title} ({key})")
        else:
            plots.append({"name": name, "title": title, "png": png_data(figure)})
    comms = run.comms()
    size, unit = byte_unit(max((t.bytes for t in comms), default=1))
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_TEMPLATE).render(
        style=Markup(STYLE), name=run.root.name, root=str(run.root.resolve()), summary=summary(run), plots=plots,
        missing=missing, layout=run.layout_text(),
        config=json.dumps(run.config, indent=2) if run.config is not None else "(no config.json in the run directory)",
        comms_unit=unit, comms=[(t.group, t.collective, _number(t.count), _number(t.bytes / size), _number(t.time_s),
                                 _number(t.algbw_gbps), _number(t.busbw_gbps)) for t in comms])


def write_report(run_dir: Any) -> Path:
    """Write RUN_DIR/report.html; a ReportError (one line: the directory and how to record metrics) when
    the run has none."""
    run = read_run(Path(run_dir))
    path = run.root / REPORT_FILE
    path.write_text(render(run), encoding="utf-8")
    return path
