"""The mesh, the sharding table, and sharded generation against one device.

The multi-device tests run ``sharded_generation.py`` once in a subprocess with 8 simulated CPU devices
(``XLA_FLAGS`` must be set before JAX starts) and check its report: greedy tokens and logits equal to one
device's on meshes 1×8, 2×4, 4×2 and 8×1 (stories260K on the first two), params and cache laid out as the
table says, and no collective touching the cache in the compiled decode loop.
"""

from __future__ import annotations

import json
import subprocess

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from llm_jax import sharding
from llm_jax.config import ModelConfig
from llm_jax.model import param_shapes
from llm_jax.sharding import MeshError, kv_head_repeats, make_mesh, parse_mesh_spec, spec
from multi_device import PYTHON, REPO, computed_once, cpu_devices_env

MESHES = ("data=1,model=8", "data=2,model=4", "data=4,model=2", "data=8,model=1")
GQA = "tiny-gqa"
# stories260K (loaded shard by shard from its .bin, a tied head, an MLP width no axis of 8 divides) runs on
# the meshes that lay it out differently from the tiny GQA model; both take all four on the one device.
STORIES_MESHES = MESHES[:2]
PALLAS_MESH = "data=2,model=4"  # the tiny GQA model with Pallas attention, its kernels run per shard


def abstract(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), ("data", "model"))


# --- Mesh specs and the table (no devices needed) ---

def test_parse_mesh_spec():
    assert parse_mesh_spec("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh_spec(" model = 8 ") == {"model": 8}


@pytest.mark.parametrize("text, message", [
    ("data=2,tensor=4", "unknown mesh axis 'tensor'"),
    ("data=2,data=4", "given twice"),
    ("data=0", "must be at least 1"),
    ("model:4", "bad mesh axis 'model:4'"),
    ("", "empty mesh spec"),
])
def test_parse_mesh_spec_errors(text, message):
    with pytest.raises(MeshError, match=message):
        parse_mesh_spec(text)


def test_make_mesh_on_one_device():
    mesh = make_mesh("data=1,model=1")
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 1, "model": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert dict(make_mesh().shape) == {"data": 1, "model": 1}
    assert dict(make_mesh("model=1").shape) == {"data": 1, "model": 1}
    with pytest.raises(MeshError, match="needs 2 devices, but 1 are available"):
        make_mesh("data=2,model=1")
    with pytest.raises(MeshError, match="1 devices are not a multiple of 2"):
        make_mesh("model=2")


@pytest.mark.parametrize("dims, shape, mesh, expected", [
    # Megatron: Q/K/V and gate/up split by output, o/down by input, vocabulary split.
    ("LDNH", (2, 64, 8, 8), (2, 4), P(None, None, "model", None)),
    ("LDKH", (2, 64, 4, 8), (2, 4), P(None, None, "model", None)),
    ("LNHD", (2, 8, 8, 64), (2, 4), P(None, "model", None, None)),
    ("LDF", (2, 64, 96), (2, 4), P(None, None, "model")),
    ("LFD", (2, 96, 64), (2, 4), P(None, "model", None)),
    ("VD", (512, 64), (2, 4), P("model", None)),
    ("DV", (64, 512), (2, 4), P(None, "model")),
    # Norms stay whole, even where D divides the axis.
    ("LD", (2, 64), (2, 4), P(None, None)),
    ("D", (64,), (1, 8), P(None)),
    # The cache: batch on data, K/V heads on model.
    ("LBSKH", (2, 8, 32, 4, 8), (2, 4), P(None, "data", None, "model", None)),
    # Indivisible: a vocabulary of 97 and an MLP width of 172 give the model axis to D instead.
    ("VD", (97, 64), (2, 4), P(None, "model")),
    ("DV", (64, 97), (2, 4), P("model", None)),
    ("LDF", (5, 64, 172), (1, 8), P(None, "model", None)),
    ("LFD", (5, 172, 64), (1, 8), P(None, None, "model")),
    # ... and a batch of 3 on data=2 is replicated.
    ("BT", (3, 16), (2, 4), P(None, None)),
    # Axes of size 1 shard nothing and are left out.
    ("LDNH", (2, 64, 8, 8), (8, 1), P(None, None, None, None)),
])
def test_spec(dims, shape, mesh, expected):
    assert spec(dims, shape, abstract(*mesh)) == expected


def test_spec_rejects_mismatched_dims():
    with pytest.raises(ValueError, match="dimensions 'LDNH' do not match an array of shape \\(2, 64\\)"):
        spec("LDNH", (2, 64), abstract(2, 4))


FAMILY_SWITCHES = dict(qkv_bias=True, qk_norm=True, sandwich_norm=True, tie_embeddings=False)


@pytest.mark.parametrize("switches", [{}, FAMILY_SWITCHES], ids=["llama", "every-switch"])
def test_every_param_has_a_rule(switches):
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                         max_seq_len=32, **switches)
    specs = jax.tree_util.tree_leaves_with_path(sharding.param_specs(param_shapes(config), abstract(2, 2)),
                                                is_leaf=lambda x: isinstance(x, P))
    by_name = {sharding._path_name(path): s for path, s in specs}
    assert set(by_name) <= set(sharding.PARAM_DIMS)
    assert by_name["layers/attn/q_proj"] == P(None, None, "model", None)
    if switches:
        assert by_name["layers/attn/k_bias"] == P(None, "model", None)
        assert by_name["layers/attn/q_norm/scale"] == P(None, None)
        assert by_name["lm_head"] == P(None, "model")


def test_a_param_without_a_rule_is_named(monkeypatch):
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                         max_seq_len=32)
    table = {k: v for k, v in sharding.PARAM_DIMS.items() if k != "layers/mlp/up_proj"}
    monkeypatch.setattr(sharding, "PARAM_DIMS", table)
    with pytest.raises(KeyError, match="no sharding rule for 'layers/mlp/up_proj' \\(shape \\(2, 32, 48\\)\\)"):
        sharding.param_specs(param_shapes(config), abstract(1, 2))


@pytest.mark.parametrize("n_heads, n_kv_heads, model, repeats", [
    (8, 2, 8, 4), (8, 2, 4, 2), (8, 2, 2, 1), (8, 4, 8, 2), (8, 8, 4, 1),
    (8, 1, 8, 8),  # MQA: the single K/V head on every shard
    (12, 4, 8, 1),  # query heads do not split over 8: nothing to repeat for
    (6, 2, 4, 1),  # 6 query heads do not split over 4
])
def test_kv_head_repeats(n_heads, n_kv_heads, model, repeats):
    config = ModelConfig(vocab_size=64, d_model=48, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         head_dim=8, d_ff=48, max_seq_len=32)
    mesh = abstract(1, model)
    assert kv_head_repeats(config, mesh) == repeats
    assert sharding.mesh_config(config, mesh).n_kv_heads == n_kv_heads * repeats


# --- Sharded generation on 8 simulated devices ---

@pytest.fixture(scope="session")
def report(stories260k_dir, tmp_path_factory, worker_id) -> dict:
    def run() -> str:
        command = [PYTHON, str(REPO / "tests/llm_jax/sharded_generation.py"),
                   "--model", GQA, "--model", str(stories260k_dir / "stories260K.bin")]
        command += [arg for mesh in STORIES_MESHES for arg in ("--mesh", mesh)]
        command += [arg for mesh in MESHES[2:] for arg in ("--first-model-mesh", mesh)]
        command += ["--pallas-mesh", PALLAS_MESH]
        done = subprocess.run(command, env=cpu_devices_env(8), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout

    report = json.loads(computed_once("sharded_generation", run, tmp_path_factory, worker_id))
    assert report["devices"] == 8
    report["stories260K"] = report.pop(str(stories260k_dir / "stories260K.bin"))
    return report


RUNS = [(GQA, mesh) for mesh in MESHES] + [("stories260K", mesh) for mesh in STORIES_MESHES] + [
    (GQA, f"{PALLAS_MESH}+pallas")]


def _sizes(run_name: str) -> tuple[int, int]:
    """(data, model) of a run named like ``data=2,model=4`` or ``data=2,model=4+pallas``."""
    sizes = parse_mesh_spec(run_name.split("+")[0])
    return sizes["data"], sizes["model"]


@pytest.mark.parametrize("model, mesh", RUNS)
def test_sharded_generation_matches_one_device(report, model, mesh):
    one, sharded = report[model]["one_device"], report[model][mesh]
    assert sharded["tokens"] == one["tokens"]
    assert sharded["sampled_tokens"] == one["sampled_tokens"]  # per-row keys: the same draws
    # float32, summed in another order across shards. stories260K's logits reach |13.5|, where 1e-5 is
    # 10 ulps; the tolerance grows with the logit accordingly.
    np.testing.assert_allclose(sharded["logits"], one["logits"], atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(sharded["embeddings"], one["embeddings"], atol=1e-5)  # unit vectors


@pytest.mark.parametrize("model, mesh", RUNS)
def test_sharded_int8_cache_matches_one_device(report, model, mesh):
    """generate with ``kv_cache_dtype="int8"``: the same greedy tokens as one device's int8 cache, its
    values split like a float cache and their scales (a scale per token and K/V head) alike."""
    one, sharded = report[model]["one_device"], report[model][mesh]
    assert sharded["int8_tokens"] == one["int8_tokens"]
    data, model_size = _sizes(mesh)
    values = [None, "data" if data > 1 else None, None, "model" if model_size > 1 else None, None]
    for kv in ("k_LBSKH", "v_LBSKH"):
        assert _trimmed(sharded["int8_cache_specs"][f"{kv}/q_LBSKH"]) == _trimmed(values)
        assert _trimmed(sharded["int8_cache_specs"][f"{kv}/s_LBSK"]) == _trimmed(values[:4])


@pytest.mark.parametrize("model, mesh", RUNS)
def test_sharded_speculative_decoding_gives_plain_greedy_tokens(report, model, mesh):
    """Prompt lookup and a draft model (the same model, loaded on one device and laid out on the mesh by
    ``generate``, its K/V heads repeated where the mesh needs it): plain greedy decoding's tokens on every mesh."""
    one, sharded = report[model]["one_device"], report[model][mesh]
    assert sharded["speculative_tokens"] == {"ngram": one["tokens"], "draft": one["tokens"]}


def test_kv_heads_repeated_for_the_model_axis(report):
    one = np.array(report[GQA]["one_device"]["k_proj"])  # [L, D, K=2, H]
    for mesh, repeats in (("data=1,model=8", 4), ("data=2,model=4", 2), ("data=4,model=2", 1)):
        run = report[GQA][mesh]
        assert run["n_kv_heads"] == 2 * repeats
        np.testing.assert_array_equal(np.array(run["k_proj"]), np.repeat(one, repeats, axis=2))


# Expected layouts, written out by hand from the design (module docstring of llm_jax/sharding.py).
M, _ = "model", None
MEGATRON = {  # column-parallel Q/K/V and gate/up, row-parallel o/down, norms whole
    "final_norm/scale": [_], "layers/attn_norm/scale": [_, _], "layers/mlp_norm/scale": [_, _],
    "layers/attn/q_proj": [_, _, M, _], "layers/attn/k_proj": [_, _, M, _], "layers/attn/v_proj": [_, _, M, _],
    "layers/attn/o_proj": [_, M, _, _],
    "layers/mlp/gate_proj": [_, _, M], "layers/mlp/up_proj": [_, _, M], "layers/mlp/down_proj": [_, M, _],
}
EXPECTED_PARAMS = {
    # A vocabulary of 97 divides no axis: embedding and head split D instead; 2 K/V heads repeated to 8.
    (GQA, "data=1,model=8"): {**MEGATRON, "embedder/embedding": [_, M], "lm_head": [M, _]},
    # stories260K ties its head to the embedding. Its MLP width 172 does not split over 8: D does.
    ("stories260K", "data=1,model=8"): {**MEGATRON, "embedder/embedding": [M, _], "layers/mlp/gate_proj": [_, M, _],
                                        "layers/mlp/up_proj": [_, M, _], "layers/mlp/down_proj": [_, _, M]},
    ("stories260K", "data=2,model=4"): {**MEGATRON, "embedder/embedding": [M, _]},
}


def _trimmed(spec: list) -> list:
    """A spec without trailing unsharded dimensions (JAX may drop them; the layout is the same)."""
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


@pytest.mark.parametrize("model, mesh", sorted(EXPECTED_PARAMS))
def test_param_shardings(report, model, mesh):
    specs = {name: _trimmed(s) for name, s in report[model][mesh]["param_specs"].items()}
    assert specs == {name: _trimmed(s) for name, s in EXPECTED_PARAMS[(model, mesh)].items()}


@pytest.mark.parametrize("model, mesh", [run for run in RUNS if "+" not in run[1]])
def test_params_are_split_over_the_model_axis(report, model, mesh):
    """Each device holds 1/model of every weight matrix and all of every norm; nothing splits over data."""
    run = report[model][mesh]
    _, model_size = _sizes(mesh)
    for name, local in run["param_local_shapes"].items():
        share = 1 if name.endswith("norm/scale") else model_size
        assert np.prod(local) * share == np.prod(run["param_shapes"][name]), (name, local)
        assert "data" not in run["param_specs"][name]


@pytest.mark.parametrize("model, mesh", RUNS)
def test_cache_stays_sharded(report, model, mesh):
    run = report[model][mesh]
    data, model_size = _sizes(mesh)
    L, B, S, K, H = run["cache_shape"]
    expected_spec = [None, "data" if data > 1 else None, None, "model" if model_size > 1 else None, None]
    assert _trimmed(run["cache_specs"]["k_LBSKH"]) == _trimmed(expected_spec)
    assert _trimmed(run["cache_specs"]["v_LBSKH"]) == _trimmed(expected_spec)
    assert _trimmed(run["cache_specs"]["lengths_B"]) == _trimmed(expected_spec[1:2])
    assert run["cache_local_shape"] == [L, B // data, S, K // model_size, H]
    # What the host reads comes back whole.
    assert all(spec == [] for spec in run["state_specs"].values())


@pytest.mark.parametrize("model, mesh", RUNS)
def test_decode_loop_moves_no_cache(report, model, mesh):
    run = report[model][mesh]
    S = run["cache_shape"][2]
    # The control: gathering the cache is seen, as a collective whose shape has the S slots.
    assert any(S in dims for _, dims in run["control_collectives"])
    touching_cache = [(op, dims) for op, dims in run["decode_collectives"] if S in dims]
    assert touching_cache == []
    if _sizes(mesh)[1] > 1:
        # Megatron: the all-reduces of attention and MLP outputs are there.
        assert any(op == "all-reduce" for op, _ in run["decode_collectives"])
