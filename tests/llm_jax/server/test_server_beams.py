"""vLLM's ``use_beam_search`` through the ``openai`` client: each prompt's n best beams are those of
``transformers``' own beam search (``generate(num_beams=n, num_return_sequences=n, do_sample=False)`` on
stories260K's Hugging Face copy), whole and streamed, for completions and chat; what a beam search cannot
do is refused by name."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers
from server_process import MODEL_NAME

import llm_jax

PROMPTS = ["Once upon a time", "The little dog ran"]


@pytest.fixture(scope="module")
def hf_beams(stories260k_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval()

    def beams(ids: list[int], n: int, max_new_tokens: int, **kwargs) -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                                 num_beams=n, num_return_sequences=n, do_sample=False, max_new_tokens=max_new_tokens,
                                 **kwargs)
        return [[t for t in row[len(ids):].tolist() if t != model.generation_config.pad_token_id] for row in out]

    return beams


def _text(tokenizer, prompt_ids: list[int], output: list[int]) -> str:
    """The text ``output`` adds after the prompt, without its end-of-sequence token."""
    ids = [t for t in output if t not in (2,)]
    return tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):]


def test_completions_return_transformers_beams(client, stories, hf_beams):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, n=3, max_tokens=20,
                                         extra_body={"use_beam_search": True, "length_penalty": 0.8})
    assert [c.index for c in response.choices] == list(range(6))
    tokens = 0
    for p, prompt in enumerate(PROMPTS):
        ids = stories.tokenizer.encode(prompt)
        beams = hf_beams(ids, 3, 20, length_penalty=0.8)
        assert [c.text for c in response.choices[3 * p:3 * p + 3]] == [_text(stories.tokenizer, ids, b) for b in beams]
        tokens += sum(map(len, beams))
    assert response.usage.completion_tokens == tokens
    assert all(c.finish_reason in ("stop", "length") for c in response.choices)


def test_streamed_and_chat_beams(client, stories):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], n=2, max_tokens=16, extra_body={"use_beam_search": True})
    whole = [c.text for c in client.completions.create(**kwargs).choices]
    pieces = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
    assert [pieces[i] for i in range(2)] == whole
    expected = [r.text for r in llm_jax.generate(stories, [PROMPTS[0]], max_new_tokens=16, num_beams=2,
                                                  num_return_sequences=2)]
    assert whole == expected
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=8, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
])
def test_what_beams_cannot_do_is_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=extra)
    assert error.value.body["param"] == param, error.value.body
