"""The planner is pure: `import shardwise` and `shardwise plan` load no torch, so planning runs on a laptop.

The top-level package resolves its runtime exports (which need torch) on first use,
so a fresh interpreter that imports it, plans and prints JSON through the CLI must
end with no `torch` module loaded, let alone `torch.distributed`.
"""

import subprocess
import sys

SCRIPT = """
import contextlib, io, sys
import shardwise
from shardwise.cli import main
from shardwise.planner import cluster_preset, plan, resolve_model, to_json
to_json(plan(resolve_model("gpt2-60b"), cluster_preset("32xp4d.24xlarge"), global_batch=896))
with contextlib.redirect_stdout(io.StringIO()):
    main(["plan", "--model", "vit-630m", "--cluster", "8xg4dn.12xlarge", "--json"])
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_planning_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
