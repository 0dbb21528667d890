#!/usr/bin/env python
"""Run a file of OpenAI batch requests offline: ``python scripts/run_batch.py -i in.jsonl -o out.jsonl``."""

import sys

from llm_jax.server.batch import entry

if __name__ == "__main__":
    sys.exit(entry())
