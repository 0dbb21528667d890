"""Beam search against ``transformers``' ``generate(num_beams=..., do_sample=False)``: tokens and scores,
on a tiny random Llama (end tokens that do occur, several prompts in one batch) and on stories260K."""

import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.beams import BeamSearch, EarlyStopping
from tests.hf_models import save_tiny_llama

PROMPTS = [[1, 5, 17, 33, 8], [1, 40, 2, 9], [1, 77, 61, 12, 30, 3, 50]]
MAX_NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_beam")
    reference = save_tiny_llama(folder, seed=3)
    return llm_jax.load(folder), reference


def hf_beams(reference, prompt, *, eos, **settings):
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                 pad_token_id=eos, output_scores=True, return_dict_in_generate=True, **settings)
    return out.sequences[:, len(prompt):].numpy(), out.sequences_scores.numpy()


def assert_same_beams(results, reference_tokens, reference_scores, eos):
    assert len(results) == len(reference_tokens)
    for rank, (result, tokens, score) in enumerate(zip(results, reference_tokens, reference_scores)):
        n = len(result.output_ids)
        assert result.sample == rank
        assert result.output_ids == tokens[:n].tolist(), (rank, result.output_ids, tokens)
        assert (tokens[n:] == eos).all()  # transformers pads finished hypotheses with EOS
        np.testing.assert_allclose(result.score, score, atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_beams, early_stopping, length_penalty", [
    (2, False, 1.0),
    (4, True, 0.8),
    (4, "never", 1.5),
])
def test_tiny_llama_beams_equal_transformers(tiny, num_beams, early_stopping, length_penalty):
    model, reference = tiny
    # An end token that beams do produce, so hypotheses finish at different lengths.
    with torch.no_grad():
        free = reference.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=MAX_NEW, num_beams=4,
                                  eos_token_id=None, pad_token_id=0)
    eos = int(free[0, len(PROMPTS[0]) + 3])
    settings = dict(num_beams=num_beams, early_stopping=early_stopping, length_penalty=length_penalty,
                    num_return_sequences=num_beams)
    results = llm_jax.generate(model, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[eos], **settings)
    assert len(results) == len(PROMPTS) * num_beams
    finished_early = 0
    for p, prompt in enumerate(PROMPTS):
        mine = results[p * num_beams:(p + 1) * num_beams]
        tokens, scores = hf_beams(reference, prompt, eos=eos, **settings)
        assert_same_beams(mine, tokens, scores, eos)
        finished_early += sum(r.finish_reason == "eos" for r in mine)
    if length_penalty <= 1:  # a strong length bonus rightly prefers hypotheses that run to the budget
        assert finished_early >= 2, "no hypothesis ended at the end token; the test would not exercise finishing"


@pytest.mark.parametrize("num_beams", [2, 4])
def test_stories260k_beams_equal_transformers(stories260k_dir, num_beams):
    model = llm_jax.load(stories260k_dir / "stories260K.bin")
    reference = transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf").eval()
    prompt = model.tokenizer.encode("Once upon a time, there was a")
    results = llm_jax.generate(model, [prompt], max_new_tokens=24, num_beams=num_beams,
                               num_return_sequences=num_beams, ignore_eos=True)
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, num_beams=num_beams,
                                 num_return_sequences=num_beams, eos_token_id=None, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
    assert_same_beams(results, out.sequences[:, len(prompt):].numpy(), out.sequences_scores.numpy(), eos=0)
    assert results[0].text.startswith(" there") or len(results[0].text) > 20


def test_beam_settings_are_validated(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="num_return_sequences must be in"):
        BeamSearch(num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping must be"):
        EarlyStopping.parse("sometimes")
    with pytest.raises(ValueError, match="does not support sampling .*logprobs"):
        llm_jax.generate(model, PROMPTS[:1], num_beams=2, logprobs=1,
                         sampling=llm_jax.Sampling(temperature=1.0))
