"""The planner against published, measured training runs: prints docs/planner.md's table.

    python bench/planner_published.py [RUNS.yaml]

Each run of tests/planner_published_runs.yaml (its source and its mapping to a shardwise config beside it) is
predicted through `shardwise.planner.evaluate`; the table gives the measured and predicted tokens/s per device,
the error, both MFUs (6N + 12·l·h·s FLOPs per token, against the data sheet's peak) and whether it fits.
"""

import sys
from pathlib import Path

import yaml

from shardwise.planner.published import summarize

if __name__ == "__main__":
    default = Path(__file__).parents[1] / "tests" / "planner_published_runs.yaml"
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    print(summarize(yaml.safe_load(path.read_text())).table())
