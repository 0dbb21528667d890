"""The serving engine against ``generate``: each request's tokens are those ``generate`` gives it alone,
whatever else runs beside it (arrivals at random steps, chunked prompts, shared prefixes, preemptions,
aborts), with greedy and seeded sampling, on stories260K and on random models of the families whose
attention differs (sliding windows across block boundaries, soft-capping); and no step compiles after
warm-up, whatever the requests ask for (guided ones included)."""

import random

import jax
import numpy as np
import pytest

import llm_jax
from llm_jax.config import ModelConfig
from llm_jax.model import init_params
from llm_jax.serving.engine import Engine
from llm_jax.serving.step import step

from family_switches import FAMILIES, random_model

SAMPLINGS = [llm_jax.GREEDY, llm_jax.Sampling(temperature=0.9, top_p=0.9, seed=7),
             llm_jax.Sampling(temperature=1.2, top_k=20, seed=3, repetition_penalty=1.3),
             llm_jax.Sampling(temperature=0.7, min_p=0.1, seed=11, presence_penalty=0.5, frequency_penalty=0.3,
                              logit_bias={5: 2.0, 9: -100.0})]


def run_all(engine: Engine, arrivals: dict[int, list[tuple]], aborts: dict[int, list[str]] = {},
            max_steps: int = 10_000) -> dict[str, list]:
    """Drive ``engine``: requests (id, prompt, kwargs) arrive at their step; returns each request's
    outputs in order."""
    outputs: dict[str, list] = {}
    for n in range(max_steps):
        for rid, prompt, kwargs in arrivals.get(n, []):
            engine.add_request(rid, prompt, **kwargs)
            outputs[rid] = []
        for rid in aborts.get(n, []):
            engine.abort(rid)
        for out in engine.step():
            outputs[out.request_id].append(out)
        if not engine.has_unfinished and n >= max(arrivals):
            return outputs
    raise AssertionError("the engine did not finish")


def alone(model, prompt, **kwargs) -> llm_jax.GenerationResult:
    return llm_jax.generate(model, [prompt], **kwargs)[0]


def test_a_random_workload_gives_each_request_its_own_tokens(stories):
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    arrivals, expected = {}, {}
    for i in range(14):
        if i % 3 == 0:  # a shared prefix (the prefix cache), then its own tail
            prompt = shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
        else:
            prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 120))]
        kwargs = dict(sampling=SAMPLINGS[i % len(SAMPLINGS)], max_new_tokens=rng.randrange(1, 40), ignore_eos=True)
        arrivals.setdefault(rng.randrange(0, 30), []).append((f"r{i}", prompt, kwargs))
        expected[f"r{i}"] = alone(stories, prompt, **kwargs).output_ids
    # A small pool (preemptions) and a small budget (chunked prompts).
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_blocks=24,
                    max_model_len=256)
    outputs = run_all(engine, arrivals, aborts={12: ["r1"]})
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    for rid, outs in outputs.items():
        tokens = [t for o in outs for t in o.token_ids]
        if rid == "r1" and (not outs or outs[-1].finish_reason is None):  # aborted: a prefix of its tokens
            assert tokens == expected[rid][:len(tokens)]
            continue
        assert tokens == expected[rid], rid
        assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert stats.blocks_in_use == 0 and not engine.has_unfinished


def test_text_stops_and_logprobs_are_generates(stories):
    prompt = "Once upon a time, there was a little"
    cases = [dict(max_new_tokens=60), dict(max_new_tokens=60, stop=["."]), dict(max_new_tokens=60, stop_token_ids=[13]),
             dict(max_new_tokens=30, logprobs=3, sampling=llm_jax.Sampling(temperature=0.8, seed=5)),
             dict(max_new_tokens=20, min_new_tokens=15, sampling=llm_jax.Sampling(temperature=1.0, seed=2))]
    engine = Engine(stories, max_num_seqs=8, max_num_batched_tokens=64, block_size=16, max_model_len=256)
    outputs = run_all(engine, {0: [(f"c{i}", prompt, kw) for i, kw in enumerate(cases)]})
    for i, kw in enumerate(cases):
        ours, theirs = outputs[f"c{i}"], alone(stories, prompt, **kw)
        assert [t for o in ours for t in o.token_ids] == theirs.output_ids, kw
        assert "".join(o.text for o in ours) == theirs.text, kw
        assert ours[-1].finish_reason == theirs.finish_reason, kw
        if "logprobs" in kw:
            np.testing.assert_allclose([p for o in ours for p in o.logprobs], theirs.logprobs, atol=1e-5)
            assert [o.top_logprobs[0].keys() for o in ours] == [d.keys() for d in theirs.top_logprobs]


def test_prompt_logprobs_are_generates(stories):
    """Each prompt token's log-probability and top tokens, as ``generate`` gives them, whatever the
    chunking (a budget of 16 tokens) and though the prompt's prefix is cached by an earlier request."""
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=16, block_size=8, max_model_len=256)
    outputs = run_all(engine, {0: [("warm", prompt, dict(max_new_tokens=2))],
                               3: [("p", prompt, dict(max_new_tokens=3, prompt_logprobs=3)),
                                   ("q", prompt[:40], dict(max_new_tokens=2, prompt_logprobs=0))]})
    for rid, text, n in (("p", prompt, 3), ("q", prompt[:40], 0)):
        theirs = alone(stories, text, max_new_tokens=3, prompt_logprobs=n)
        first = outputs[rid][0]
        assert first.prompt_logprobs[0] is None and first.prompt_top_logprobs[0] is None
        assert len(first.prompt_logprobs) == len(theirs.prompt_logprobs) == first.num_prompt_tokens
        np.testing.assert_allclose(first.prompt_logprobs[1:], theirs.prompt_logprobs[1:], atol=1e-5)
        for ours, expected in zip(first.prompt_top_logprobs[1:], theirs.prompt_top_logprobs[1:] if n else
                                  [{}] * (len(first.prompt_logprobs) - 1), strict=True):
            assert list(ours) == list(expected)[:n]
            np.testing.assert_allclose(list(ours.values()), list(expected.values())[:n], atol=1e-5)
        assert all(o.prompt_logprobs is None for o in outputs[rid][1:])
    assert outputs["warm"][0].prompt_logprobs is None
    assert engine.stats().prefix_hit_tokens == 0  # scored prompts compute every position




@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family(family):
    """Random models of every family's switches (biases, q/k norms, GeGLU, windows across blocks,
    soft-capping): the engine gives each request ``generate``'s tokens."""
    model = random_model(family, seed=1)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 17, 9)]
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=8, block_size=4, max_model_len=64)
    kwargs = dict(max_new_tokens=25)
    outputs = run_all(engine, {0: [("a", prompts[0], kwargs), ("b", prompts[1], kwargs)], 3: [("c", prompts[2], kwargs)]})
    for rid, prompt in zip("abc", prompts):
        assert [t for o in outputs[rid] for t in o.token_ids] == alone(model, prompt, **kwargs).output_ids, rid


# Every processor whose table had no fixed shape before (typical-p, suppressed tokens, banned sequences,
# no-repeat n-grams), beside the others, greedy and seeded.
PROCESSORS = [llm_jax.Sampling(no_repeat_ngram_size=2),
              llm_jax.Sampling(no_repeat_ngram_size=3, temperature=0.9, seed=4),
              llm_jax.Sampling(suppress_tokens=(13, 29), bad_words_ids=((261, 269), (400,), (370, 268, 282))),
              llm_jax.Sampling(typical_p=0.7, temperature=1.0, seed=9),
              llm_jax.Sampling(typical_p=0.9, temperature=0.8, seed=2, bad_words_ids=((1, 403),),
                               repetition_penalty=1.2),
              llm_jax.GREEDY]


@pytest.fixture(scope="module")
def banning(stories):
    """(prompt, settings) pairs whose bans change stories260K's greedy output: each bans tokens and
    sequences of what the prompt's greedy continuation says."""
    prompts = [stories.tokenizer.encode(p) for p in ("Once upon a time", "Tom and Sue went to the park. They")]
    a, b = (alone(stories, p, max_new_tokens=30, ignore_eos=True).output_ids for p in prompts)
    settings = [(prompts[0], llm_jax.Sampling(no_repeat_ngram_size=1)),
                (prompts[1], llm_jax.Sampling(no_repeat_ngram_size=2)),
                (prompts[1], llm_jax.Sampling(no_repeat_ngram_size=3, temperature=0.9, seed=4)),
                (prompts[0], llm_jax.Sampling(suppress_tokens=(a[3],))),
                (prompts[1], llm_jax.Sampling(bad_words_ids=((b[4], b[5]), (b[7], b[8], b[9])))),
                (prompts[0], llm_jax.Sampling(typical_p=0.7, temperature=1.0, seed=9, bad_words_ids=((a[6],),))),
                (prompts[1], llm_jax.Sampling(typical_p=0.9, temperature=0.8, seed=2, repetition_penalty=1.2,
                                              suppress_tokens=(b[2],), no_repeat_ngram_size=4)),
                (prompts[0], llm_jax.GREEDY)]
    for prompt, sampling in settings[:5]:  # the greedy ones' bans do change the output
        if sampling.greedy:
            assert alone(stories, prompt, max_new_tokens=30, ignore_eos=True, sampling=sampling).output_ids != (
                a if prompt == prompts[0] else b), sampling
    return settings


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_every_processor_gives_generates_tokens(stories, banning, speculative):
    """With speculation (n-gram, k = 3) the greedy rows verify proposals position by position: the
    banned sequences and n-grams see each accepted proposal."""
    rng = random.Random(2)
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=256,
                    speculative=llm_jax.Speculative(num_tokens=3, prompt_lookup_min=1) if speculative else None)
    arrivals, expected = {}, {}
    for i, (prompt, sampling) in enumerate(banning * 2):
        if speculative and not sampling.greedy:
            continue  # sampled with speculation: the same distribution, not the same draws
        kwargs = dict(sampling=sampling, max_new_tokens=rng.randrange(20, 60), ignore_eos=True)
        arrivals.setdefault(rng.randrange(0, 10), []).append((f"r{i}", prompt, kwargs))
        expected[f"r{i}"] = alone(stories, prompt, **kwargs).output_ids
    outputs = run_all(engine, arrivals)
    for rid, ids in expected.items():
        assert [t for o in outputs[rid] for t in o.token_ids] == ids, rid


def test_no_step_compiles_after_warm_up(stories):
    """Requests arriving at random steps with every kind of setting — samplings, processors, top and
    prompt log-probabilities, and constraints (guided, one with log-probabilities) — run only the programs
    warm_up compiled."""
    from test_guided import CONSTRAINTS, follows

    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=128)
    compiled = engine.warm_up()
    assert compiled == len(engine.shapes())
    programs = step._cache_size()
    rng = random.Random(1)
    arrivals = {}
    for i in range(10):
        prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 60))]
        kwargs = dict(sampling=(SAMPLINGS + PROCESSORS)[i % (len(SAMPLINGS) + len(PROCESSORS))],
                      max_new_tokens=rng.randrange(1, 30), ignore_eos=True,
                      logprobs=2 if i % 4 == 3 else None, prompt_logprobs=1 if i % 5 == 2 else None)
        arrivals.setdefault(rng.randrange(0, 20), []).append((f"r{i}", prompt, kwargs))
    for i, (kind, guided) in enumerate(CONSTRAINTS.items()):
        kwargs = dict(guided=guided, max_new_tokens=60, logprobs=2 if i == 1 else None)
        arrivals.setdefault(rng.randrange(0, 20), []).append((kind, "Once upon a time", kwargs))
    outputs = run_all(engine, arrivals)
    assert step._cache_size() == programs
    for kind in CONSTRAINTS:
        assert follows(kind, "".join(o.text for o in outputs[kind])), kind


def test_requests_that_cannot_run_are_refused_with_the_reason(stories):
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, num_blocks=4, max_model_len=256)
    with pytest.raises(ValueError):  # more blocks than the pool holds
        engine.add_request("long", [1] * 100, max_new_tokens=10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [1, 2], stop_token_ids=[9999])
    with pytest.raises(ValueError, match="no_repeat_ngram_size 9, at most 8"):
        engine.add_request("ngram", [1, 2], sampling=llm_jax.Sampling(no_repeat_ngram_size=9))
    with pytest.raises(ValueError, match="a bad word of 9 tokens, at most 8"):
        engine.add_request("words", [1, 2], sampling=llm_jax.Sampling(bad_words_ids=[[5] * 9]))
    with pytest.raises(ValueError, match="logprobs must be in"):
        engine.add_request("lp", [1, 2], logprobs=50)
    engine.add_request("ok", [1, 2, 3], max_new_tokens=3)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("ok", [1, 2, 3], max_new_tokens=3)
    assert engine.abort("ok") and not engine.abort("ok") and not engine.has_unfinished


SHARDED = """
import json, sys, llm_jax
from llm_jax.serving.engine import Engine
model = llm_jax.load(sys.argv[1], mesh=sys.argv[2])
prompts = json.loads(sys.argv[3])


def run(model, **kwargs):
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=128, **kwargs)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, max_new_tokens=24, ignore_eos=True,
                           sampling=llm_jax.Sampling(temperature=0.8, seed=i) if i % 2 else llm_jax.GREEDY)
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return engine, [tokens[str(i)] for i in range(len(prompts))]


engine, tokens = run(model)
# A draft model loaded on one device (the same model): laid out on the mesh, its pages split alike. Sampled
# rows draw as speculative sampling does (not plain sampling's tokens): one device's engine is their reference.
one_device = llm_jax.load(sys.argv[1])
draft = llm_jax.Speculative(method="draft", num_tokens=3, draft_model=one_device)
with_draft, draft_tokens = run(model, speculative=draft)
print(json.dumps([draft_tokens, run(one_device, speculative=draft)[1]]))
print(with_draft.draft_cache.k_LPZKH.sharding.spec, with_draft.stats().spec_accepted_tokens)
print(json.dumps(tokens))
print(engine.cache.k_LPZKH.sharding.spec)
"""


def test_a_sharded_engine_gives_the_same_tokens(stories260k_dir):
    """On 8 simulated devices, the params and pages split by K/V head: the tokens of one device, with a draft
    model (loaded on one device, laid out on the mesh by the engine) too."""
    import json
    import subprocess

    from multi_device import PYTHON, REPO, cpu_devices_env

    path = stories260k_dir / "stories260K.bin"
    prompts = [[1, 403, 407, 9], [1, 29, 80, 123, 77, 5, 301], [1, 88]]
    done = subprocess.run([PYTHON, "-c", SHARDED, str(path), "data=2,model=4", json.dumps(prompts)],
                          env=cpu_devices_env(8), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    draft_tokens, draft_spec, tokens, spec = done.stdout.strip().splitlines()[-4:]
    model = llm_jax.load(path)
    expected = [alone(model, p, max_new_tokens=24, ignore_eos=True,
                      sampling=llm_jax.Sampling(temperature=0.8, seed=i) if i % 2 else llm_jax.GREEDY).output_ids
                for i, p in enumerate(prompts)]
    assert json.loads(tokens) == expected
    assert "model" in spec
    # With the draft: greedy rows give plain decoding's tokens, sampled rows one device's engine's with the
    # same draft; its pages split as the model's, its proposals accepted.
    draft_tokens, one_device_draft_tokens = json.loads(draft_tokens)
    assert draft_tokens == one_device_draft_tokens
    assert [draft_tokens[i] for i in (0, 2)] == [expected[i] for i in (0, 2)]
    pages_spec, accepted = draft_spec.rsplit(" ", 1)
    assert "model" in pages_spec and int(accepted) > 0


@pytest.mark.parametrize("quantize", ["int8", "int4", "int4-asym"])
def test_quantized_weights_serve_as_generate_runs_them(stories260k_dir, quantize):
    """The engine takes quantized leaves as they are: on the default backend (the CPU kernels here) and on
    XLA, each request's tokens are generate's on the same quantized model."""
    model = llm_jax.load(stories260k_dir / "stories260K.bin", quantize=quantize)
    assert any(type(leaf).__name__ == "QuantizedArray"
               for leaf in jax.tree.leaves(model.params, is_leaf=lambda x: type(x).__name__ == "QuantizedArray"))
    prompts = ["Once upon a time", "The little dog"]
    kwargs = dict(max_new_tokens=16, ignore_eos=True)
    for backend in (model.backend, "xla"):
        engine = Engine(model.with_backend(backend), max_num_seqs=2, max_num_batched_tokens=16, block_size=8,
                        max_model_len=128)
        outputs = run_all(engine, {0: [("a", prompts[0], kwargs)], 2: [("b", prompts[1], kwargs)]})
        for rid, prompt in zip("ab", prompts):
            assert ([t for o in outputs[rid] for t in o.token_ids]
                    == alone(model.with_backend(backend), prompt, **kwargs).output_ids), (rid, backend)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_every_backend_attends_over_pages_alike(backend):
    """The Pallas ragged paged kernel (interpreted here) and XLA's reference give the engine the tokens
    ``generate`` gives (on this process' default backend)."""
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                         max_seq_len=64, sliding_window=5)
    params = jax.tree.map(lambda a: a * 6 if a.ndim > 1 else a, init_params(config, seed=3))
    model = llm_jax.Model(config=config, params=params, tokenizer=None, eos_ids=())
    prompts = [[3, 9, 27, 14, 5, 61, 2], [8, 8, 1]]
    engine = Engine(model.with_backend(backend), max_num_seqs=2, max_num_batched_tokens=8, block_size=4,
                    max_model_len=32)
    kwargs = dict(max_new_tokens=5)
    outputs = run_all(engine, {0: [("a", prompts[0], kwargs)], 1: [("b", prompts[1], kwargs)]})
    for rid, prompt in zip("ab", prompts):
        assert [t for o in outputs[rid] for t in o.token_ids] == alone(model, prompt, **kwargs).output_ids, rid


def test_the_cpu_step_reads_pages_through_the_kernel(stories):
    """On the CPU backend a step's attention is the paged kernel, writing the pages in place: no XLA
    gather of pages and no scatter into them."""
    import cpu_kernels
    from llm_jax.serving.step import Shape, abstract_inputs

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels did not build here")
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=64)
    inputs = abstract_inputs(Shape(T=16, B=2, X=engine.X, Q=16), stories.config, bias_width=300, end_width=32,
                             max_model_len=64)
    hlo = step.lower(stories.weights, stories.config, engine.cache, inputs, backend=stories.backend).compile().as_text()
    assert "llm_jax_paged_attention_append" in hlo
    pages = f"f32[{stories.config.n_layers},{engine.cache.num_pages},8,"  # the pages' shape, as HLO prints it
    assert not [line for line in hlo.splitlines() if pages in line and (" scatter(" in line or " copy(" in line)]


def test_special_tokens_text_when_asked(stories260k_dir):
    """skip_special_tokens=False keeps special tokens' text (as the Hugging Face tokenizer decodes them),
    but that of the token ending the request; the default shows none."""
    import transformers

    model = llm_jax.load(stories260k_dir / "hf")  # BOS is no stop token here
    hf = transformers.AutoTokenizer.from_pretrained(stories260k_dir / "hf")
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, max_model_len=64)
    bos, eos = model.tokenizer.bos_id, model.tokenizer.eos_ids[0]
    often_bos = llm_jax.Sampling(logit_bias={bos: 100.0})
    cases = {"kept": dict(sampling=often_bos, skip_special_tokens=False), "skipped": dict(sampling=often_bos),
             "end": dict(sampling=llm_jax.Sampling(logit_bias={eos: 100.0}), skip_special_tokens=False)}
    outputs = run_all(engine, {0: [(rid, "Once upon a time", dict(max_new_tokens=12, **kw))
                                   for rid, kw in cases.items()]})
    ids = {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
    text = {rid: "".join(o.text for o in outs) for rid, outs in outputs.items()}
    assert ids["kept"] == ids["skipped"] == [bos] * 12
    assert "<s>" in text["kept"] and "<s>" not in text["skipped"]
    prompt = model.tokenizer.encode("Once upon a time")
    whole = hf.decode(prompt + ids["kept"], skip_special_tokens=False)
    assert whole.endswith(text["kept"]) and whole[:-len(text["kept"])] == hf.decode(prompt, skip_special_tokens=False)
    assert ids["end"] == [eos] and text["end"] == "" and outputs["end"][-1].finish_reason == "eos"


def test_priority_orders_requests(stories):
    """A lower priority value runs first; each request still gets generate's tokens."""
    engine = Engine(stories, max_num_seqs=1, max_num_batched_tokens=32, block_size=16, max_model_len=128)
    prompts = {"later": "Once upon a time", "first": "The dog ran"}
    engine.add_request("later", prompts["later"], max_new_tokens=4, priority=1)
    engine.add_request("first", prompts["first"], max_new_tokens=4, priority=-1)
    order, tokens = [], {rid: [] for rid in prompts}
    while engine.has_unfinished:
        for out in engine.step():
            order.append(out.request_id)
            tokens[out.request_id] += out.token_ids
    assert order == ["first"] * 4 + ["later"] * 4
    for rid, prompt in prompts.items():
        assert tokens[rid] == alone(stories, prompt, max_new_tokens=4).output_ids
