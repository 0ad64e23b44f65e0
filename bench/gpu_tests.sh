#!/usr/bin/env bash
# The GPU test suite on the device machine (no nox there), its compiles spread over the
# CPU cores: one line per test as it finishes in $OUT/gpu_tests.txt, each failure's
# report in $OUT/failures.txt as it happens (time limits cut runs before pytest's
# summary). Needs .whl installed (bench/fetch_wheels.sh). Extra arguments go to pytest;
# FILES picks test files (default: every tests/test_gpu_*.py).
# LIMIT (seconds) stops pytest itself, so the lists below are still written (runs 43-44
# cut this script from outside and lost them).
set -u
out=${OUT:-.}
PROBJAX_FAILURE_LOG="$out/failures.txt" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  timeout "${LIMIT:-3600}" python3 -m pytest --gpu -n "${WORKERS:-6}" -p no:benchmark -v -rfE \
  ${FILES:-tests/test_gpu_*.py} "$@" \
  > "$out/gpu_tests.txt" 2>&1
status=$?
grep -E "PASSED|FAILED|ERROR" "$out/gpu_tests.txt" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' \
  | sort -u > "$out/gpu_tests_by_name.txt"
exit $status
