"""vLLM's ``prompt_logprobs`` on /v1/completions (each choice's) and /v1/chat/completions (the response's),
as the official ``openai`` client sees it (an extra field, sent in ``extra_body``): None for the prompt's
first token, then ``{token id: {logprob, rank, decoded_token}}`` for the token and its top alternatives,
held to ``transformers`` on the same weights (stories260K's Hugging Face copy) within 1e-4; streams refuse
it (as vLLM's); bad values are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from server_process import MODEL_NAME

import llm_jax

ATOL = 1e-4
MAX_LOGPROBS = 20  # the server's --max-logprobs (its default)
TEXT = "Once upon a time, there was a little girl named Lily."
UNLIKELY = [1, 300, 17, 450, 200, 33, 400, 101]  # token ids in no likely order: ranks past the top 20


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return llm_jax.load(model_path).tokenizer


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(stories260k_dir / "hf", dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> np.ndarray:
        """[len(ids), V]: row i is the distribution of token i + 1 given tokens 0..i."""
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1).numpy()

    return logprobs


def _ranks(row: np.ndarray, logprob: float) -> tuple[int, int]:
    """The ranks a token of ``logprob`` may have within the tolerance: 1 + the tokens surely above it, and
    1 + those that may be."""
    return 1 + int(np.sum(row > logprob + ATOL)), 1 + int(np.sum(row > logprob - ATOL))


def check_prompt_logprobs(scores, ids: list[int], rows: np.ndarray, k: int, tokenizer) -> None:
    """``scores`` (the response's prompt_logprobs, k alternatives) against the reference ``rows``."""
    assert len(scores) == len(ids) and scores[0] is None
    for i in range(1, len(ids)):
        row, entry, token = rows[i - 1], scores[i], str(ids[i])
        assert next(iter(entry)) == token  # the prompt's token first, as vLLM's
        mine = entry[token]
        np.testing.assert_allclose(mine["logprob"], row[ids[i]], atol=ATOL, rtol=0)
        low, high = _ranks(row, row[ids[i]])
        assert low <= mine["rank"] <= high, (i, mine, low, high)
        context = ids[max(i - 4, 0):i]
        assert mine["decoded_token"] == tokenizer.decode([*context, ids[i]])[len(tokenizer.decode(context)):]
        # The top k follow; the token is one of them, or an entry more.
        assert len(entry) in (k, k + 1)
        alternatives = {int(t): v for t, v in list(entry.items())[len(entry) - k:]}
        top = np.sort(row)[::-1][:k]
        np.testing.assert_allclose(sorted((v["logprob"] for v in alternatives.values()), reverse=True), top,
                                   atol=ATOL, rtol=0)
        for t, v in alternatives.items():
            np.testing.assert_allclose(v["logprob"], row[t], atol=ATOL, rtol=0)
            low, high = _ranks(row, row[t])
            assert low <= v["rank"] <= high, (i, t, v, low, high)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs_are_transformers(client, tokenizer, reference, k):
    ids = tokenizer.encode(TEXT)
    response = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": k})
    (choice,) = response.choices
    assert response.usage.prompt_tokens == len(ids)
    check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, reference(ids), k, tokenizer)
    assert choice.logprobs is None and choice.text  # asked for nothing else


def test_ranks_past_the_top_are_exact(client, tokenizer, reference):
    """A prompt of unlikely tokens: ranks far past the top alternatives are exact too."""
    response = client.completions.create(model=MODEL_NAME, prompt=UNLIKELY, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    scores = response.choices[0].model_extra["prompt_logprobs"]
    rows = reference(UNLIKELY)
    check_prompt_logprobs(scores, UNLIKELY, rows, 2, tokenizer)
    assert any(scores[i][str(UNLIKELY[i])]["rank"] > MAX_LOGPROBS for i in range(1, len(UNLIKELY)))


def test_each_choice_has_its_prompts(client, tokenizer, reference):
    prompts = [TEXT, "The dog ran"]
    response = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 1})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        ids = tokenizer.encode(prompts[choice.index // 2])
        check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, reference(ids), 1, tokenizer)


def test_echo_with_logprobs_reports_them_too(client, tokenizer, reference):
    """As vLLM's: an echo with logprobs=2 gives prompt_logprobs with 2 alternatives, which agree with the
    echoed tokens' log-probabilities; prompt_logprobs given beside it sets its own count."""
    ids = tokenizer.encode(TEXT)
    response = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2, temperature=0, echo=True,
                                         logprobs=2)
    (choice,) = response.choices
    scores = choice.model_extra["prompt_logprobs"]
    check_prompt_logprobs(scores, ids, reference(ids), 2, tokenizer)
    echoed = choice.logprobs.token_logprobs[:len(ids)]
    assert echoed[0] is None
    assert echoed[1:] == [scores[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:len(ids)])
    both = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2, temperature=0, echo=True,
                                     logprobs=1, extra_body={"prompt_logprobs": 4})
    check_prompt_logprobs(both.choices[0].model_extra["prompt_logprobs"], ids, reference(ids), 4, tokenizer)
    assert all(len(top) in (1, 2) for top in both.choices[0].logprobs.top_logprobs[1:])


def test_chat_prompt_logprobs_are_transformers(client, http, tokenizer, reference):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    ids = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["tokens"]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
                                              n=2, extra_body={"prompt_logprobs": 2})
    assert response.usage.prompt_tokens == len(ids)
    check_prompt_logprobs(response.model_extra["prompt_logprobs"], ids, reference(ids), 2, tokenizer)


def test_absent_unless_asked(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=2, temperature=0)
    assert completion.choices[0].model_extra["prompt_logprobs"] is None
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0)
    assert chat.model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": TEXT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_streams_refuse_them_but_zero(http, path, body):
    """As vLLM's: a stream cannot carry prompt log-probabilities; 0 asks for none, and streams."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "stream": True, **body}
    refused = http.post(path, json={**body, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", refused.text
    streamed = http.post(path, json={**body, "prompt_logprobs": 0})
    assert streamed.status_code == 200 and "prompt_logprobs" not in streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": TEXT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, "2", 1.5, True, [1]])
def test_bad_values_are_refused_by_name(http, path, body, value):
    response = http.post(path, json={"model": MODEL_NAME, "max_tokens": 2, "prompt_logprobs": value, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt_logprobs", response.text
