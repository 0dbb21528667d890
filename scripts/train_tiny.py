#!/usr/bin/env python
"""Train llm_jax's default story model from scratch: ``python scripts/train_tiny.py [--steps N] [--out DIR]``.

The recipe is the ``training`` package beside this file (Python puts this folder on ``sys.path``).
"""

import sys

from training.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
