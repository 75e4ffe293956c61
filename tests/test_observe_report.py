"""`shardwise report`: the page is written from a run directory's metrics and its plots load in headless Chromium.

The browser check needs Chromium (Debian: `apt-get install -y chromium`); without one those tests are skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.observe.report_data import read_run

pytest.importorskip("matplotlib")

_BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_browser = pytest.mark.skipif(
    _BROWSER is None, reason="no Chromium on this machine to check that the report's plots load in a browser; "
                             "install one (Debian: apt-get install -y chromium)")

# Runs in the page once everything (images included) has loaded: marks each <img> by whether it decoded whole.
# A missing or undecodable image has no width; a cut-short PNG has its size but Chromium draws only its first
# rows, so its bottom row stays transparent, where the report's plots (white background) are opaque.
_MARK_IMAGES = """<script>
function decodedWhole(img) {
  if (!img.complete || img.naturalWidth === 0) return false;
  const canvas = document.createElement("canvas");
  canvas.width = img.naturalWidth;
  canvas.height = img.naturalHeight;
  const context = canvas.getContext("2d");
  context.drawImage(img, 0, 0);
  const row = context.getImageData(0, img.naturalHeight - 1, img.naturalWidth, 1).data;
  return row.every((value, i) => i % 4 !== 3 || value === 255);
}
window.addEventListener("load", () => {
  for (const img of document.images) img.dataset.loaded = decodedWhole(img) ? "yes" : "no";
  document.body.dataset.checked = "yes";
});
</script>"""

MB = 2**20


class _Images(HTMLParser):
    """The <img> tags of a page (alt, data-loaded) and whether the marking script ran."""

    def __init__(self) -> None:
        super().__init__()
        self.images: dict[str, str] = {}
        self.checked = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if tag == "img":
            self.images[attrs.get("alt", "")] = attrs.get("data-loaded", "not marked")
        if tag == "body":
            self.checked = attrs.get("data-checked") == "yes"


def images_in_browser(page: Path, tmp_path: Path) -> dict[str, str]:
    """Open a copy of `page` with the marking script in headless Chromium; each image's alt → "yes" if it loaded."""
    probe = tmp_path / f"probe-{page.name}"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _MARK_IMAGES + "</body>"), encoding="utf-8")
    done = subprocess.run([_BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
                           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
                           probe.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = _Images()
    parsed.feed(done.stdout)
    assert parsed.checked, f"the page's load event never ran in Chromium: {done.stderr[-2000:]}"
    return parsed.images


def write_synthetic_run(root: Path, steps: int = 6, world: int = 2) -> Path:
    """A run directory in the recorder's format, every optional key present."""
    (root / "metrics").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"sharded_data_parallel_degree": world}))
    (root / "launch-node0.json").write_text(json.dumps({
        "nnodes": 1, "nproc_per_node": world, "node_rank": 0, "world_size": world, "ranks": list(range(world)),
        "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": world, "tp": 1}, "started": "2026-01-01T00:00:00+0000",
        "exit_code": 0, "seconds": 12.5}))
    with open(root / "metrics/global.jsonl", "w") as out:
        for step in range(steps):
            parts = {"forward_s": 0.02, "backward_s": 0.04, "optimizer_s": 0.01, "data_wait_s": 0.005,
                     "exposed_comm_s": 0.01, "other_s": 0.005}
            out.write(json.dumps({
                "step": step, "time": 1.7e9 + step, "loss": 2.0 / (1 + step), "step_time_s": sum(parts.values()),
                "samples": 8, "samples_per_s": 8 / sum(parts.values()), "tokens_per_s": 128 / sum(parts.values()),
                "lr": 1e-3, "grad_norm": 1.0 / (1 + step), "loss_scale": None, "skipped_steps": 0, "breakdown": parts,
                "flops_per_step": 1e9, "tflops_per_s": 0.01, "mfu": None}) + "\n")
    for rank in range(world):
        with open(root / f"metrics/rank{rank}.jsonl", "w") as out:
            for step in range(steps):
                gather = {"collective": "all_gather", "group": "dp_shard", "count": 4, "bytes": 8 * MB,
                          "time_s": 0.004, "algbw_gbps": 2.0, "busbw_gbps": 1.0}
                scatter = {"collective": "reduce_scatter", "group": "dp_shard", "count": 2, "bytes": 4 * MB,
                           "time_s": 0.002, "algbw_gbps": 2.0 + rank, "busbw_gbps": 1.0}  # every other step
                out.write(json.dumps({"step": step, "rank": rank, "memory": {
                    "parameters_bytes": (4 + rank) * MB, "gradients_bytes": 4 * MB, "optimizer_state_bytes": 8 * MB,
                    "device_peak_bytes": 20 * MB, "device_allocated_bytes": 16 * MB,
                    "host_rss_bytes": (300 + step) * MB},
                    "comms": [gather, scatter] if step % 2 == 0 else [gather]}) + "\n")
    return root


ALL_PLOTS = {"loss", "step time and its breakdown", "throughput", "memory per rank by category",
             "bytes per process group"}

# A tiny language model (token batches, so tokens/s is recorded too) trained for STEPS steps.
TRAIN_SCRIPT = """
import torch
import shardwise as sw

sw.init()
torch.manual_seed(0)
model = sw.DistributedModel(torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)))
optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


@sw.step
def train_step(model, tokens):
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    model.backward(loss)
    return loss


tokens = torch.randint(0, 32, ({steps} * 4 * sw.dp_size(), 9))
for (batch,) in sw.data_loader(torch.utils.data.TensorDataset(tokens), batch_size=4, shuffle=False):
    optimizer.zero_grad()
    train_step(model, batch).reduce_mean()
    optimizer.step()
"""
STEPS = 4
PARAMETERS = 32 * 16 + 16 * 32 + 32


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """The run directory of `shardwise run` of TRAIN_SCRIPT on 2 ranks (DDP) with every metric recorded."""
    root = tmp_path_factory.mktemp("real")
    script = root / "train.py"
    script.write_text(TRAIN_SCRIPT.format(steps=STEPS))
    run = root / "run"
    assert main(["run", "--nproc-per-node", "2", "--set", "wall_clock_breakdown=true", "--set", "comms_logger=true",
                 "--run-dir", str(run), str(script)]) == 0
    assert main(["report", str(run)]) == 0
    return run


def test_report_of_a_real_run_has_every_plot_and_its_numbers(real_run):
    html = unescape((real_run / "report.html").read_text())
    assert set(_alts(html)) == ALL_PLOTS
    assert f"steps recorded</th><td>{STEPS} (steps 1–{STEPS})" in html
    assert "layout: pp=1 × dp_replicate=2 × dp_shard=1 × tp=1" in html
    assert "data parallel: DDP" in html
    all_reduce = next(t for t in read_run(real_run).comms() if t.collective == "all_reduce")
    assert (all_reduce.group, all_reduce.count, all_reduce.bytes) == ("dp", 1, 4 * PARAMETERS)  # DDP's one bucket


@needs_browser
def test_report_plots_load_in_chromium(real_run, tmp_path):
    assert images_in_browser(real_run / "report.html", tmp_path) == {title: "yes" for title in ALL_PLOTS}


@needs_browser
def test_browser_check_fails_on_a_missing_or_broken_png(real_run, tmp_path):
    """The check above can fail: an image whose file is missing, or whose PNG is cut short, is not loaded."""
    html = (real_run / "report.html").read_text()
    first, second = html.split('src="data:image/png;base64,')[1:3]
    html = html.replace(first[:first.index('"')], first[:200])  # the loss PNG cut short
    html = html.replace("data:image/png;base64," + second[:second.index('"')], "step_time.png")  # no such file
    page = tmp_path / "broken.html"
    page.write_text(html)
    found = images_in_browser(page, tmp_path)
    assert found == {**{title: "yes" for title in ALL_PLOTS}, "loss": "no", "step time and its breakdown": "no"}


def test_memory_is_each_ranks_largest_and_comms_a_ranks_step(tmp_path):
    run = read_run(write_synthetic_run(tmp_path / "run", steps=6))
    memory = run.memory_by_rank()
    assert [memory[rank]["parameters_bytes"] for rank in (0, 1)] == [4 * MB, 5 * MB]
    assert memory[0]["host_rss_bytes"] == 305 * MB
    comms = run.comms()
    assert [(t.group, t.collective) for t in comms] == [("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")]
    assert [(t.count, t.bytes, t.time_s, t.algbw_gbps) for t in comms] == [
        pytest.approx((4, 8 * MB, 0.004, 2.0)), pytest.approx((1, 2 * MB, 0.001, 2.5))]


def test_run_without_metrics_is_one_line_naming_the_run_and_metrics_interval(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"shardwise report: {tmp_path / 'run'} has no metrics ({tmp_path / 'run' / 'metrics'}/global.jsonl, "
                   "rank<R>.jsonl); record them with the config key metrics_interval at 1 or more (the default) "
                   "under shardwise run, which writes them to <run dir>/metrics\n")


def test_partial_metrics_draw_what_was_recorded(tmp_path):
    """Only global metrics, no breakdown, a null loss, a step recorded twice (a restart), a last line cut short:
    the plots that can be drawn are, and the step's last record counts."""
    run = write_synthetic_run(tmp_path / "run")
    for rank_file in (run / "metrics").glob("rank*.jsonl"):
        rank_file.unlink()
    rows = [json.loads(line) for line in (run / "metrics/global.jsonl").read_text().splitlines()]
    for row in rows:
        del row["breakdown"], row["tokens_per_s"]
        row["loss"] = None if row["step"] == 0 else row["loss"]
    rows.append({**rows[-1], "loss": 0.125})
    (run / "metrics/global.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    (run / "config.json").unlink()
    assert main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()
    titles = set(_alts(html))
    assert titles == {"loss", "step time and its breakdown", "throughput"}
    assert ("Not recorded in this run (config key that records it):\nmemory per rank by category (metrics_interval), "
            "bytes per process group (comms_logger).") in html
    assert "steps recorded</th><td>6 (steps 0–5)" in html
    assert "last loss</th><td>0.125<" in html


def _alts(html: str) -> dict[str, str]:
    parsed = _Images()
    parsed.feed(html)
    return parsed.images
