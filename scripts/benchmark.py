#!/usr/bin/env python
"""Benchmark llm_jax: ``python scripts/benchmark.py --model 110M --dtype float32 bfloat16 --compare hf``.

The harness is the ``benchmarking`` package beside this file (Python puts this folder on ``sys.path``).
"""

import sys

from benchmarking.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
