"""The API as the official ``openai`` client sees it: completions and chat, whole and streamed, ``n``,
stops, log-probabilities, seeds, echo, token-id prompts, structured outputs, and the side endpoints.

Greedy completions are compared with ``llm_jax.generate`` on the same model; everything else with the
server's own answers (a streamed answer with the whole one, a repeated seeded call with the first).
"""

from __future__ import annotations

import json
import math
import re

import httpx
import pydantic
import pytest
import sentencepiece
from server_process import API_KEY, MODEL_NAME, UI_ORIGIN, metric

import llm_jax

PROMPTS = ["Once upon a time", "The dog ran"]
MAX_TOKENS = 24
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # generate's finish reasons in the API's words


@pytest.fixture(scope="module")
def model(model_path):
    return llm_jax.load(model_path)


@pytest.fixture(scope="module")
def expected(model):
    """generate's greedy result for each of PROMPTS, alone."""
    return {p: llm_jax.generate(model, [p], max_new_tokens=MAX_TOKENS)[0] for p in PROMPTS}


def _stream_text(stream, n: int = 1) -> tuple[list[str], list, list]:
    """Each choice's concatenated text, the chunks, and the finish reasons in order of arrival."""
    texts, chunks, finishes = [""] * n, [], []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] += piece
            if choice.finish_reason is not None:
                finishes.append((choice.index, choice.finish_reason))
    return texts, chunks, finishes


def test_greedy_completions_equal_generate(client, model, expected):
    for prompt in PROMPTS:
        result = expected[prompt]
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        (choice,) = response.choices
        assert choice.text == result.text
        assert choice.finish_reason == FINISH[result.finish_reason]
        assert response.usage.prompt_tokens == len(result.prompt_ids)
        assert response.usage.completion_tokens == len(result.output_ids)
        assert response.object == "text_completion" and response.model == MODEL_NAME


def test_token_id_prompts_and_prompt_lists(client, model, expected):
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == expected[PROMPTS[0]].text
    many = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, n=2)
    texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    assert texts == [expected[p].text for p in PROMPTS for _ in range(2)]  # choice i * n + j: prompt i, sample j
    strings = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(strings.choices, key=lambda c: c.index)] == [expected[p].text for p in PROMPTS]
    assert strings.usage.prompt_tokens == sum(len(i) for i in ids)


def test_streamed_completion_pieces_concatenate_to_the_whole_text(client):
    settings = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.8, seed=7, n=2)
    whole = client.completions.create(**settings)
    stream = client.completions.create(**settings, stream=True, stream_options={"include_usage": True})
    texts, chunks, finishes = _stream_text(stream, n=2)
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert len(chunks) > MAX_TOKENS // 2  # a chunk per token or so, not one at the end
    assert sorted(finishes) == [(c.index, c.finish_reason) for c in sorted(whole.choices, key=lambda c: c.index)]
    for index in range(2):  # the finish reason comes with a choice's last content chunk, and only there
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == index]
        assert reasons[-1] is not None and set(reasons[:-1]) == {None}
    *content, last = chunks
    assert last.choices == [] and last.usage == whole.usage  # the usage chunk comes last
    assert all(c.usage is None for c in content)


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me one."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=16,
                                           temperature=0)
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 16
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=16,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage == whole.usage and all(c.object == "chat.completion.chunk" for c in chunks)


def test_seeded_samples_are_reproducible_and_distinct(client, model):
    settings = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.5, n=3, seed=1234)
    first = [c.text for c in sorted(client.completions.create(**settings).choices, key=lambda c: c.index)]
    again = [c.text for c in sorted(client.completions.create(**settings).choices, key=lambda c: c.index)]
    assert first == again
    assert len(set(first)) > 1  # n samples of one seed differ (sample_index)
    samples = llm_jax.generate(model, [PROMPTS[0]], max_new_tokens=MAX_TOKENS, n=3,
                               sampling=llm_jax.Sampling(temperature=1.5, seed=1234))
    assert first == [r.text for r in samples]  # choice j draws as generate's sample j
    other = client.completions.create(**{**settings, "seed": 99})
    assert sorted(c.text for c in other.choices) != sorted(first)
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=1.5,
                seed=5)
    assert client.chat.completions.create(**chat).choices[0].message.content == \
        client.chat.completions.create(**chat).choices[0].message.content


def test_stop_strings_and_stop_token_ids(client, expected):
    result = expected[PROMPTS[0]]
    stop = result.text.split()[3]  # a word some way into the greedy text
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         stop=[stop, "never appears"])
    (choice,) = response.choices
    assert choice.text == result.text[:result.text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    for stream in (False, True):  # vLLM's include_stop_str_in_output: the text ends with the stop string
        included = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                             temperature=0, stop=[stop], stream=stream,
                                             extra_body={"include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in included) if stream else included.choices[0].text
        assert text == choice.text + stop
    stop_id = result.output_ids[5]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"stop_token_ids": [stop_id]})
    (choice,) = response.choices
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    assert response.usage.completion_tokens == result.output_ids.index(stop_id) + 1


def test_completion_logprobs(client, expected):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=3)
    (choice,) = response.choices
    lp = choice.logprobs
    assert choice.text == expected[PROMPTS[0]].text and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == response.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-5)  # greedy picks the most likely


def test_logprobs_of_filtered_tokens_are_finite(http):
    # top_k=1 leaves one token: the others' log-probabilities are -inf, which JSON cannot carry.
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 1.0, "top_k": 1, "logprobs": 3}
    for stream in (False, True):
        response = http.post("/v1/completions", json={**body, "stream": stream})
        assert response.status_code == 200 and "Infinity" not in response.text
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert all(-9999.0 <= lp <= 0 for step in logprobs["top_logprobs"] for lp in step.values())


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    (choice,) = response.choices
    content = choice.logprobs.content
    assert "".join(e.token for e in content) == choice.message.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-5)


def test_echo(client, expected):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                         echo=True)
    assert response.choices[0].text == PROMPTS[1] + expected[PROMPTS[1]].text
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                       echo=True, stream=True)
    assert _stream_text(stream)[0] == [response.choices[0].text]


def test_echo_with_logprobs_scores_the_prompt_as_generate_does(client, model, expected):
    prompt = PROMPTS[1]
    theirs = llm_jax.generate(model, [prompt], max_new_tokens=4, prompt_logprobs=2)[0]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
                                         echo=True, logprobs=2)
    (choice,) = response.choices
    lp, n = choice.logprobs, len(theirs.prompt_ids)
    assert choice.text == prompt + theirs.text
    assert len(lp.tokens) == n + response.usage.completion_tokens and response.usage.prompt_tokens == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for i in range(1, n):
        assert math.isclose(lp.token_logprobs[i], theirs.prompt_logprobs[i], abs_tol=1e-5)
        top = theirs.prompt_top_logprobs[i]
        assert len(lp.top_logprobs[i]) in (2, 3) and lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:2] == pytest.approx(sorted(top.values())[::-1][:2],
                                                                                      abs=1e-5)
    assert "".join(lp.tokens[n:]) == theirs.text
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       logprobs=2, stream=True)
    pieces = [c.choices[0].logprobs for c in stream if c.choices]
    streamed = [t for p in pieces if p is not None for t in p.token_logprobs]
    assert streamed == lp.token_logprobs


def test_browsers_from_the_allowed_origin(server):
    """--allowed-origins: a browser's preflight from that origin is answered (without the API key, which it
    cannot send), and the answers carry the origin; other origins get no CORS headers."""
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": UI_ORIGIN, **preflight}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == UI_ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight},
                          timeout=30)
    assert "access-control-allow-origin" not in other.headers
    answer = httpx.get(f"{server.url}/v1/models", headers={"Origin": UI_ORIGIN, "Authorization": f"Bearer {API_KEY}"},
                       timeout=30)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == UI_ORIGIN


def test_models_version_tokenize_detokenize(client, http, model, server, stories260k_dir):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    missing = http.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.url}/version").json()["version"]
    ids = model.tokenizer.encode(PROMPTS[0])
    tokenized = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPTS[0]}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"][0] == model.tokenizer.bos_id  # the template writes BOS; encoding adds none
    assert tokenized["token_strs"] is None
    pieces = http.post("/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()["token_strs"]
    reference = sentencepiece.SentencePieceProcessor(model_file=str(stories260k_dir / "tok512.model"))
    assert pieces == [reference.id_to_piece(i) for i in ids]


def test_metrics_cover_latencies_queues_cache_and_tokens(client, http):
    long_prompt = " ".join([PROMPTS[0]] * 6)  # over a block of 16 tokens: its first block is cached
    hits = metric(http, "llm_jax:prefix_cache_hits_total")
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=4, temperature=0)
    text = http.get("/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"llm_jax:{name}" in text
    assert metric(http, "llm_jax:generation_tokens_total") >= 4
    assert metric(http, "llm_jax:prefix_cache_hits_total") >= hits + 16  # the second request hit the first's block


def test_speculative_decoding_gives_generates_text_and_counts_proposals(client, http, model):
    prompt = "Keep repeating: " + " ".join(["One, two, three, four, five."] * 4)
    accepted = metric(http, "llm_jax:spec_decode_num_accepted_tokens_total")
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=64, temperature=0)
    assert answer.choices[0].text == llm_jax.generate(model, [prompt], max_new_tokens=64)[0].text
    assert metric(http, "llm_jax:spec_decode_num_accepted_tokens_total") >= accepted + 32
    drafts, proposed = (metric(http, f"llm_jax:spec_decode_num_{name}_total") for name in ("drafts", "draft_tokens"))
    assert 0 < drafts <= proposed <= 4 * drafts
    assert metric(http, "llm_jax:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0


def test_continuous_usage_stats(http):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [line[6:] for line in http.post("/v1/completions", json=body).text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    used = [json.loads(e)["usage"]["completion_tokens"] for e in events]
    assert used == sorted(used) and used[-1] == 8  # every chunk tells the tokens so far, the last chunk all


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=20)
    happy: bool


def test_structured_outputs(client):
    """OpenAI's response_format (a pydantic model through the client's own parse, and json_object), and
    vLLM's structured_outputs and guided_* fields: every answer is what its constraint asks, streamed as
    whole."""
    messages = [{"role": "user", "content": "Tell me about a pet."}]
    parsed = client.chat.completions.parse(model=MODEL_NAME, messages=messages, response_format=Pet,
                                           max_completion_tokens=60, temperature=0)
    (choice,) = parsed.choices
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
    loose = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=60, seed=3,
                                           response_format={"type": "json_object"}, n=2)
    assert all(isinstance(json.loads(c.message.content), dict) for c in loose.choices if c.finish_reason == "stop")
    choices = ["the cat", "the dog", "a big red bird"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                          extra_body=extra)
        assert whole.choices[0].text in choices and whole.choices[0].finish_reason == "stop"
        streamed, _, finishes = _stream_text(client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, extra_body=extra, stream=True))
        assert streamed == [whole.choices[0].text] and finishes == [(0, "stop")]
    pattern = r"(Tom|Sue) (saw|liked) a [a-z]{1,8}\."
    sampled = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=30, n=3, seed=1,
                                        extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) for c in sampled.choices), [c.text for c in sampled.choices]


def test_bad_words_and_typical_p(client, model, expected):
    """bad_words bans each word's tokens as vLLM does (here: as generate bans them); typical_p samples
    reproducibly with a seed."""
    prompt = PROMPTS[0]
    word = expected[prompt].text.split()[2]
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"bad_words": [word]})
    banned = llm_jax.Sampling(bad_words_ids=[model.tokenizer.encode(word, add_bos=False)])
    alone = llm_jax.generate(model, [prompt], max_new_tokens=MAX_TOKENS, sampling=banned)[0]
    assert answer.choices[0].text == alone.text
    assert answer.choices[0].text != expected[prompt].text
    typical = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, seed=7,
                                         extra_body={"typical_p": 0.5}).choices[0].text for _ in range(2)]
    assert typical[0] == typical[1] and typical[0]
