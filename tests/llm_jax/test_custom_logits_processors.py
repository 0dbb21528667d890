"""The caller's logits processors (``generate(logits_processors=[...])``) against ``transformers``' generate
with the same rule written as a torch ``LogitsProcessor``: greedy tokens identical, over prompts of
different lengths in one batch, also when each prompt sets the processor's argument
(``llm_jax.LogitsProcessor``, ``processor_args``); sampled tokens obey a processor that allows only some
tokens."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch
import transformers

import llm_jax
from llm_jax.decoding import PAD_ID

PROMPTS = ["Once upon a time", "The little dog ran to the park and saw a big red ball"]
NEW_TOKENS = 24


def green_list(scores_BV, tokens_BS, lengths_B):
    """A watermark's rule (Kirchenbauer et al.): +4 to the tokens the last token makes "green"."""
    last_B = jnp.take_along_axis(tokens_BS, (lengths_B - 1)[:, None], axis=1)
    green_BV = (last_B * 31 + jnp.arange(scores_BV.shape[1])[None, :]) % 4 == 0
    return scores_BV + 4.0 * green_BV


class TorchGreenList(transformers.LogitsProcessor):
    def __init__(self, delta: float = 4.0):
        self.delta = delta

    def __call__(self, input_ids, scores):
        green = (input_ids[:, -1:] * 31 + torch.arange(scores.shape[1])[None, :]) % 4 == 0
        return scores + self.delta * green


def green_delta(scores_BV, tokens_BS, lengths_B, args):
    """``green_list``'s rule with each row's own strength, ``args["delta"]`` [B] (0: the rule off)."""
    last_B = jnp.take_along_axis(tokens_BS, (lengths_B - 1)[:, None], axis=1)
    green_BV = (last_B * 31 + jnp.arange(scores_BV.shape[1])[None, :]) % 4 == 0
    return scores_BV + args["delta"][:, None] * green_BV


WATERMARK = llm_jax.LogitsProcessor(green_delta, arguments={"delta": 0.0})


def no_token_twice(scores_BV, tokens_BS, lengths_B):
    """Every token of the prompt and output so far banned."""
    B, V = scores_BV.shape
    ids_BS = jnp.where(tokens_BS == PAD_ID, V, tokens_BS)
    seen_BV = jnp.zeros((B, V + 1), bool).at[jnp.arange(B)[:, None], ids_BS].set(True)[:, :V]
    return jnp.where(seen_BV, -jnp.inf, scores_BV)


class TorchNoTokenTwice(transformers.LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids, -float("inf"))


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    return (transformers.AutoModelForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf"))


@pytest.mark.parametrize("ours,theirs", [([green_list], [TorchGreenList()]),
                                         ([green_list, no_token_twice], [TorchGreenList(), TorchNoTokenTwice()])])
def test_greedy_tokens_equal_transformers_with_the_same_processors(stories260k_dir, reference, ours, theirs):
    torch_model, tokenizer = reference
    model = llm_jax.load(stories260k_dir / "hf")
    results = llm_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logits_processors=ours)
    plain = llm_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, result, unprocessed in zip(PROMPTS, results, plain):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       logits_processor=transformers.LogitsProcessorList(theirs))
        assert result.output_ids == out[0, ids.shape[1]:].tolist()
        assert result.output_ids != unprocessed.output_ids  # the processor changes the output
    if len(ours) == 2:
        for prompt, result in zip(PROMPTS, results):
            out = result.output_ids
            assert len(out) == len(set(out)) and not set(out) & set(tokenizer(prompt)["input_ids"])


def test_each_prompt_sets_the_processors_arguments(stories260k_dir, reference):
    torch_model, tokenizer = reference
    model = llm_jax.load(stories260k_dir / "hf")
    results = llm_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                               logits_processors=[WATERMARK], processor_args=[{"delta": 4.0}, None])
    for prompt, result, delta in zip(PROMPTS, results, (4.0, 0.0)):  # None: the default, 0
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = torch_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       logits_processor=transformers.LogitsProcessorList([TorchGreenList(delta)]))
        assert result.output_ids == out[0, ids.shape[1]:].tolist(), delta
    every = llm_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                             logits_processors=[WATERMARK], processor_args={"delta": 4.0})
    assert every[0].output_ids == results[0].output_ids and every[1].output_ids != results[1].output_ids


def test_processor_arguments_are_checked(stories):
    def run(**kwargs):
        return llm_jax.generate(stories, PROMPTS, max_new_tokens=2, **kwargs)

    with pytest.raises(ValueError, match=r"names 'strength', which no logits processor reads \(they read \['delta'"):
        run(logits_processors=[WATERMARK], processor_args={"strength": 1.0})
    with pytest.raises(ValueError, match=r"names 'delta', which no logits processor reads$"):
        run(logits_processors=[green_list], processor_args={"delta": 1.0})
    with pytest.raises(ValueError, match=r"processor_args\['delta'\] must be a finite number, got nan"):
        run(logits_processors=[WATERMARK], processor_args={"delta": float("nan")})
    with pytest.raises(ValueError, match="processor_args has 3 entries for 2 prompts"):
        run(logits_processors=[WATERMARK], processor_args=[None, None, None])
    with pytest.raises(ValueError, match="give argument 'delta' two defaults: 0.0 and 1.0"):
        run(logits_processors=[WATERMARK, llm_jax.LogitsProcessor(green_delta, arguments={"delta": 1.0})])
    with pytest.raises(ValueError, match="argument names must be identifiers, got 'a b'"):
        llm_jax.LogitsProcessor(green_delta, arguments={"a b": 1.0})
    with pytest.raises(ValueError, match="default of logits processor argument 'delta' must be a finite number"):
        llm_jax.LogitsProcessor(green_delta, arguments={"delta": "4"})
    with pytest.raises(TypeError, match="must be callable"):
        llm_jax.LogitsProcessor(4, arguments={})


def even_only(scores_BV, tokens_BS, lengths_B):
    return jnp.where(jnp.arange(scores_BV.shape[1]) % 2 == 0, scores_BV, -jnp.inf)


def test_sampled_tokens_obey_the_processor(stories):
    sampling = llm_jax.Sampling(temperature=1.5, seed=7)
    results = llm_jax.generate(stories, PROMPTS, max_new_tokens=32, ignore_eos=True, sampling=sampling, n=2,
                               logits_processors=[even_only], logprobs=2)
    for result in results:
        assert all(t % 2 == 0 for t in result.output_ids), result.output_ids
        assert all(t % 2 == 0 for top in result.top_logprobs for t in top)  # after the processors
    again = llm_jax.generate(stories, PROMPTS, max_new_tokens=32, ignore_eos=True, sampling=sampling, n=2,
                             logits_processors=[even_only], logprobs=2)
    assert [r.output_ids for r in again] == [r.output_ids for r in results]


class Unhashable:
    __hash__ = None

    def __call__(self, scores_BV, tokens_BS, lengths_B):
        return scores_BV


def test_bad_processors_are_refused(stories):
    with pytest.raises(TypeError, match="not callable"):
        llm_jax.generate(stories, PROMPTS, max_new_tokens=2, logits_processors=[3])
    with pytest.raises(TypeError, match="not hashable"):
        llm_jax.generate(stories, PROMPTS, max_new_tokens=2, logits_processors=[Unhashable()])
    with pytest.raises(ValueError, match="do not combine with speculative decoding"):
        llm_jax.generate(stories, PROMPTS, max_new_tokens=2, logits_processors=[even_only],
                         speculative=llm_jax.Speculative(method="ngram", num_tokens=2))
    with pytest.raises(ValueError, match="do not combine with beam search"):
        llm_jax.generate(stories, PROMPTS, max_new_tokens=2, logits_processors=[even_only], num_beams=2)
