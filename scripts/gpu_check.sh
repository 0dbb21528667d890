#!/usr/bin/env bash
# Every GPU check in one go, one table at the end: see scripts/gpu_check.py and docs/benchmarks.md ("On a GPU").
#
#   scripts/gpu_check.sh              # on a GPU machine (well under 10 minutes on an H200)
#   scripts/gpu_check.sh --dry-run    # anywhere, on the CPU, in under a minute
#
# Writes the table as JSON to $OUT/gpu_check.json when OUT is set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The checks run in three processes (the tests, the CPU reference, the rest) one after another;
# none may take three quarters of the GPU's memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
