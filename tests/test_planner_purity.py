"""The planner is pure: planning loads neither torch nor torch.distributed, so it runs on a laptop.

The top-level `shardwise` package exports the runtime (which needs torch), so the
subprocess registers a bare `shardwise` package first and checks what the planner,
config, topology and the `plan` command themselves pull in.
"""

import subprocess
import sys

SCRIPT = """
import importlib.util, sys, types
package = types.ModuleType("shardwise")
package.__path__ = list(importlib.util.find_spec("shardwise").submodule_search_locations)
sys.modules["shardwise"] = package
import shardwise.cli.plan
from shardwise.planner import cluster_preset, plan, resolve_model, to_json
to_json(plan(resolve_model("gpt2-60b"), cluster_preset("32xp4d.24xlarge"), global_batch=896))
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_planning_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
