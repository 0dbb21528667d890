"""Guided decoding (structured outputs) in the serving engine and ``generate``.

Against references nobody here wrote: ``transformers``' model driven greedily under the masks of
``llguidance`` built from the Hugging Face tokenizer by llguidance's own bridge gives the engine's tokens
exactly (our vocabulary bridge and the device-side masking together); sampled outputs parse and match
their JSON schema, regular expression (``re``) or choices; requests running beside guided ones keep
``generate``'s tokens; constraints that do not compile are refused. (No step compiles after warm-up
with guided requests: ``test_engine``.)"""

import json
import random
import re

import llguidance
import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
import torch
import transformers

import llm_jax
from llm_jax.guided import Choice, Grammar, GuidedError, Json, Matcher, Regex, allowed_tokens, vocabulary
from llm_jax.serving.engine import Engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "happy"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99},
                         "happy": {"type": "boolean"}}}
REGEX = r"(Once|One day), [a-z]+ [a-z ]{0,30}\."
CHOICES = ("the cat", "the dog", "a big red bird")
CONSTRAINTS = {"json": Json(SCHEMA), "regex": Regex(REGEX), "choice": Choice(CHOICES),
               "grammar": Grammar('start: "Tom " verb " the " noun "."\nverb: "saw" | "liked" | "found"\n'
                                  'noun: "ball" | "cat" | "big tree"')}
PROMPTS = ["Once upon a time", "Tom and Sue went to the park. They"]


def follows(kind: str, text: str) -> bool:
    """Whether ``text`` is what constraint ``kind`` asks for (checked without llguidance)."""
    if kind == "json":
        value = json.loads(text)
        return (set(value) == {"name", "age", "happy"} and isinstance(value["name"], str)
                and len(value["name"]) <= 12 and type(value["age"]) is int and 0 <= value["age"] <= 99
                and type(value["happy"]) is bool)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"Tom (saw|liked|found) the (ball|cat|big tree)\.", text) is not None


def run(engine: Engine, requests: dict[str, tuple]) -> dict[str, tuple[list[int], str, str]]:
    """Each request's tokens, text and finish reason."""
    for rid, (prompt, kwargs) in requests.items():
        engine.add_request(rid, prompt, **kwargs)
    out = {rid: ([], [], None) for rid in requests}
    for _ in range(2000):
        for o in engine.step():
            ids, texts, _ = out[o.request_id]
            out[o.request_id] = (ids + list(o.token_ids), texts + [o.text], o.finish_reason)
        if not engine.has_unfinished:
            return {rid: (ids, "".join(texts), reason) for rid, (ids, texts, reason) in out.items()}
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def reference(stories260k_dir):
    hf = stories260k_dir / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    return model, llguidance.hf.from_tokenizer(tokenizer)


def reference_greedy(reference, grammar: str, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' argmax under llguidance's mask (its own tokenizer bridge), until the constraint is
    complete or the end-of-sequence token comes."""
    model, tokenizer = reference
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    mask = llg_numpy.allocate_token_bitmask(1, model.config.vocab_size)
    ids, out = list(prompt_ids), []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:].numpy().copy()
        llg_numpy.fill_next_token_bitmask(matcher, mask)
        llg_numpy.apply_token_bitmask_inplace(logits, mask)
        token = int(logits[0].argmax())
        out.append(token)
        ids.append(token)
        assert matcher.consume_token(token), matcher.get_error()
        if token == tokenizer.eos_token or matcher.is_stopped():
            return out
    return out


@pytest.fixture(scope="module")
def expected(stories, reference) -> dict[str, list[int]]:
    """The reference's greedy tokens for each constraint, on prompt i % 2."""
    return {kind: reference_greedy(reference, guided.grammar(), stories.tokenizer.encode(PROMPTS[i % 2]), 60)
            for i, (kind, guided) in enumerate(CONSTRAINTS.items())}


def test_greedy_guided_tokens_are_transformers_under_llguidances_masks(stories, expected):
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=256)
    requests = {kind: (stories.tokenizer.encode(PROMPTS[i % 2]), dict(guided=guided, max_new_tokens=60))
                for i, (kind, guided) in enumerate(CONSTRAINTS.items())}
    outputs = run(engine, requests)
    for kind, (ids, text, reason) in outputs.items():
        assert ids == expected[kind], kind
        assert reason == "stop" and follows(kind, text), (kind, text)


def test_generate_gives_the_references_and_the_engines_tokens(stories, expected):
    """``llm_jax.generate(..., guided=...)``: greedy, the reference's tokens; seeded samples, the engine's
    (per-sequence seeds); a prompt without a constraint beside them, plain decoding's."""
    prompts = [PROMPTS[i % 2] for i in range(len(CONSTRAINTS))]
    greedy = llm_jax.generate(stories, prompts, guided=list(CONSTRAINTS.values()), max_new_tokens=60)
    for (kind, ids), result in zip(expected.items(), greedy):
        assert result.output_ids == ids and result.finish_reason == "stop" and follows(kind, result.text), kind
    sampling = [llm_jax.Sampling(temperature=1.0, seed=i, min_p=0.05) for i in range(len(prompts))]
    sampled = llm_jax.generate(stories, prompts, guided=list(CONSTRAINTS.values()), sampling=sampling, n=2,
                               max_new_tokens=80)
    engine = Engine(stories, max_num_seqs=8, max_num_batched_tokens=32, block_size=8, max_model_len=256)
    outputs = run(engine, {f"{kind}.{j}": (prompt, dict(guided=guided, sampling=s, max_new_tokens=80, sample_index=j))
                           for (kind, guided), prompt, s in zip(CONSTRAINTS.items(), prompts, sampling)
                           for j in range(2)})
    for (rid, (ids, text, _)), result in zip(outputs.items(), sampled):
        assert result.output_ids == ids and follows(rid.split(".")[0], result.text), rid
    mixed = llm_jax.generate(stories, PROMPTS, guided=[Choice(CHOICES), None], max_new_tokens=20)
    assert mixed[0].text in CHOICES
    assert mixed[1].output_ids == llm_jax.generate(stories, PROMPTS[1:], max_new_tokens=20)[0].output_ids
    with pytest.raises(ValueError, match="does not combine with beam search"):
        llm_jax.generate(stories, PROMPTS, guided=Choice(CHOICES), num_beams=2)
    with pytest.raises(ValueError, match="does not combine with speculative decoding"):
        llm_jax.generate(stories, PROMPTS, guided=Choice(CHOICES), speculative=llm_jax.Speculative())


def test_sampled_outputs_follow_their_constraints_beside_unguided_requests(stories):
    """Seeded sampling at temperature 1 (and penalties): every output parses as its constraint asks; the
    greedy unguided requests in the same steps (through the sampling program, one verifying n-gram
    proposals, one with a repetition penalty) give generate's tokens."""
    engine = Engine(stories, max_num_seqs=8, max_num_batched_tokens=48, block_size=8, max_model_len=256,
                    speculative=llm_jax.Speculative(num_tokens=3, prompt_lookup_min=1))
    rng = random.Random(0)
    requests, plain = {}, {}
    for i in range(8):
        kind = list(CONSTRAINTS)[i % 4]
        sampling = llm_jax.Sampling(temperature=1.0, seed=i, top_p=0.95, repetition_penalty=1.1 if i % 2 else 1.0)
        requests[f"{kind}{i}"] = (PROMPTS[i % 2], dict(guided=CONSTRAINTS[kind], max_new_tokens=80, sampling=sampling))
    unguided = {"repeat": ("Keep repeating: " + " ".join(["One, two, three, four."] * 3), llm_jax.GREEDY),
                "penalized": ("One day, a big bird", llm_jax.Sampling(repetition_penalty=1.3))}
    for rid, (prompt, sampling) in unguided.items():
        requests[rid] = (prompt, dict(max_new_tokens=rng.randrange(30, 50), sampling=sampling, ignore_eos=True))
        plain[rid] = llm_jax.generate(stories, [prompt], **requests[rid][1])[0].output_ids
    outputs = run(engine, requests)
    for rid, (ids, text, reason) in outputs.items():
        if rid in plain:
            assert ids == plain[rid], rid
        else:
            assert reason == "stop" and follows(rid.rstrip("0123456789"), text), (rid, text)
    assert engine.stats().blocks_in_use == 0


def test_masks_follow_the_constraint(stories):
    """The first mask of a choice allows exactly the tokens that start one of the choices."""
    vocab = vocabulary(stories.tokenizer, tuple(stories.eos_ids), stories.config.vocab_size)
    matcher = Matcher(vocab, Choice(("cat", "dog")))
    row = np.zeros((vocab.words,), np.int32)
    matcher.fill(row)
    allowed = allowed_tokens(row, stories.config.vocab_size)
    starts = [t for t in range(stories.config.vocab_size) if vocab.forms[t]
              and any(c.encode().startswith(vocab.forms[t]) for c in ("cat", "dog"))]
    assert sorted(allowed) == starts
    assert matcher.consume(vocab.encode("cat")) and matcher.done
    assert vocab.encode(" the dog") and vocab._spell(vocab.encode("{\"a\": 1}")) == b"{\"a\": 1}"


def test_constraints_that_do_not_compile_are_refused(stories):
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=128)
    with pytest.raises(GuidedError, match="regex constraint does not compile"):
        engine.add_request("a", "Hi", guided=Regex("a(b"))
    with pytest.raises(GuidedError, match="grammar"):
        engine.add_request("b", "Hi", guided=Grammar("start: undefined_rule"))
    with pytest.raises(GuidedError, match="non-empty list of strings"):
        Choice(())
    with pytest.raises(TypeError, match="guided must be"):
        engine.add_request("c", "Hi", guided={"type": "object"})
    assert not engine.has_unfinished


def reference_after(reference, grammar: str, prompt_ids: list[int], marker: int, max_new: int) -> list[int]:
    """The reference's greedy tokens, free up to ``marker`` and under llguidance's masks after it."""
    model, tokenizer = reference
    ids, out = list(prompt_ids), []
    while marker not in out and len(out) < max_new:
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
    return out + reference_greedy(reference, grammar, ids, max_new - len(out))


def test_a_constraint_can_start_after_a_token(stories, reference):
    """guided_after_token (a thinking model's </think>): the output is free up to that token and follows
    the constraint after it — the reference's tokens, free then masked — in the engine and generate."""
    prompt = stories.tokenizer.encode(PROMPTS[0])
    plain = llm_jax.generate(stories, [PROMPTS[0]], max_new_tokens=12)[0].output_ids
    marker = plain[4]  # a token the model writes early on its own
    assert plain.index(marker) > 0
    expected = reference_after(reference, CONSTRAINTS["regex"].grammar(), prompt, marker, 80)
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=32, block_size=8, max_model_len=256)
    outputs = run(engine, {"r": (prompt, dict(guided=CONSTRAINTS["regex"], guided_after_token=marker,
                                              max_new_tokens=80))})
    ids, text, reason = outputs["r"]
    assert ids == expected and reason == "stop"
    (result,) = llm_jax.generate(stories, [prompt], guided=CONSTRAINTS["regex"], guided_after_token=marker,
                                 max_new_tokens=80)
    assert result.output_ids == expected and result.finish_reason == "stop" and result.text == text
    after = stories.tokenizer.decode(ids[ids.index(marker) + 1:])
    assert follows("regex", after.lstrip()) and ids[:ids.index(marker) + 1] == plain[:plain.index(marker) + 1]
    with pytest.raises(ValueError, match="guided_after_token"):
        engine.add_request("x", prompt, guided_after_token=marker)
    with pytest.raises(ValueError, match="guided_after_token"):
        llm_jax.generate(stories, [prompt], guided_after_token=marker)
