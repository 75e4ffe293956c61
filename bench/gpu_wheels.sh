#!/usr/bin/env bash
# Downloads, on a machine with a package index, the wheels bench/gpu_check.sh installs on an accelerator machine
# that has none: what shardwise needs beyond that machine's own packages (Python 3.12, x86-64; torch,
# transformers, accelerate, rich, psutil, safetensors and pytest are there already), at the versions the suite
# runs with here. Into .gpu_wheels/ (ignored by git; name it among the files that travel with the check).
# Run from the repository root: bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0)
rm -rf .gpu_wheels && mkdir .gpu_wheels
# pip matches each manylinux tag exactly: list the ones the wheels above are published for.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .gpu_wheels "${WHEELS[@]}"
ls -l .gpu_wheels
