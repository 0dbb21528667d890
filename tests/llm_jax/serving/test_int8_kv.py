"""The serving engine over an int8 paged KV cache (``Engine(..., kv_cache_dtype="int8")``): pages written
quantized and read dequantized exactly as ``kv_cache.quantize_kv`` does; the CPU kernels' paged attention
over int8 pages against XLA's reference; on stories260K each request's greedy tokens are those of a
reference reading every key and value back from an int8 cache (and ``generate(..., kv_cache_dtype="int8")``'s
but where its float prefill breaks a near tie), with chunked prompts and the prefix cache, on the CPU
kernels and on XLA, and sharded by K/V head on 8 simulated devices; the cache's bytes; no step compiles
after warm-up; refusals that name what is refused."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import run_all

import llm_jax
import llm_jax.sharding
from llm_jax import kv_cache as kvc
from llm_jax.backends import Xla
from llm_jax.backends.pallas import Pallas
from llm_jax.config import ModelConfig
from llm_jax.model import forward_extend, init_params, unembed
from llm_jax.serving.engine import Engine
from llm_jax.serving.step import step

CONFIG = ModelConfig(vocab_size=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=96,
                     max_seq_len=64)


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_pages_hold_quantize_kv_of_what_was_written():
    """write_slots then read_pages gives, at each written position, quantize_kv's values dequantized
    exactly; unwritten positions read 0 and a slot past the pool writes nothing."""
    L, P, Z, K, H = CONFIG.n_layers, 6, 4, CONFIG.n_kv_heads, CONFIG.head_dim
    cache = kvc.init_paged_cache(CONFIG, P, Z, "int8")
    assert isinstance(cache.k_LPZKH, kvc.Int8KV) and cache.dtype == jnp.int8
    assert (cache.num_pages, cache.page_size) == (P, Z)
    assert cache.k_LPZKH.q_LBSKH.shape == (L, P, Z, K, H) and cache.k_LPZKH.s_LBSK.shape == (L, P, Z, K)
    rng = np.random.default_rng(0)
    new_TKH = jnp.asarray(rng.normal(size=(5, K, H)) * rng.uniform(0.1, 30, size=(5, K, 1)), jnp.float32)
    slots_T = jnp.array([9, 10, 13, P * Z + 3, 2], jnp.int32)  # the fourth lies past the pool
    pages = kvc.write_slots(cache.k_LPZKH, jnp.int32(1), slots_T, new_TKH)
    tables_BX = jnp.array([[2, 3], [0, 1]], jnp.int32)  # sequence 0: positions 1, 2, 5 are slots 9, 10, 13
    seq_BSKH = np.asarray(kvc.read_pages(pages, jnp.int32(1), tables_BX))
    q_TKH, s_TK = kvc.quantize_kv(new_TKH)
    expected_TKH = np.asarray(q_TKH, np.float32) * np.asarray(s_TK)[..., None]
    np.testing.assert_array_equal(seq_BSKH[0, [1, 2, 5]], expected_TKH[:3])
    np.testing.assert_array_equal(seq_BSKH[1, 2], expected_TKH[4])  # slot 2: page 0, row 2
    written = {(0, 1), (0, 2), (0, 5), (1, 2)}
    for b, s in np.ndindex(2, 2 * Z):
        if (b, s) not in written:
            np.testing.assert_array_equal(seq_BSKH[b, s], 0.0)
    assert not np.asarray(kvc.read_pages(pages, jnp.int32(0), tables_BX)).any()  # other layers untouched
    half_step_TK1 = np.abs(np.asarray(new_TKH)).max(-1, keepdims=True) / 254  # rounding to int8 steps of max/127
    assert np.all(np.abs(expected_TKH - np.asarray(new_TKH)) <= half_step_TK1 * (1 + 1e-6))


@pytest.mark.parametrize("n_heads", [2, 4])  # G = 1: a decode token reads its pages in place; G = 2
def test_cpu_kernels_attend_over_int8_pages_as_the_reference(n_heads):
    """The CPU backend's paged attention (the kernel reading int8 and scales) writes the same pages as
    XLA's reference, bit for bit, and attends alike, prefill chunk and decode tokens in one step."""
    import dataclasses

    import cpu_kernels
    from llm_jax.backends.cpu import CpuKernels

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels did not build here")
    config = dataclasses.replace(CONFIG, n_heads=n_heads)
    P, Z, K, H, N = 12, 4, config.n_kv_heads, config.head_dim, config.n_heads
    rng = np.random.default_rng(1)
    cache = kvc.init_paged_cache(CONFIG, P, Z, "int8")
    old = jnp.asarray(rng.normal(size=(P * Z, K, H)), jnp.float32)  # every slot holds something first
    cache = kvc.PagedKVCache(*(kvc.write_slots(pages, 1, jnp.arange(P * Z), old * w)
                               for pages, w in ((cache.k_LPZKH, 1.0), (cache.v_LPZKH, 3.0))))
    # Sequence 0: a chunk of 5 tokens ending at position 9; sequence 1: one decode token at position 6.
    batch = kvc.PagedBatch(slots_T=jnp.array([5 * Z + 1, 5 * Z + 2, 5 * Z + 3, 7 * Z, 7 * Z + 1, 3 * Z + 2, -1, -1],
                                             jnp.int32),
                           block_tables_BX=jnp.array([[4, 5, 7], [2, 3, 0]], jnp.int32),
                           query_start_B=jnp.array([0, 5], jnp.int32), num_tokens_B=jnp.array([5, 1], jnp.int32),
                           seq_lens_B=jnp.array([10, 7], jnp.int32), max_query_len=5)
    q_TNH, k_TKH, v_TKH = (jnp.asarray(rng.normal(size=(8, n, H)), jnp.float32) for n in (N, K, K))
    outs = [jax.jit(lambda q, k, v, kp, vp, backend=backend: backend.paged_attention(
        q, k, v, kp, vp, jnp.int32(1), batch, config=config, window=None))(q_TNH, k_TKH, v_TKH, cache.k_LPZKH,
                                                                           cache.v_LPZKH)
            for backend in (CpuKernels(), Xla())]
    (o_cpu, *pages_cpu), (o_xla, *pages_xla) = outs
    assert all(isinstance(p, kvc.Int8KV) for p in pages_cpu)
    for a, b in zip(jax.tree.leaves(pages_cpu), jax.tree.leaves(pages_xla)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(o_xla)[:6]).min() > 0  # every owned row attends
    np.testing.assert_allclose(np.asarray(o_cpu), np.asarray(o_xla), atol=1e-5, rtol=1e-5)


def test_the_pallas_engine_gives_xlas_greedy_tokens_over_int8_pages():
    """The Pallas backend's ragged paged kernel (interpreted here), reading the int8 pages and their scales in
    place, gives the engine the greedy tokens of XLA's reference over the same int8 cache: GQA, pages of 4, a
    window across them, prompts chunked by a budget of 8 tokens and arriving at different steps."""
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                         max_seq_len=64, sliding_window=5)
    params = jax.tree.map(lambda a: a * 6 if a.ndim > 1 else a, init_params(config, seed=3))
    model = llm_jax.Model(config=config, params=params, tokenizer=None, eos_ids=())
    kwargs = dict(max_new_tokens=8, ignore_eos=True)
    arrivals = {0: [("a", [3, 9, 27, 14, 5, 61, 2, 40, 33, 17, 8], kwargs), ("b", [8, 8, 1], kwargs)],
                2: [("c", [5, 4, 3, 2, 1, 60, 50], kwargs)]}
    tokens = {}
    for backend in (Pallas(interpret=True), Xla()):
        engine = Engine(model.with_backend(backend), max_num_seqs=2, max_num_batched_tokens=8, block_size=4,
                        max_model_len=32, kv_cache_dtype="int8")
        assert isinstance(engine.cache.k_LPZKH, kvc.Int8KV)
        tokens[backend.name] = {rid: _tokens(outs) for rid, outs in run_all(engine, arrivals).items()}
    assert tokens["pallas"] == tokens["xla"]
    assert all(len(t) == 8 for t in tokens["xla"].values())


def _prompts() -> dict[str, list[int]]:
    """Prompts of 2 to 70 tokens; d and e share 40 and 32 tokens (5 and 4 blocks of 8) with a."""
    rng = random.Random(2)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    return {"a": shared + [rng.randrange(3, 512) for _ in range(29)], "b": [1, 99],
            "c": [1] + [rng.randrange(3, 512) for _ in range(12)], "d": shared + [7, 8, 9],
            "e": shared[:33] + [rng.randrange(3, 512) for _ in range(5)]}


PROMPTS = _prompts()
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def read_back_greedy(stories) -> dict[str, list[int]]:
    """Each prompt's greedy tokens when every key and value is read back from an int8 cache, the prompt's
    own too: the prompt appended to an empty contiguous int8 cache (``forward_extend``: written quantized,
    attention over the dequantized cache), then one token at a time; XLA's operations, no paging."""
    config, params = stories.config, stories.params

    @jax.jit
    def extend(tokens_BT, cache):
        x_BTD, cache = forward_extend(params, config, tokens_BT, cache, jnp.ones(1, bool), backend=Xla())
        return jnp.argmax(unembed(params, config, x_BTD[:, -1:], Xla())[0, 0]), cache

    greedy = {}
    for rid, prompt in PROMPTS.items():
        cache = kvc.init_cache(config, 1, 128, "int8")
        token, cache = extend(jnp.asarray([prompt], jnp.int32), cache)
        greedy[rid] = [int(token)]
        while len(greedy[rid]) < NEW_TOKENS:
            token, cache = extend(jnp.asarray([[greedy[rid][-1]]], jnp.int32), cache)
            greedy[rid].append(int(token))
    return greedy


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_the_engine_gives_int8_greedy_tokens(stories, read_back_greedy, backend):
    """Greedy, 48 tokens each, prompts arriving at different steps, chunked by a budget of 8 tokens, d and
    e starting from a's cached blocks.

    Each request's tokens are exactly those of the reference that reads every key and value back from an
    int8 cache (``read_back_greedy``): a token's keys are quantized once, as written, and every query
    (prompt chunks too, whatever the chunking or the prefix cache) attends over the dequantized values.
    ``generate(..., kv_cache_dtype="int8")`` differs in one respect: its prefill attends over the prompt's
    own keys before quantizing them (only decode steps read the cache), so its logits differ a little and
    its greedy tokens may differ where two tokens nearly tie. Against it: the same tokens up to the first
    difference, and there (if anywhere) the engine's token is generate's second choice, within 0.15 nats of
    its first (seen: prompt c at its first token, 0.086 nats apart; e at its last, 0.0025)."""
    import cpu_kernels

    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip("the CPU kernels did not build here")
    model = stories.with_backend(backend)
    kwargs = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    arrivals = {0: [("a", PROMPTS["a"], kwargs), ("b", PROMPTS["b"], kwargs)], 3: [("c", PROMPTS["c"], kwargs)],
                30: [("d", PROMPTS["d"], kwargs)], 31: [("e", PROMPTS["e"], kwargs)]}
    engine = Engine(model, max_num_seqs=3, max_num_batched_tokens=8, block_size=8, max_model_len=128,
                    kv_cache_dtype="int8")
    assert isinstance(engine.cache.k_LPZKH, kvc.Int8KV)
    outputs = run_all(engine, arrivals)
    assert engine.stats().prefix_hit_tokens == 40 + 32
    for rid, prompt in PROMPTS.items():
        tokens = _tokens(outputs[rid])
        assert tokens == read_back_greedy[rid], rid
        generated = llm_jax.generate(model, [prompt], kv_cache_dtype="int8", logprobs=2, **kwargs)[0]
        i = next((i for i, (a, b) in enumerate(zip(tokens, generated.output_ids)) if a != b), NEW_TOKENS)
        if i < NEW_TOKENS:
            top = generated.top_logprobs[i]
            assert tokens[i] in top and max(top.values()) - top[tokens[i]] < 0.15, (rid, i, tokens[i], top)


def test_the_int8_cache_keeps_the_engines_perplexity(stories):
    """The test story's perplexity as the engine scores it (``prompt_logprobs``: every token read through
    the cache, in chunks of 32) with an int8 cache, within 0.5% of the float cache's (generate's target;
    stories260K: 4.2584 → 4.2530, -0.13%)."""
    from test_quantization import TINY_STORY

    ids = stories.tokenizer.encode(TINY_STORY)
    perplexity = {}
    for dtype in ("float32", "int8"):
        engine = Engine(stories, max_num_seqs=1, max_num_batched_tokens=32, block_size=16, max_model_len=512,
                        kv_cache_dtype=dtype)
        engine.add_request("story", ids, max_new_tokens=1, prompt_logprobs=0)
        outputs = []
        while engine.has_unfinished:
            outputs += engine.step()
        (scored,) = [o.prompt_logprobs for o in outputs if o.prompt_logprobs]
        perplexity[dtype] = float(np.exp(-np.mean(scored[1:])))
    print(f"\nstories260K through the engine: perplexity {perplexity['float32']:.4f} (float32 cache), int8 cache "
          f"Δ {100 * (perplexity['int8'] / perplexity['float32'] - 1):+.3f}%")
    assert abs(perplexity["int8"] / perplexity["float32"] - 1) <= 0.005


SHARDED = """
import json, sys, jax, llm_jax
from llm_jax.serving.engine import Engine
model = llm_jax.load(sys.argv[1], mesh=sys.argv[2])
engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=8, block_size=8, max_model_len=128,
                kv_cache_dtype="int8")
prompts = json.loads(sys.argv[3])
for rid, p in prompts.items():
    engine.add_request(rid, p, max_new_tokens=24, ignore_eos=True)
tokens = {rid: [] for rid in prompts}
while engine.has_unfinished:
    for out in engine.step():
        tokens[out.request_id] += out.token_ids
print(json.dumps(tokens))
specs = [(a.ndim, [*a.sharding.spec]) for a in jax.tree.leaves(engine.cache)]
print(json.dumps([spec + [None] * (ndim - len(spec)) for ndim, spec in specs]))
"""


def test_a_sharded_engine_splits_values_and_scales_by_head(stories260k_dir, read_back_greedy):
    """On 8 simulated devices (data=2, model=4) the int8 pages and their scales split alike by K/V head
    over ``model``, and each request's greedy tokens are those of one device."""
    import json
    import subprocess

    from multi_device import PYTHON, REPO, cpu_devices_env

    prompts = {rid: PROMPTS[rid] for rid in "bce"}
    done = subprocess.run([PYTHON, "-c", SHARDED, str(stories260k_dir / "stories260K.bin"), "data=2,model=4",
                           json.dumps(prompts)], env=cpu_devices_env(8), capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens, specs = map(json.loads, done.stdout.strip().splitlines()[-2:])
    assert specs == [[None, None, None, "model", None], [None, None, None, "model"]] * 2  # k's q and s, v's
    assert tokens == {rid: read_back_greedy[rid][:24] for rid in prompts}


def test_the_cpu_step_reads_int8_pages_through_the_kernel(stories):
    """On the CPU backend an int8 cache's step runs the int8 paged kernel, which writes the pages and their
    scales in place: no XLA scatter into them."""
    import cpu_kernels
    from llm_jax.serving.step import Shape, abstract_inputs

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels did not build here")
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=64,
                    kv_cache_dtype="int8")
    inputs = abstract_inputs(Shape(T=16, B=2, X=engine.X, Q=16), stories.config, bias_width=300, end_width=32,
                             max_model_len=64)
    hlo = step.lower(stories.weights, stories.config, engine.cache, inputs, backend=stories.backend).compile().as_text()
    assert "llm_jax_paged_attention_append_i8" in hlo
    pages = (f"s8[{stories.config.n_layers},{engine.cache.num_pages},8,",
             f"f32[{stories.config.n_layers},{engine.cache.num_pages},8,{stories.config.n_kv_heads}]")
    assert not [line for line in hlo.splitlines()
                if any(p in line for p in pages) and (" scatter(" in line or " copy(" in line)]


def test_an_int8_cache_holds_h_plus_4_bytes_per_token_and_head():
    """An int8 cache holds (H + 4) bytes per token and kv head (int8 values, a float32 scale) against
    bfloat16's 2H (H = 64: 53%); sized by kv_cache_memory, it gets the blocks that many bytes hold."""
    model = llm_jax.Model(config=CONFIG, params=init_params(CONFIG, seed=0), tokenizer=None, eos_ids=())
    L, K, H, Z, blocks = CONFIG.n_layers, CONFIG.n_kv_heads, CONFIG.head_dim, 8, 10
    engines = {dtype: Engine(model, max_num_seqs=2, block_size=Z, num_blocks=blocks, kv_cache_dtype=dtype)
               for dtype in ("int8", "bfloat16", "float32")}
    assert engines["int8"].cache.nbytes == 2 * L * blocks * Z * K * (H + 4)
    assert engines["bfloat16"].cache.nbytes == 2 * L * blocks * Z * K * 2 * H
    assert engines["float32"].cache.nbytes == 2 * L * blocks * Z * K * 4 * H
    assert engines["int8"].cache.nbytes / engines["bfloat16"].cache.nbytes == (H + 4) / (2 * H) < 0.54
    for dtype, bytes_per_token in (("int8", 2 * L * K * (H + 4)), ("bfloat16", 2 * L * K * 2 * H)):
        assert kvc.cache_bytes_per_token(CONFIG, dtype) == bytes_per_token
        engine = Engine(model, max_num_seqs=2, block_size=Z, kv_cache_memory=1 << 20, kv_cache_dtype=dtype)
        assert engine.cache.num_pages == (1 << 20) // (bytes_per_token * Z)
        assert engine.cache.nbytes <= 1 << 20


def test_no_step_compiles_after_warm_up_with_an_int8_cache(stories):
    engine = Engine(stories, max_num_seqs=2, max_num_batched_tokens=16, block_size=8, max_model_len=96,
                    kv_cache_dtype="int8")
    assert engine.warm_up() == len(engine.shapes())
    programs = step._cache_size()
    rng = random.Random(3)
    arrivals = {}
    for i in range(5):
        prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 40))]
        kwargs = dict(max_new_tokens=rng.randrange(1, 20), ignore_eos=True,
                      sampling=llm_jax.Sampling(temperature=0.8, seed=i) if i % 2 else llm_jax.GREEDY)
        arrivals.setdefault(rng.randrange(0, 10), []).append((f"r{i}", prompt, kwargs))
    outputs = run_all(engine, arrivals)
    assert all(outs and outs[-1].finish_reason == "length" for outs in outputs.values())
    assert step._cache_size() == programs


def test_refusals_name_what_is_refused():
    """An unknown cache dtype; shardings made for float pages given to an int8 cache. A donated int8 cache
    reports itself deleted (the engine's check after a failed step)."""
    model = llm_jax.Model(config=CONFIG, params=init_params(CONFIG, seed=0), tokenizer=None, eos_ids=())
    with pytest.raises(ValueError, match="int8, bfloat16, float32.*'float16'"):
        Engine(model, num_blocks=4, kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="int8, bfloat16, float32.*'fp8'"):
        Engine(model, num_blocks=4, kv_cache_dtype="fp8")
    mesh = llm_jax.sharding.make_mesh("model=1", devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"int8 paged cache must be made for it: .*dtype='int8'"):
        kvc.init_paged_cache(CONFIG, 4, 8, "int8", sharding=llm_jax.sharding.paged_cache_shardings(CONFIG, 4, 8, mesh))
    with pytest.raises(ValueError, match=r"bfloat16 paged cache must be made for it: .*dtype='bfloat16'"):
        kvc.init_paged_cache(CONFIG, 4, 8, "bfloat16",
                             sharding=llm_jax.sharding.paged_cache_shardings(CONFIG, 4, 8, mesh, "int8"))
    cache = kvc.init_paged_cache(CONFIG, 4, 8, "int8")
    assert not cache.k_LPZKH.is_deleted()
    jax.jit(lambda c: jax.tree.map(lambda a: a + 1, c), donate_argnums=0)(cache)
    assert cache.k_LPZKH.is_deleted() and cache.v_LPZKH.is_deleted()
