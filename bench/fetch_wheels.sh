#!/usr/bin/env bash
# Wheels the GPU machine lacks, for Python 3.12, into .whl/ (git-ignored via
# .git/info/exclude): beartype for the GPU tests' jaxtyping hook, and tokamax with the
# dependencies its attention and ragged_dot import (its profiler, xprof, is stubbed by
# bench/harness.py), and pytest-xdist to spread the GPU tests' compiles over the CPU
# cores (with XLA_PYTHON_CLIENT_PREALLOCATE=false). Carry .whl and install with
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in beartype==0.23.1 tokamax==0.0.17 einshape==1.0 immutabledict==4.3.1 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions qwix==0.1.8 pytest-xdist==3.8.0 execnet==2.1.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls .whl
