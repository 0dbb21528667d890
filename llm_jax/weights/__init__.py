"""The weight path: source formats → our params layout → llm_jax checkpoints.

- ``sources``: which format a path holds (llm_jax checkpoint, Hugging Face folder, llama2.c ``.bin``),
  and what travels with it (config, tokenizer files, EOS / stop ids).
- ``hf_config`` → ``from_hf`` (over ``safetensors_file``) and ``from_llama2c``: each format's tensors,
  described as ``layout.TensorSpec`` s and assembled one tensor at a time by ``layout.assemble``.
- ``from_gguf`` reads llama.cpp's GGUF files; ``to_gguf`` writes a Llama (Mixtral), Qwen3-MoE or Gemma 3
  model's float params as one.
- ``checkpoint``: our format (orbax params, versioned JSON, per-tensor ``checksum`` s), restored straight
  into a dtype and a ``placement`` (sharding); ``convert`` writes one from a source.
"""
