#!/usr/bin/env bash
# The device check: on a machine with a CUDA GPU and no package index, install shardwise beside the machine's own
# torch (never touching it), run the CUDA tier of the suite, then bench/gpu_check.py's ~1B Llama benchmark.
# Needs the wheels bench/gpu_wheels.sh downloads into .gpu_wheels/. Writes into RESULTS: env.txt (GPU, driver,
# torch), cuda_tier.log and cuda_tier.xml (pytest -m cuda), bench.log, gpu_check.json and gpu_check.md.
# Sized for under 8 minutes on one H200 (each part has its own time limit). DEVELOPERS.md says how to run it.
# Usage, from the repository root: bash bench/gpu_check.sh RESULTS [TEST_FILE ...]
# (test files: the tier's part to run, e.g. to rerun what failed; all of tests/test_cuda_*.py by default)
set -uo pipefail
RESULTS=${1:?usage: bash bench/gpu_check.sh RESULTS [TEST_FILE ...]}
shift
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/test_cuda_*.py)
cd "$(dirname "$0")/.."
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

# What the machine lacks, as wheels; shardwise itself from this tree without its dependencies (torch stays).
SITE=/tmp/shardwise-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .gpu_wheels/*.whl || { echo "gpu_check: the wheels did not install (run bench/gpu_wheels.sh first)"; exit 2; }
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "gpu_check: editable install refused; shardwise runs from src/ through PYTHONPATH" >&2

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  python3 -c "import sys, torch, transformers, pydantic, shardwise
print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda,
      '| transformers', transformers.__version__, '| pydantic', pydantic.VERSION, '| shardwise', shardwise.__file__)"
} > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

status=0
# A line per test as it ends, and (where pytest-timeout is installed) a hung test stopped alone, so a tier cut
# short by its limit still says which tests ran and which one hung.
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
timeout 300 python3 -m pytest -v -m cuda -rfEsP -p no:cacheprovider --durations=15 "${per_test[@]}" \
    --junitxml="$RESULTS/cuda_tier.xml" "${TESTS[@]}" > "$RESULTS/cuda_tier.log" 2>&1 || status=1
timeout 160 python3 bench/gpu_check.py "$RESULTS" > "$RESULTS/bench.log" 2>&1 || status=1

echo "== CUDA tier (full log: cuda_tier.log) =="
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" "$RESULTS/cuda_tier.log" | tail -n 40
echo "== benchmark (full log: bench.log) =="
if [ -s "$RESULTS/gpu_check.md" ]; then cat "$RESULTS/gpu_check.md"; else tail -n 30 "$RESULTS/bench.log"; fi
exit $status
