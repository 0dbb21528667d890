"""Training llm_jax's default story model from scratch, in pipeline order: a recipe beside the library,
which it imports (the library never imports it).

``stories`` (the text) → ``data`` (sentencepiece tokenizer, padded rows) → ``loss`` (masked next-token
cross-entropy) → ``step`` (AdamW, jitted train and eval steps) → ``recipe`` (the shipped model's
settings, the training loop, the checkpoint) → ``model_card`` (its README). ``scripts/train_tiny.py``
runs it.
"""
