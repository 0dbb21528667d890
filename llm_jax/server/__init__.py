"""An OpenAI-compatible HTTP server over the serving engine (:mod:`llm_jax.serving`).

The stages of one request, in order: ``fields`` reads the JSON body strictly and ``protocol`` checks it
field by field into a typed request (or an :class:`~llm_jax.server.fields.ApiError` naming the field);
``service`` tokenizes it, checks it against the context and admits it (or answers 503 when full);
``choices`` runs its choices on the :class:`~llm_jax.serving.async_engine.AsyncEngine` and merges their
outputs; ``responses`` shapes them into OpenAI objects, whole or as Server-Sent Events sent by ``sse``,
which aborts the request the moment its client leaves. ``app`` holds the routes and the lifespan,
``metrics`` the Prometheus metrics, ``cli`` the flags and the start-up (load, build the engine, compile its
programs, then listen).

Start it with ``python -m llm_jax.serve`` or ``scripts/serve.py``. ``cli`` imports neither JAX nor the
engine until the flags are checked, so ``--help`` answers at once.
"""
