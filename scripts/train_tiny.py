#!/usr/bin/env python
"""Train llm_jax's default story model from scratch: ``python scripts/train_tiny.py [--steps N] [--out DIR]``."""

import sys

from llm_jax.cli.train_tiny import entry

if __name__ == "__main__":
    sys.exit(entry())
