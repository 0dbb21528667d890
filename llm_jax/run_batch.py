"""``python -m llm_jax.run_batch``: OpenAI batch files run offline on the serving engine
(:mod:`llm_jax.server.batch`); ``--help`` lists its flags."""

import sys

from llm_jax.server.batch import entry

if __name__ == "__main__":
    sys.exit(entry())
