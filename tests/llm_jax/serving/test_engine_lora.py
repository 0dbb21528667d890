"""The engine with LoRA adapters against ``generate`` on the merged model: requests of two adapters and of
the base model, arriving at random steps with shared prompts, chunked and preempted, greedy and seeded,
each get the tokens ``generate`` gives the adapter's merged model alone; the prefix cache shares blocks
within an adapter and never across; adapters loaded and unloaded while serving compile nothing."""

import random

import pytest

import llm_jax
from llm_jax.serving.engine import Engine
from llm_jax.serving.step import step
from tests.llm_jax.serving.test_engine import SAMPLINGS, alone, run_all


@pytest.fixture(scope="module")
def adapters(story_adapters):
    """Two of the shared adapters (tests/llm_jax/conftest.py): every projection, and a few at another rank."""
    return {name: story_adapters[name] for name in ("tales", "poems")}


@pytest.fixture(scope="module")
def merged(stories, adapters):
    return {name: stories.with_lora(path) for name, path in adapters.items()} | {None: stories}


def test_requests_of_many_adapters_get_their_merged_models_tokens(stories, adapters, merged):
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, 512) for _ in range(35)]
    arrivals, expected, names = {}, {}, [None, "tales", "poems"]
    for i in range(12):
        lora = names[i % 3]
        prompt = shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))] if i < 9 else \
            [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 80))]
        kwargs = dict(sampling=SAMPLINGS[i % len(SAMPLINGS)], max_new_tokens=rng.randrange(8, 40), ignore_eos=True)
        arrivals.setdefault(rng.randrange(0, 25), []).append((f"r{i}", prompt, dict(kwargs, lora=lora)))
        expected[f"r{i}"] = alone(merged[lora], prompt, **kwargs).output_ids
    assert len({tuple(alone(merged[n], shared, max_new_tokens=8).output_ids) for n in names}) == 3
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_blocks=30,
                    max_model_len=256, lora_adapters=list(adapters.values()))
    assert engine.lora_names == ("tales", "poems")
    outputs = run_all(engine, arrivals)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    for rid, outs in outputs.items():
        assert [t for o in outs for t in o.token_ids] == expected[rid], rid
    assert stats.blocks_in_use == 0


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(stories, adapters, merged):
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=64, block_size=8, max_model_len=128,
                    lora_adapters=[adapters["tales"]])
    prompt = [1] + list(range(40, 80))
    for rid, lora in (("base", None), ("tales", "tales"), ("tales again", "tales")):
        before = engine.stats().prefix_hit_tokens
        outputs = run_all(engine, {0: [(rid, prompt, dict(max_new_tokens=6, lora=lora))]})
        assert [t for o in outputs[rid] for t in o.token_ids] == alone(merged[lora], prompt,
                                                                          max_new_tokens=6).output_ids
        hits = engine.stats().prefix_hit_tokens - before
        assert hits == (40 if rid == "tales again" else 0), rid  # five whole blocks of the same adapter


def test_adapters_load_and_unload_while_serving_without_compiling(stories, adapters, merged, tmp_path):
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=128,
                    max_loras=2, max_lora_rank=8)
    engine.warm_up()
    programs = step._cache_size()
    prompt = "Once upon a time"

    def tokens(rid, lora, **kwargs):
        outputs = run_all(engine, {0: [(rid, prompt, dict(max_new_tokens=12, lora=lora, **kwargs))]})
        return [t for o in outputs[rid] for t in o.token_ids]

    assert tokens("base", None) == alone(stories, prompt, max_new_tokens=12).output_ids
    assert engine.add_lora(adapters["tales"]) == "tales"
    engine.add_lora(adapters["poems"], name="verse")
    sampled = llm_jax.Sampling(temperature=0.8, seed=4)
    assert tokens("t", "tales") == alone(merged["tales"], prompt, max_new_tokens=12).output_ids
    assert tokens("v", "verse", sampling=sampled) == alone(merged["poems"], prompt, max_new_tokens=12,
                                                           sampling=sampled).output_ids
    with pytest.raises(ValueError, match="all 2 LoRA slots are in use"):
        engine.add_lora(adapters["tales"], name="third")
    engine.add_request("busy", prompt, max_new_tokens=4, lora="tales")
    with pytest.raises(ValueError, match=r"LoRA adapter 'tales' is in use by requests \['busy'\]"):
        engine.remove_lora("tales")
    while engine.has_unfinished:
        engine.step()
    engine.remove_lora("tales")
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'tales'; loaded: \['verse'\]"):
        engine.add_request("gone", prompt, lora="tales")
    engine.add_lora(adapters["poems"], name="tales")  # a new adapter under the old name: none of its blocks
    assert tokens("again", "tales") == alone(merged["poems"], prompt, max_new_tokens=12).output_ids
    assert step._cache_size() == programs


def test_adapters_that_do_not_fit_are_refused(stories, adapters):
    with pytest.raises(ValueError, match="this engine has no adapters"):
        Engine(stories, max_num_seqs=2, max_model_len=64).add_request("a", [1, 2], lora="tales")
    engine = Engine(stories, max_num_seqs=2, max_model_len=64, lora_adapters=[adapters["tales"]], max_loras=2,
                    max_lora_rank=4)
    with pytest.raises(ValueError, match="has rank 8, above the largest rank 4"):
        engine.add_lora(adapters["poems"])
    with pytest.raises(ValueError, match="a LoRA adapter named 'tales' is already loaded"):
        engine.add_lora(adapters["tales"])
    fixed = Engine(stories, max_num_seqs=2, max_model_len=64, lora_adapters=[adapters["poems"]], max_lora_rank=8)
    fixed.remove_lora("poems")
    with pytest.raises(ValueError, match=r"changes \['gate_proj', 'k_proj', 'o_proj', 'up_proj'\], outside"):
        fixed.add_lora(adapters["tales"])


SHARDED = """
import json, sys, llm_jax
from llm_jax.serving.engine import Engine
model = llm_jax.load(sys.argv[1], mesh=sys.argv[2])
requests = json.loads(sys.argv[3])
engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=128,
                lora_adapters=sys.argv[4:])
for i, (prompt, lora) in enumerate(requests):
    engine.add_request(str(i), prompt, max_new_tokens=16, ignore_eos=True, lora=lora)
tokens = {str(i): [] for i in range(len(requests))}
while engine.has_unfinished:
    for out in engine.step():
        tokens[out.request_id] += out.token_ids
print(model.config.n_kv_heads, json.dumps([tokens[str(i)] for i in range(len(requests))]))
"""


def test_a_sharded_engine_serves_adapters_as_one_device(stories, adapters, merged):
    """On 8 simulated devices (model=8: each K/V head repeated twice, the adapters' k/v updates with them)."""
    import json
    import subprocess

    from multi_device import PYTHON, REPO, cpu_devices_env

    requests = [([1, 403, 407, 9], "tales"), ([1, 29, 80, 123, 77, 5, 301], None), ([1, 88], "poems"),
                ([1, 403, 407, 9], "poems")]
    done = subprocess.run([PYTHON, "-c", SHARDED, stories.path, "model=8", json.dumps(requests),
                           str(adapters["tales"]), str(adapters["poems"])], env=cpu_devices_env(8),
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    kv_heads, tokens = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(kv_heads) == 2 * stories.config.n_kv_heads
    assert json.loads(tokens) == [alone(merged[lora], prompt, max_new_tokens=16, ignore_eos=True).output_ids
                                  for prompt, lora in requests]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_with_adapters_keeps_their_tokens(stories, adapters, merged, method):
    """Proposals (prompt lookup, or the draft model, which has no adapter) are verified by the adapted model:
    greedy tokens stay the merged model's."""
    speculative = llm_jax.Speculative(method=method, num_tokens=3, draft_model=stories if method == "draft" else None)
    engine = Engine(stories, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, max_model_len=128,
                    lora_adapters=list(adapters.values()), speculative=speculative, kv_cache_dtype="int8")
    prompt = [1] + [30, 31, 32, 33] * 5  # repetitive: prompt lookup proposes
    requests = {f"r{i}": (prompt[:12 + 3 * i], lora) for i, lora in enumerate(["tales", None, "poems", "tales"])}
    outputs = run_all(engine, {0: [(rid, p, dict(max_new_tokens=20, ignore_eos=True, lora=lora))
                                   for rid, (p, lora) in requests.items()]})
    for rid, (p, lora) in requests.items():
        expected = alone(merged[lora], p, max_new_tokens=20, ignore_eos=True, kv_cache_dtype="int8").output_ids
        assert [t for o in outputs[rid] for t in o.token_ids] == expected, rid
    assert engine.stats().spec_proposed_tokens > 0
