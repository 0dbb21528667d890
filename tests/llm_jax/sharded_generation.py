"""Run models on one device and on several meshes; print what ``test_sharding.py`` checks, as JSON.

Spawned in a fresh process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the device count
is fixed when JAX starts). For each model: greedy tokens and the prompts' last-token logits on one
device, then on each mesh the same, plus how params and cache are laid out and which collectives the
compiled decode loop contains.

Pallas attention kernels cannot be partitioned by XLA; on a mesh they run per shard (``shard_map``),
which ``--pallas-mesh`` checks like the rest.

Models: a llama2.c ``.bin`` path (loaded with ``load(path, mesh=...)``: host params placed shard by
shard) or ``tiny-gqa`` (random params from ``init_params``, laid out with ``Model.shard``: device params
resharded). The latter has 2 K/V heads, fewer than a model axis of 4 or 8, and a vocabulary of 97,
which no model axis divides.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import jax
import numpy as np

import llm_jax
from llm_jax import buckets, sharding
from llm_jax.decoding import DecodeControls, decode, start
from llm_jax.kv_cache import init_cache
from llm_jax.prefilling import pad_prompts, prefill
from llm_jax.sampling import GREEDY

TINY_GQA = llm_jax.ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=8,
                               d_ff=96, max_seq_len=128)

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
# `%name = f32[4,1,64]{2,1,0} all-reduce(...)`, and the async `-start` forms.
_COLLECTIVE_RE = re.compile(r"=\s*\(?([a-z]+\d*\[[\d,]*\])[^=\n]*?\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, list[int]]]:
    """(op, result dims) of every collective in an HLO module's text."""
    found = []
    for match in _COLLECTIVE_RE.finditer(hlo):
        dims = match.group(1).split("[")[1].rstrip("]")
        found.append((match.group(2), [int(d) for d in dims.split(",") if d]))
    return found


def load(name: str, mesh: str | None) -> llm_jax.Model:
    if name != "tiny-gqa":
        return llm_jax.load(name, mesh=mesh)
    model = llm_jax.Model(config=TINY_GQA, params=llm_jax.init_params(TINY_GQA, seed=0), tokenizer=None,
                          eos_ids=())
    return model if mesh is None else model.shard(llm_jax.make_mesh(mesh))


def prompts_for(vocab_size: int, batch: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, size=n).tolist() for n in rng.integers(2, 15, size=batch)]


def _leaves(tree) -> dict[str, jax.Array]:
    return {sharding._path_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def run(model: llm_jax.Model, prompts: list[list[int]], *, new_tokens: int, chunk_steps: int,
        draft: llm_jax.Model | None = None) -> dict:
    config, mesh, B = model.config, model.mesh, len(prompts)
    results = llm_jax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                               chunk_steps=chunk_steps)
    # Sampling runs the same compiled programs (greedy and sampled rows share them).
    sampling = [llm_jax.Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=row) for row in range(B)]
    sampled = llm_jax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                               chunk_steps=chunk_steps, sampling=sampling)
    # An int8 cache (values and a scale per token and head, split alike).
    int8 = llm_jax.generate_stream(model, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                                   chunk_steps=chunk_steps, kv_cache_dtype="int8", return_kv_cache=True)
    for _ in int8:
        pass
    out = {"tokens": [r.output_ids for r in results], "sampled_tokens": [r.output_ids for r in sampled],
           "int8_tokens": [r.output_ids for r in int8.results],
           # Speculative decoding, greedy: prompt lookup, and a draft model on one device (laid out on the mesh).
           "speculative_tokens": {
               method: [r.output_ids for r in llm_jax.generate(model, prompts, max_new_tokens=new_tokens,
                                                                ignore_eos=True, chunk_steps=chunk_steps,
                                                                speculative=speculative)]
               for method, speculative in (("ngram", llm_jax.Speculative(method="ngram", num_tokens=3)),
                                           ("draft", llm_jax.Speculative(method="draft", num_tokens=3,
                                                                         draft_model=draft)))
               if draft is not None},
           "embeddings": llm_jax.embed_texts(model, prompts, batch_size=B).tolist(),
           "int8_cache_specs": {name: list(getattr(a.sharding, "spec", []))
                                for name, a in _leaves(int8.kv_cache).items()},
           "n_kv_heads": config.n_kv_heads, "k_proj": np.asarray(model.params["layers"]["attn"]["k_proj"]).tolist()}
    # Prefill and decode once more with generate's shapes (every compilation is reused) to read the
    # logits, the cache's layout and the decode program.
    longest = max(map(len, prompts))
    block = buckets.prompt_bucket(longest, context=config.max_seq_len)
    cache_len = buckets.cache_bucket(longest, new_tokens, context=config.max_seq_len)
    tokens_BT, lengths_B = pad_prompts(prompts, block)
    layout = None if mesh is None else sharding.cache_shardings(config, B, cache_len, mesh)
    logits_BV, cache = prefill(model.params, config, tokens_BT, lengths_B,
                               init_cache(config, B, cache_len, sharding=layout), mesh=mesh)
    out["logits"] = np.asarray(logits_BV).tolist()
    if mesh is None:
        return out
    controls = DecodeControls.create([GREEDY] * B, eos_ids=[()] * B, stop_ids=[()] * B,
                                     max_new_tokens=[new_tokens] * B)
    state, _ = start(logits_BV, tokens_BT, cache, controls, mesh=mesh)
    decode_hlo = decode.lower(model.params, config, cache, state, controls, num_steps=chunk_steps,
                              mesh=mesh).compile().as_text()
    cache, state, _ = decode(model.params, config, cache, state, controls, num_steps=chunk_steps, mesh=mesh)
    # Control for the HLO reading: gathering the cache onto every device shows up as a collective.
    gather_hlo = jax.jit(lambda c: c, out_shardings=sharding.replicated(mesh)).lower(cache).compile().as_text()
    params = _leaves(model.params)
    out.update(
        cache_shape=list(cache.k_LBSKH.shape),
        cache_specs={name: list(a.sharding.spec) for name, a in _leaves(cache).items()},
        cache_local_shape=list(cache.k_LBSKH.addressable_shards[0].data.shape),
        state_specs={name: list(a.sharding.spec) for name, a in _leaves(state).items()},
        decode_collectives=collectives(decode_hlo),
        control_collectives=collectives(gather_hlo),
        param_specs={name: list(a.sharding.spec) for name, a in params.items()},
        param_shapes={name: list(a.shape) for name, a in params.items()},
        param_local_shapes={name: list(a.addressable_shards[0].data.shape) for name, a in params.items()},
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", required=True, help="a llama2.c .bin path or 'tiny-gqa'")
    p.add_argument("--mesh", action="append", required=True)
    p.add_argument("--first-model-mesh", action="append", default=[], help="a mesh for the first model only")
    p.add_argument("--pallas-mesh", action="append", default=[],
                   help="also run the first model on this mesh with Pallas attention (interpreted on CPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args(argv)
    report = {"devices": jax.device_count()}
    for name in args.model:
        reference = load(name, None)
        prompts = prompts_for(reference.config.vocab_size, args.batch)
        kwargs = dict(new_tokens=args.new_tokens, chunk_steps=args.new_tokens, draft=reference)
        report[name] = {"one_device": run(reference, prompts, **kwargs)}
        first = name == args.model[0]
        for mesh in args.mesh + (args.first_model_mesh if first else []):
            report[name][mesh] = run(load(name, mesh), prompts, **kwargs)
        if first:
            for mesh in args.pallas_mesh:
                report[name][f"{mesh}+pallas"] = run(load(name, mesh).with_backend("pallas"), prompts, **kwargs)
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
