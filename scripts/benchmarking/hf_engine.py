"""The same workload on Hugging Face ``transformers`` (torch, CPU): the engine users would otherwise pick.

Greedy decoding with the model's own KV cache, one forward call per token — what ``generate`` does,
minus its logits processors and stopping criteria, so the comparison is, if anything, kind to it.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

from llm_jax.config import ModelConfig

from benchmarking.llm_jax_engine import EagerEngine, Run, Workload, runner_up


def hf_config(config: ModelConfig):
    """The ``transformers.LlamaConfig`` of a Llama-shaped llm_jax config."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        rope_parameters=dict(rope_type="default", rope_theta=config.rope_theta),
        tie_word_embeddings=config.tie_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=None)


def save_random_hf_model(config: ModelConfig, folder: pathlib.Path, *, seed: int = 0) -> None:
    """A randomly initialised ``LlamaForCausalLM`` of ``config`` 's shape, saved (float32) to ``folder``,
    so that both engines run the very same weights (llm_jax loads it with its own converter)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(config))
    model.save_pretrained(folder)


def load_hf_model(folder: pathlib.Path, dtype: str, *, threads: int):
    """The causal LM saved in ``folder`` (``LlamaForCausalLM`` for the named shapes), in ``dtype`` ("float32"
    or "bfloat16"), for inference on ``threads`` torch threads."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()


class HfEngine(EagerEngine):
    name = "transformers"

    def __init__(self, folder: pathlib.Path, config: ModelConfig, workload: Workload, *, threads: int):
        import torch

        self.model = load_hf_model(folder, config.param_dtype, threads=threads)
        self.workload = workload
        self.prompts = torch.from_numpy(workload.prompts(config.vocab_size).astype(np.int64))

    def _generate(self, steps: int) -> Run:
        import torch

        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=self.prompts, use_cache=True, logits_to_keep=1)
            token_B = out.logits[:, -1].argmax(-1)
            tokens = [token_B.numpy().copy()]
            ttft = time.perf_counter() - t0
            # Each step's second choice is read from its logits as they come (keeping every step's logits
            # would hold steps × B × V floats); the time that takes is not the engine's, and is taken out.
            t_runner_up = time.perf_counter()
            runners_up = [runner_up(out.logits[:, -1].float().numpy())]
            untimed = time.perf_counter() - t_runner_up
            cache, step_s = out.cache, []
            for _ in range(steps):
                t_step = time.perf_counter()
                out = self.model(input_ids=token_B[:, None], cache=cache, use_cache=True)
                cache, token_B = out.cache, out.logits[:, -1].argmax(-1)
                tokens.append(token_B.numpy().copy())
                step_s.append(time.perf_counter() - t_step)
                t_runner_up = time.perf_counter()
                runners_up.append(runner_up(out.logits[:, -1].float().numpy()))
                untimed += time.perf_counter() - t_runner_up
            decode_s = time.perf_counter() - t0 - ttft - untimed
        tokens_BS = np.stack(tokens, axis=1)
        return Run(ttft_s=ttft, decode_s=decode_s, step_s=tuple(step_s), decode_tokens=tokens_BS[:, 1:].size,
                   tokens=tokens_BS, runner_up=np.stack([ids for ids, _ in runners_up], axis=1),
                   runner_up_gap=np.stack([gaps for _, gaps in runners_up], axis=1))

