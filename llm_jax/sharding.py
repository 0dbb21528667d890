"""Sharding: the device mesh, and the one table that lays params and the KV cache out over it.

Parallelism is GSPMD's: params and cache are ``jax.Array`` s with a ``NamedSharding``, the jitted stages
(``prefill``, ``decode``) declare the shardings of what they take and return, and XLA partitions the
program. The mesh has two axes:

- ``model``: Megatron-style tensor parallelism. Q/K/V and gate/up projections are split by their output
  (heads, MLP hidden), o/down projections by their input, so attention and the MLP each end in one
  all-reduce; the embedding table and LM head are split by vocabulary; norms are replicated. The KV
  cache is split by K/V head, so decode never moves it.
- ``data``: data parallelism over the batch (prompts, and the cache's batch rows).

The table below speaks the dimension key of ``llm_jax/__init__.py``: each param is described by the
letters of its dimensions (``q_proj`` is ``LDNH``) and each letter is mapped to a mesh axis.

**Fewer K/V heads than the model axis** (say K = 2 on ``model=8``): each K/V head is *repeated*
r = model / K times — the config's ``n_kv_heads`` becomes K·r and the k/v projections are repeated head
by head (:func:`shard_params`) — so every model shard holds one K/V head and exactly the query heads that
read it, and the cache still splits evenly. The repeated model computes the same function. (Splitting
the head dimension instead would cut RoPE's rotate-halves pairs across devices and need an all-reduce
of the attention scores in every layer.)

**Dimensions not divisible by their mesh axis** (a vocabulary of 32001 on 8 devices, an MLP width of
172): that dimension is replicated, and a weight matrix then splits its model width ``D`` over the axis
instead, so its memory is still divided; results are the same, only the collectives differ. A batch not
divisible by ``data`` is replicated over it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from llm_jax.config import ModelConfig
from llm_jax.kv_cache import Int8KV, KVCache, PagedBatch, PagedKVCache, cache_dtype
from llm_jax.quantization import QuantizedArray

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)

# The table. Each dimension letter → the mesh axis that splits it; letters not listed are replicated.
RULES: Mapping[str, str] = {
    "B": DATA,  # batch
    "V": MODEL,  # vocabulary: embedding rows, LM head columns, logits
    "N": MODEL,  # query heads
    "K": MODEL,  # K/V heads (of the projections and of the cache)
    "F": MODEL,  # MLP hidden
}
# When a tensor's dimensions that want the model axis are all indivisible by it, D takes the axis (a
# weight matrix stays split); a tensor with no such dimension (a norm scale) stays replicated.
FALLBACK: Mapping[str, str] = {MODEL: "D"}

# Every param, by its path in the params pytree, as the letters of its dimensions.
PARAM_DIMS: Mapping[str, str] = {
    "embedder/embedding": "VD",
    "lm_head": "DV",
    "score": "DC",  # a classifier's head: small, replicated
    "final_norm/scale": "D",
    "layers/attn_norm/scale": "LD",
    "layers/mlp_norm/scale": "LD",
    "layers/post_attn_norm/scale": "LD",
    "layers/post_mlp_norm/scale": "LD",
    "layers/attn/q_proj": "LDNH",
    "layers/attn/k_proj": "LDKH",
    "layers/attn/v_proj": "LDKH",
    "layers/attn/o_proj": "LNHD",
    "layers/attn/q_bias": "LNH",
    "layers/attn/k_bias": "LKH",
    "layers/attn/v_bias": "LKH",
    "layers/attn/q_norm/scale": "LH",
    "layers/attn/k_norm/scale": "LH",
    # OLMo 2's q/k norms over all heads: split with the heads (XLA all-reduces the sum of squares across them).
    "layers/attn/q_proj_norm/scale": "LNH",
    "layers/attn/k_proj_norm/scale": "LKH",
    "layers/mlp/gate_proj": "LDF",
    "layers/mlp/up_proj": "LDF",
    "layers/mlp/down_proj": "LFD",
    # A mixture of experts: every expert split as the dense MLP is (by F), the small router replicated.
    "layers/moe/router": "LDE",
    "layers/moe/gate_proj": "LEDF",
    "layers/moe/up_proj": "LEDF",
    "layers/moe/down_proj": "LEFD",
    # Its shared expert (Qwen2-MoE) as a dense MLP, the gate of its output (a [D] vector) replicated.
    "layers/moe/shared_gate_proj": "LDF",
    "layers/moe/shared_up_proj": "LDF",
    "layers/moe/shared_down_proj": "LFD",
    "layers/moe/shared_expert_gate": "LD",
}
# The KV cache, by field.
CACHE_DIMS: Mapping[str, str] = {"k_LBSKH": "LBSKH", "v_LBSKH": "LBSKH", "lengths_B": "B",
                                  # an int8 cache: values and their scales split alike, by row and K/V head
                                  "k_LBSKH/q_LBSKH": "LBSKH", "k_LBSKH/s_LBSK": "LBSK",
                                  "v_LBSKH/q_LBSKH": "LBSKH", "v_LBSKH/s_LBSK": "LBSK",
                                  "k_LPZKH": "LPZKH", "v_LPZKH": "LPZKH",  # the paged cache: P, Z whole
                                  # an int8 paged cache: values and their scales split alike, by K/V head
                                  "k_LPZKH/q_LBSKH": "LPZKH", "k_LPZKH/s_LBSK": "LPZK",
                                  "v_LPZKH/q_LBSKH": "LPZKH", "v_LPZKH/s_LBSK": "LPZK"}


class MeshError(ValueError):
    """A mesh that cannot be built from the given spec and devices."""


# The mesh.
def parse_mesh_spec(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` → ``{"data": 2, "model": 4}``; an axis left out is inferred by :func:`make_mesh`."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", part)
        if match is None:
            raise MeshError(f"bad mesh axis {part!r} in {text!r}; expected e.g. 'data=2,model=4'")
        name, size = match.group(1), int(match.group(2))
        if name not in AXES:
            raise MeshError(f"unknown mesh axis {name!r} in {text!r}; the axes are {', '.join(AXES)}")
        if name in sizes:
            raise MeshError(f"mesh axis {name!r} given twice in {text!r}")
        if size < 1:
            raise MeshError(f"mesh axis {name}={size} in {text!r} must be at least 1")
        sizes[name] = size
    if not sizes:
        raise MeshError(f"empty mesh spec {text!r}; expected e.g. 'data=2,model=4'")
    return sizes


def make_mesh(shape: str | Mapping[str, int] | None = None, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data`` × ``model`` mesh over ``devices`` (default: every device of every process).

    ``shape`` is a spec such as ``"data=2,model=4"`` or a mapping; an axis left out takes the remaining
    devices (``"model=4"`` on 8 devices is ``data=2,model=4``). Without a shape, ``model`` spans each
    process's devices and ``data`` the processes: tensor parallelism inside a host, data parallelism
    across hosts. A mesh smaller than the devices uses the first ones (single-process only).
    """
    devices = list(jax.devices() if devices is None else devices)
    if shape is None:
        shape = {DATA: jax.process_count(), MODEL: len(devices) // jax.process_count()}
    sizes = parse_mesh_spec(shape if isinstance(shape, str) else ",".join(f"{k}={v}" for k, v in shape.items()))
    missing = [a for a in AXES if a not in sizes]
    if len(missing) == 2:
        raise MeshError("a mesh shape needs at least one of the axes data, model")
    if missing:
        given = sizes[AXES[1 - AXES.index(missing[0])]]
        if len(devices) % given:
            raise MeshError(f"cannot infer mesh axis {missing[0]!r}: {len(devices)} devices are not a multiple "
                            f"of {given}")
        sizes[missing[0]] = len(devices) // given
    used = sizes[DATA] * sizes[MODEL]
    if used > len(devices):
        raise MeshError(f"mesh data={sizes[DATA]},model={sizes[MODEL]} needs {used} devices, "
                        f"but {len(devices)} are available")
    if used < len(devices) and jax.process_count() > 1:
        raise MeshError(f"mesh data={sizes[DATA]},model={sizes[MODEL]} uses {used} of {len(devices)} devices; "
                        "with several processes the mesh must use every device")
    # Auto axes: GSPMD propagates shardings through the model (jax.make_mesh defaults to Explicit axes).
    return jax.make_mesh((sizes[DATA], sizes[MODEL]), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices[:used])


# Dimension letters → PartitionSpec.
def spec(dims: str, shape: Sequence[int], mesh: Mesh | AbstractMesh) -> PartitionSpec:
    """The ``PartitionSpec`` of an array of ``shape`` whose dimensions are the letters ``dims``.

    Each dimension takes the mesh axis :data:`RULES` gives its letter when its size is divisible by the
    axis and the axis is not already used by an earlier dimension; axes of size 1 are left out.
    """
    if len(dims) != len(shape):
        raise ValueError(f"dimensions {dims!r} do not match an array of shape {tuple(shape)}")
    axes: list[str | None] = [None] * len(dims)

    def take(i: int, axis: str) -> None:
        if mesh.shape[axis] > 1 and shape[i] % mesh.shape[axis] == 0 and axis not in axes:
            axes[i] = axis

    for i, letter in enumerate(dims):
        if letter in RULES:
            take(i, RULES[letter])
    for axis, letter in FALLBACK.items():
        wanted = any(RULES.get(d) == axis for d in dims)
        if wanted and letter in dims:
            take(dims.index(letter), axis)
    return PartitionSpec(*axes)


def named(dims: str, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec(dims, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _dims(table: Mapping[str, str], table_name: str, name: str, shape: Sequence[int]) -> str:
    if name not in table:
        raise KeyError(f"no sharding rule for {name!r} (shape {tuple(shape)}); add its dimensions to "
                       f"{table_name} in llm_jax/sharding.py")
    return table[name]


def _specs(tree: Any, table: Mapping[str, str], table_name: str, mesh: Mesh | AbstractMesh) -> Any:
    """``tree`` (arrays or shapes) with each leaf replaced by its PartitionSpec from ``table``."""

    def leaf(path, x):
        logical = spec(_dims(table, table_name, _path_name(path), x.shape), x.shape, mesh)
        return quantized_specs(x, logical, mesh) if isinstance(x, QuantizedArray) else logical

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(x, QuantizedArray))


def quantized_specs(q: QuantizedArray, logical: PartitionSpec, mesh: Mesh | AbstractMesh) -> QuantizedArray:
    """The specs of a quantized leaf's ``values`` and ``scales`` (a :class:`QuantizedArray` holding them),
    from ``logical``, the spec of the array it stands for. Its inputs and its outputs are each one axis
    (row-major over the logical axes): one keeps a mesh axis where the logical spec splits its leading
    (major) axis, which cuts the flat axis into the same contiguous pieces, and where the stored length
    (packed inputs, groups) divides evenly; otherwise it is whole."""
    axes = tuple(logical) + (None,) * (len(q.shape) - len(logical))
    lead, n_in, n_out = len(q.lead), len(q.in_shape), len(q.out_shape)
    inner = axes[lead:]
    out_axes, in_axes = (inner[:n_out], inner[n_out:]) if q.transposed else (inner[n_in:], inner[:n_in])

    n_out_axis = out_axes[0] if out_axes and out_axes[0] is not None and q.N % mesh.shape[out_axes[0]] == 0 else None
    k_axis = k_scales = in_axes[0] if in_axes else None
    if k_axis is not None:  # values and scales split at the same inputs, whole groups and bytes in each piece
        m = mesh.shape[k_axis]
        if q.K % m or (q.bits == 4 and (q.K // 2) % m):
            k_axis = k_scales = None
        elif q.n_groups == 1:
            k_scales = None  # one scale per output: every piece of the inputs reads it
        elif q.K % (q.group_size * m):
            k_axis = k_scales = None

    def of(k: str | None) -> PartitionSpec:
        return PartitionSpec(*axes[:lead], *((n_out_axis, k) if q.transposed else (k, n_out_axis)))

    return dataclasses.replace(q, values=of(k_axis), scales=of(k_scales),
                               offsets=None if q.offsets is None else of(k_scales))


def _named(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_specs(params: Any, mesh: Mesh | AbstractMesh) -> Any:
    """``params`` (arrays, or their shapes: ``llm_jax.model.param_shapes(config)``) with each leaf
    replaced by its ``PartitionSpec`` on ``mesh``."""
    return _specs(params, PARAM_DIMS, "PARAM_DIMS", mesh)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """Like :func:`param_specs`, with each leaf's ``NamedSharding``."""
    return _named(param_specs(params, mesh), mesh)


def _kv_shapes(config: ModelConfig, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct | Int8KV:
    """The shape of a cache's keys (or values) ``shape`` [..., H] holding ``dtype`` (int8: with its scales)."""
    if cache_dtype(config, dtype) == jnp.int8:
        return Int8KV(jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct(shape[:-1], jnp.float32))
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def cache_specs(config: ModelConfig, batch_size: int, max_len: int, mesh: Mesh | AbstractMesh,
                dtype=None) -> KVCache:
    """A :class:`KVCache` of ``dtype`` (None: the compute dtype; int8: an :class:`Int8KV` of values and
    scales) holding the ``PartitionSpec`` of each of its fields."""
    kv = _kv_shapes(config, (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim), dtype)
    shapes = KVCache(k_LBSKH=kv, v_LBSKH=kv, lengths_B=jax.ShapeDtypeStruct((batch_size,), jnp.int32))
    return _specs(shapes, CACHE_DIMS, "CACHE_DIMS", mesh)


def cache_shardings(config: ModelConfig, batch_size: int, max_len: int, mesh: Mesh, dtype=None) -> KVCache:
    """A :class:`KVCache` holding the ``NamedSharding`` of each of its fields (pass to ``init_cache`` with the
    same ``dtype``)."""
    return _named(cache_specs(config, batch_size, max_len, mesh, dtype), mesh)


def paged_cache_shardings(config: ModelConfig, num_pages: int, page_size: int, mesh: Mesh,
                          dtype=None) -> PagedKVCache:
    """A :class:`PagedKVCache` holding the ``NamedSharding`` of each of its fields (pass to
    ``init_paged_cache`` with the same ``dtype``): K/V heads split over ``model``, as the params' and the
    other cache's (an int8 cache's scales as its values)."""
    pages = _kv_shapes(config, (config.n_layers, num_pages, page_size, config.n_kv_heads, config.head_dim), dtype)
    return _named(_specs(PagedKVCache(k_LPZKH=pages, v_LPZKH=pages), CACHE_DIMS, "CACHE_DIMS", mesh), mesh)


# Constraints inside jitted stages: declare what an input or output looks like. No-ops without a mesh.
def constrain(x: jax.Array, dims: str, mesh: Mesh | None) -> jax.Array:
    """``x`` (dimensions ``dims``) laid out by the table on ``mesh``."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named(dims, x.shape, mesh))


def constrain_cache(cache: KVCache | PagedKVCache, mesh: Mesh | None) -> KVCache | PagedKVCache:
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, _named(_specs(cache, CACHE_DIMS, "CACHE_DIMS", mesh), mesh))


def constrain_replicated(tree: Any, mesh: Mesh | None) -> Any:
    """Every leaf of ``tree`` whole on every device: what the host reads (tokens, decode state)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: replicated(mesh), tree))


# Kernels that XLA cannot partition (Pallas calls) run on each device's shard.
def attention_on_shards(kernel: Callable, mesh: Mesh | None, q_BxNH: jax.Array, k_BSKH: jax.Array,
                        v_BSKH: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """``kernel(q, k, v, lengths)`` — an attention kernel, q [B, (T,) N, H] — on every device's shard:
    rows split over ``data``, heads over ``model``. Query and K/V heads are split together or not at all,
    so the query heads of a shard read exactly the K/V heads it holds. Without a mesh, one plain call.
    """
    if mesh is None:
        return kernel(q_BxNH, k_BSKH, v_BSKH, lengths_B)
    q_dims = "BTNH" if q_BxNH.ndim == 4 else "BNH"
    heads_split = (MODEL in spec(q_dims, q_BxNH.shape, mesh)) and (MODEL in spec("BSKH", k_BSKH.shape, mesh))
    heads = MODEL if heads_split else None
    (rows,) = spec("B", lengths_B.shape, mesh)
    q_spec = PartitionSpec(rows, *[None] * (q_BxNH.ndim - 3), heads, None)
    kv_spec = PartitionSpec(rows, None, heads, None)
    # check_vma=False: Pallas calls carry no varying-manual-axes types.
    on_shards = jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(rows)),
                              out_specs=q_spec, check_vma=False)
    return on_shards(q_BxNH, k_BSKH, v_BSKH, lengths_B)



def stacked_attention_on_shards(kernel: Callable, mesh: Mesh | None, q_BNH: jax.Array, k_LBSKH: jax.Array,
                                v_LBSKH: jax.Array, layer: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """``kernel(q, k, v, lengths, layer=layer)`` — a decode attention kernel reading layer ``layer`` of the
    stacked caches [L, B, S, K, H] in place — on every device's shard, split as :func:`attention_on_shards`."""
    if mesh is None:
        return kernel(q_BNH, k_LBSKH, v_LBSKH, lengths_B, layer=layer)
    heads_split = (MODEL in spec("BNH", q_BNH.shape, mesh)) and (MODEL in spec("LBSKH", k_LBSKH.shape, mesh))
    heads = MODEL if heads_split else None
    (rows,) = spec("B", lengths_B.shape, mesh)
    q_spec = PartitionSpec(rows, heads, None)
    kv_spec = PartitionSpec(None, rows, None, heads, None)
    on_shards = jax.shard_map(lambda q, k, v, n, at: kernel(q, k, v, n, layer=at), mesh=mesh,
                              in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(rows), PartitionSpec()),
                              out_specs=q_spec, check_vma=False)
    return on_shards(q_BNH, k_LBSKH, v_LBSKH, lengths_B, layer)


def paged_attention_on_shards(kernel: Callable, mesh: Mesh | None, q_TNH: jax.Array, k_LPZKH: jax.Array,
                              v_LPZKH: jax.Array, layer: jax.Array, batch: PagedBatch) -> jax.Array:
    """``kernel(q, k, v, block_tables, query_start, num_tokens, seq_lens, layer=layer)`` — a ragged paged
    attention kernel — on every device's shard: query and K/V heads over ``model`` (together or not at
    all), tokens, pages and the batch's tables whole. Int8 pages come as pairs (values [L, P, Z, K, H],
    scales [L, P, Z, K]), the scales split by K/V head as the values are. Without a mesh, one plain call."""
    tables = (batch.block_tables_BX, batch.query_start_B, batch.num_tokens_B, batch.seq_lens_B)
    if mesh is None:
        return kernel(q_TNH, k_LPZKH, v_LPZKH, *tables, layer=layer)
    pair = isinstance(k_LPZKH, tuple)
    values_shape = k_LPZKH[0].shape if pair else k_LPZKH.shape
    heads_split = (MODEL in spec("TNH", q_TNH.shape, mesh)) and (MODEL in spec("LPZKH", values_shape, mesh))
    heads = MODEL if heads_split else None
    q_spec, kv_spec = PartitionSpec(None, heads, None), PartitionSpec(None, None, None, heads, None)
    if pair:
        kv_spec = (kv_spec, PartitionSpec(None, None, None, heads))
    on_shards = jax.shard_map(lambda q, k, v, at, *t: kernel(q, k, v, *t, layer=at), mesh=mesh,
                              in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(), *[PartitionSpec()] * 4),
                              out_specs=q_spec, check_vma=False)
    return on_shards(q_TNH, k_LPZKH, v_LPZKH, layer, *tables)

# Placing params.
# (A norm over all K/V heads, repeated, has the same mean square: each head counts r times.)
_KV_HEAD_PARAMS = ("layers/attn/k_proj", "layers/attn/v_proj", "layers/attn/k_bias", "layers/attn/v_bias",
                   "layers/attn/k_proj_norm/scale")


def kv_head_repeats(config: ModelConfig, mesh: Mesh | AbstractMesh) -> int:
    """How many times each K/V head is repeated on ``mesh``: model / K when K < model divides it (and
    the query heads split evenly, so each shard's query heads read only its K/V head), else 1."""
    model, K, N = mesh.shape[MODEL], config.n_kv_heads, config.n_heads
    if K < model and model % K == 0 and N % model == 0:
        return model // K
    return 1


def mesh_config(config: ModelConfig, mesh: Mesh | AbstractMesh) -> ModelConfig:
    """The config of ``config``'s model laid out on ``mesh`` (K/V heads repeated where needed)."""
    repeats = kv_head_repeats(config, mesh)
    return config.replace(n_kv_heads=config.n_kv_heads * repeats) if repeats > 1 else config


def shard_params(config: ModelConfig, params: Any, mesh: Mesh, *, dtype=None) -> tuple[ModelConfig, Any]:
    """Lay ``params`` of ``config`` out on ``mesh``: the config to run them with (:func:`mesh_config`)
    and params as sharded ``jax.Array`` s, cast to ``dtype`` if given.

    Host (numpy) params are copied shard by shard, so each device receives only its own shard (and each
    process provides only its own devices' shards). Device params are resharded by XLA.
    """
    repeats = kv_head_repeats(config, mesh)

    def place(path, x):
        name = _path_name(path)
        if isinstance(x, QuantizedArray):
            return _place_quantized(x, name, mesh, repeats if name in _KV_HEAD_PARAMS else 1)
        heads_axis = x.ndim - 2 if repeats > 1 and name in _KV_HEAD_PARAMS else None  # [..., K, H]
        shape = [n * repeats if axis == heads_axis else n for axis, n in enumerate(x.shape)]
        sharding = named(_dims(PARAM_DIMS, "PARAM_DIMS", name, x.shape), shape, mesh)
        out_dtype = jnp.dtype(dtype or x.dtype)
        if isinstance(x, jax.Array):
            return _reshard(x, sharding, out_dtype, heads_axis, repeats)
        return jax.make_array_from_callback(tuple(shape), sharding,
                                            _shard_reader(np.asarray(x), out_dtype, heads_axis, repeats),
                                            dtype=out_dtype)

    return mesh_config(config, mesh), jax.tree_util.tree_map_with_path(
        place, params, is_leaf=lambda x: isinstance(x, QuantizedArray))


def _place_quantized(q: QuantizedArray, name: str, mesh: Mesh, repeats: int) -> QuantizedArray:
    """A quantized leaf on ``mesh``, its K/V heads (its outputs [K, H]) repeated ``repeats`` times."""
    if repeats > 1:
        K, H = q.out_shape

        def repeat(a):  # [..., K·H] → [..., K·r·H], head k read by heads k·r ... k·r + r - 1
            a = jnp.asarray(a)
            return jnp.repeat(a.reshape(*a.shape[:-1], K, H), repeats, axis=-2).reshape(*a.shape[:-1], -1)

        q = dataclasses.replace(q, values=repeat(q.values), scales=repeat(q.scales),
                                offsets=None if q.offsets is None else repeat(q.offsets), out_shape=(K * repeats, H))
    specs = quantized_specs(q, spec(_dims(PARAM_DIMS, "PARAM_DIMS", name, q.shape), q.shape, mesh), mesh)
    return dataclasses.replace(q, values=jax.device_put(q.values, NamedSharding(mesh, specs.values)),
                               scales=jax.device_put(q.scales, NamedSharding(mesh, specs.scales)),
                               offsets=None if q.offsets is None else jax.device_put(
                                   q.offsets, NamedSharding(mesh, specs.offsets)))


def _shard_reader(x: np.ndarray, dtype, heads_axis: int | None, repeats: int) -> Callable:
    """``index → x[index]`` as ``dtype``, where along ``heads_axis`` (if any) index i reads head i // repeats."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if heads_axis is None:
            return np.asarray(x[index], dtype=dtype)
        heads = np.arange(x.shape[heads_axis] * repeats)[index[heads_axis]] // repeats
        rest = tuple(slice(None) if i == heads_axis else s for i, s in enumerate(index))
        return np.asarray(np.take(x[rest], heads, axis=heads_axis), dtype=dtype)

    return read


@functools.partial(jax.jit, static_argnames=("sharding", "dtype", "heads_axis", "repeats"))
def _reshard_jit(x, *, sharding, dtype, heads_axis, repeats):
    if heads_axis is not None:
        # Whole K/V projections (small) on every device first: each then keeps the heads it repeats.
        x = jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, PartitionSpec()))
        x = jnp.repeat(x, repeats, axis=heads_axis)
    return jax.lax.with_sharding_constraint(x.astype(dtype), sharding)


def _reshard(x: jax.Array, sharding: NamedSharding, dtype, heads_axis: int | None, repeats: int) -> jax.Array:
    if heads_axis is None and x.dtype == dtype:
        return jax.device_put(x, sharding)
    if x.sharding.device_set != sharding.device_set:  # not on the mesh yet (one device's params): there first
        x = x.astype(dtype)
        return jax.device_put(x if heads_axis is None else jnp.repeat(x, repeats, axis=heads_axis), sharding)
    return _reshard_jit(x, sharding=sharding, dtype=dtype, heads_axis=heads_axis, repeats=repeats)
