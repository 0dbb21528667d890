#!/usr/bin/env python
"""Convert a model to an llm_jax checkpoint: ``python scripts/convert.py SOURCE checkpoints/NAME --dtype bfloat16``."""

import sys

from llm_jax.cli.convert import entry

if __name__ == "__main__":
    sys.exit(entry())
