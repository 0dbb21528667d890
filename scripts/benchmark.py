#!/usr/bin/env python
"""Benchmark llm_jax: ``python scripts/benchmark.py --model 110M --dtype float32 bfloat16 --compare hf``."""

import sys

from llm_jax.cli.benchmark import entry

if __name__ == "__main__":
    sys.exit(entry())
