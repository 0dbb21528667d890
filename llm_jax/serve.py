"""``python -m llm_jax.serve``: the OpenAI-compatible HTTP server (:mod:`llm_jax.server`); ``--help`` lists
its flags."""

import sys

from llm_jax.server.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
