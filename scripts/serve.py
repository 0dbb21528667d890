#!/usr/bin/env python
"""Serve a model over HTTP with an OpenAI-compatible API: ``python scripts/serve.py --model PATH``."""

import sys

from llm_jax.server.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
