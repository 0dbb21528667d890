#!/usr/bin/env python
"""Generate text with llm_jax: ``python scripts/generate.py --model PATH --prompt "Once upon a time"``."""

import sys

from llm_jax.cli.generate import entry

if __name__ == "__main__":
    sys.exit(entry())
