"""The benchmark harness behind ``scripts/benchmark.py``: beside the library, which it imports (the
library never imports it). ``cli`` is the command line.

``shapes`` (named model shapes) → ``machine`` (measured bandwidth, peak memory) → ``llm_jax_engine`` and
``hf_engine`` and ``llama_cpp`` (the same workload on each engine) → ``roofline`` (bytes per decode step) → ``results``
(median/min/max rows, table, JSON); ``suite`` runs the matrix, ``compile_study`` the compile-time checks,
``step_profile`` traces a decode chunk to say where a step's time goes, ``product_study`` times a layer's
matrix products alone.
"""
