"""The llm_jax checkpoint: a folder that ``load`` restores straight into the requested dtype and sharding.

    <name>/
      checkpoint.json   format_version, the ModelConfig, generation defaults (EOS and stop ids) and a
                        manifest of every tensor: shape, dtype and checksum (``weights/checksum.py``)
      params/           the params pytree as an orbax-checkpoint (TensorStore) folder; a quantized weight
                        (``llm_jax.quantization``, as the config's ``quantization`` says) is two tensors,
                        ``<path>/values`` (int8 or packed uint8) and ``<path>/scales`` (float32)
      tokenizer.model | tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json
                        copied from the source, so ``load_tokenizer(<name>)`` works

A checkpoint is written into ``<name>.tmp-<random>/`` beside its final place and renamed at the end, so
an interrupted or failed save never leaves a partial checkpoint under the final name. ``checkpoint.json``
is written last. On load every tensor is checked against the manifest and the config before anything is
read, and its checksum after (where its shards live): a corrupt checkpoint raises
:class:`CheckpointError` naming the tensor, never loads as a silently different model.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import os
import pathlib
import secrets
import shutil
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from llm_jax.config import ConfigError, ModelConfig
from llm_jax.model import Params, param_shapes
from llm_jax.weights import checksum
from llm_jax.weights.layout import WeightsError
from llm_jax.weights.placement import (Path, ShardingArg, expected_shapes, leaves_by_path, resolve_shardings,
                                       tensor_name, tree_from_paths)

FORMAT_VERSION = 1
METADATA_FILE = "checkpoint.json"
PARAMS_DIR = "params"
# Files that make a folder loadable by ``load_tokenizer`` and carry the generation defaults.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
PARAM_DTYPES = ("float32", "bfloat16", "float16")
# Loading into another dtype than stored holds this much of the stored dtype at once, besides the result.
# Tensors are stored in chunks of at most this size, so a shard is read without staging its whole tensor.
CHUNK_BYTES = 16 << 20


class CheckpointError(WeightsError):
    """An llm_jax checkpoint that is missing, corrupt, or contradicts its own config."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """What a checkpoint says besides config and params."""

    path: pathlib.Path
    format_version: int
    param_dtype: str  # as stored (``load_checkpoint(dtype=...)`` may cast)
    eos_ids: tuple[int, ...]  # generation ends on these
    stop_ids: tuple[int, ...]  # format-specific extra stops (llama2.c models end a story with BOS)
    tokenizer_files: tuple[str, ...]
    source: str | None  # what it was converted from, if it was


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an llm_jax checkpoint folder (it has a ``checkpoint.json``)."""
    return (pathlib.Path(path) / METADATA_FILE).is_file()


# --- saving ---------------------------------------------------------------------------------------------


def save_checkpoint(path: str | os.PathLike, *, config: ModelConfig, params: Params,
                    tokenizer_files: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike | bytes] = (),
                    eos_ids: Sequence[int] = (), stop_ids: Sequence[int] = (), force: bool = False,
                    progress: Callable[[str], None] | None = None, source: str | None = None) -> pathlib.Path:
    """Write ``params`` (numpy or jax arrays, possibly sharded) as an llm_jax checkpoint at ``path``.

    The params' dtype (one float dtype for all tensors) is what is stored; ``config.param_dtype`` is set to
    it. ``tokenizer_files`` are copied under their own names, or under the keys of a mapping
    ``{name in checkpoint: source file, or the file's content as bytes}``. ``progress(tensor)`` is called
    once per tensor. An existing ``path`` is replaced only with ``force``, and only if it is an llm_jax
    checkpoint itself.
    """
    path = pathlib.Path(path)
    stored_dtype = _check_params(params, config, where=str(path))
    config = config.replace(param_dtype=stored_dtype)
    copies = _tokenizer_copies(tokenizer_files)
    with staging_folder(path, force=force) as staging:
        leaves = leaves_by_path(params)
        sums = checksum.checksums(leaves)
        manifest = {}
        for tensor_path, leaf in leaves.items():
            name = tensor_name(tensor_path)
            manifest[name] = {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name,
                              "checksum": sums[tensor_path]}
            if progress is not None:
                progress(name)
        with ocp.Checkpointer(_save_handler()) as checkpointer:  # synchronous
            plain = tree_from_paths(leaves)  # quantized leaves as {"values": ..., "scales": ...}
            chunks = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), plain)
            checkpointer.save((staging / PARAMS_DIR).absolute(), args=ocp.args.PyTreeSave(plain, save_args=chunks))
        for name, file in copies.items():
            if isinstance(file, bytes):
                (staging / name).write_bytes(file)
            else:
                shutil.copyfile(file, staging / name)
        metadata = {
            "format_version": FORMAT_VERSION,
            "config": config.to_dict(),
            "generation": {"eos_ids": [int(i) for i in eos_ids], "stop_ids": [int(i) for i in stop_ids]},
            "tokenizer_files": sorted(copies),
            "params": {"format": "orbax-checkpoint", "dtype": stored_dtype, "checksum": checksum.ALGORITHM,
                       "tensors": manifest},
            "source": source,
        }
        # Written last: a folder with a checkpoint.json is complete.
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")
    return path


def _save_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler, set up to write host arrays without copying them.

    By default orbax deep-copies numpy arrays (against concurrent modification; our save is synchronous
    and owns them) and zstd-compresses every chunk (weights gain ~10% and it buffers another copy), which
    together hold two extra copies of the model in host memory while saving.
    """
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)


def check_destination(path: pathlib.Path, *, force: bool) -> None:
    """Refuse to overwrite ``path`` without ``force``, and anything but a checkpoint even with it."""
    if not path.exists():
        return
    if not force:
        raise FileExistsError(f"{path} already exists; pass force=True (--force) to overwrite it")
    if not (is_checkpoint(path) or (path.is_dir() and not any(path.iterdir()))):
        raise FileExistsError(f"refusing to overwrite {path}: it is not an llm_jax checkpoint "
                              f"(no {METADATA_FILE}) nor an empty folder")


@contextlib.contextmanager
def staging_folder(path: pathlib.Path, *, force: bool):
    """A fresh ``<path>.tmp-<random>/`` that becomes ``path`` when the block succeeds, and is deleted
    when it raises. A killed process leaves only the ``.tmp-`` folder behind, never ``path``."""
    check_destination(path, force=force)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        yield staging
        check_destination(path, force=force)  # it may have appeared meanwhile
        if path.exists():
            retired = path.with_name(f"{path.name}.tmp-old-{secrets.token_hex(4)}")
            path.rename(retired)
            staging.rename(path)
            shutil.rmtree(retired)
        else:
            staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _check_params(params: Params, config: ModelConfig, *, where: str) -> str:
    """The params' common float dtype, after checking every tensor against the config's shapes (and a
    quantized weight's integers and scales against their dtypes)."""
    expected = expected_shapes(config)
    given = leaves_by_path(params)
    _check_tensor_set(expected, set(given), where=where, what="params")
    fixed = _quantized_dtypes(config)
    for path, leaf in given.items():
        if tuple(leaf.shape) != expected[path]:
            raise CheckpointError(f"{where}: tensor {tensor_name(path)!r} has shape {tuple(leaf.shape)}, "
                                  f"expected {expected[path]} from the config")
        if path in fixed and np.dtype(leaf.dtype).name != fixed[path]:
            raise CheckpointError(f"{where}: quantized tensor {tensor_name(path)!r} is {np.dtype(leaf.dtype).name}, "
                                  f"expected {fixed[path]}")
    dtypes = sorted({np.dtype(leaf.dtype).name for path, leaf in given.items() if path not in fixed})
    if len(dtypes) != 1 or dtypes[0] not in PARAM_DTYPES:
        raise CheckpointError(f"{where}: params must all have one dtype out of {PARAM_DTYPES}, got {dtypes}")
    return dtypes[0]


def _quantized_dtypes(config: ModelConfig) -> dict[Path, str]:
    """The dtype of each quantized weight's tensors (its ``values``, ``scales`` and ``offsets``), by path; the other
    tensors have the params' float dtype."""
    return {path: np.dtype(s.dtype).name for path, s in leaves_by_path(param_shapes(config)).items()
            if path[-1] in ("values", "scales", "offsets")}


def _dtypes(config: ModelConfig, manifest: Mapping[Path, Any], float_dtype: str) -> dict[Path, str]:
    fixed = _quantized_dtypes(config)
    return {p: fixed.get(p, float_dtype) for p in manifest}


def _check_tensor_set(expected: Mapping[Path, Any], given: set[Path], *, where: str, what: str) -> None:
    missing = sorted(tensor_name(p) for p in set(expected) - given)
    extra = sorted(tensor_name(p) for p in given - set(expected))
    if missing:
        raise CheckpointError(f"{where}: {what} lack tensors {missing} that the config requires")
    if extra:
        raise CheckpointError(f"{where}: {what} have tensors {extra} that the config does not describe")


def _tokenizer_copies(files: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike | bytes]
                      ) -> dict[str, pathlib.Path | bytes]:
    named = ({str(k): v if isinstance(v, bytes) else pathlib.Path(v) for k, v in files.items()}
             if isinstance(files, Mapping) else {pathlib.Path(f).name: pathlib.Path(f) for f in files})
    for name, file in named.items():
        if isinstance(file, pathlib.Path) and not file.is_file():
            raise FileNotFoundError(f"tokenizer file {file} does not exist")
        if name in (METADATA_FILE, PARAMS_DIR) or "/" in name:
            raise ValueError(f"cannot store a tokenizer file as {name!r} in a checkpoint")
    return named


# --- loading --------------------------------------------------------------------------------------------


def read_metadata(path: str | os.PathLike) -> tuple[ModelConfig, CheckpointMeta, dict[Path, dict]]:
    """Config, meta and tensor manifest of a checkpoint, validated against each other; reads no params."""
    path = pathlib.Path(path)
    file = path / METADATA_FILE
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not file.is_file():
        raise CheckpointError(f"{path} is not an llm_jax checkpoint: it has no {METADATA_FILE}")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON (truncated or corrupt?): {e}") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CheckpointError(f"{file}: format_version {version!r} is not supported (this llm_jax reads version "
                              f"{FORMAT_VERSION}{'; the checkpoint is from a newer llm_jax' if newer else ''})")
    try:
        config = ModelConfig.from_dict(data["config"])
        generation, params = data["generation"], data["params"]
        tensors = params["tensors"]
        meta = CheckpointMeta(path=path, format_version=version, param_dtype=str(params["dtype"]),
                              eos_ids=tuple(int(i) for i in generation["eos_ids"]),
                              stop_ids=tuple(int(i) for i in generation["stop_ids"]),
                              tokenizer_files=tuple(data.get("tokenizer_files", ())), source=data.get("source"))
    except ConfigError as e:
        raise ConfigError(f"{file}: invalid model config: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: malformed checkpoint metadata ({type(e).__name__}: {e})") from None
    if params.get("checksum") != checksum.ALGORITHM:
        raise CheckpointError(f"{file}: unknown checksum algorithm {params.get('checksum')!r}")
    if meta.param_dtype != config.param_dtype:
        raise CheckpointError(f"{file}: params dtype {meta.param_dtype!r} contradicts the config's "
                              f"param_dtype {config.param_dtype!r}")
    manifest = {tuple(name.split("/")): entry for name, entry in tensors.items()}
    expected = expected_shapes(config)
    _check_tensor_set(expected, set(manifest), where=str(file), what="the tensor manifest")
    dtypes = _dtypes(config, manifest, meta.param_dtype)
    for p, entry in manifest.items():
        if tuple(entry["shape"]) != expected[p] or entry["dtype"] != dtypes[p]:
            raise CheckpointError(
                f"{file}: the config contradicts tensor {tensor_name(p)!r}: stored as {tuple(entry['shape'])} "
                f"{entry['dtype']}, the config implies {expected[p]} {dtypes[p]}")
    return config, meta, manifest


def load_checkpoint(path: str | os.PathLike, *, dtype=None, sharding: ShardingArg = None,
                    verify: bool = True) -> tuple[ModelConfig, Params, CheckpointMeta]:
    """Restore a checkpoint: ``(config, params, meta)``.

    Each tensor is read from disk shard by shard onto the devices its ``sharding`` names (see
    ``weights/placement.py``; default: the first device), so no full host copy is made: host memory
    peaks near one copy of what the devices hold (``tests/llm_jax/sharded_load_memory.py`` measures
    it). With ``verify`` every tensor's checksum is checked where its shards live, then the tensor is
    cast to ``dtype`` (default: as stored), which also becomes the config's param and compute dtype.
    """
    config, meta, manifest = read_metadata(path)
    params_dir = (meta.path / PARAMS_DIR).absolute()  # orbax accepts absolute paths only
    _check_orbax_metadata(params_dir, manifest, _dtypes(config, manifest, meta.param_dtype))
    stored = np.dtype(meta.param_dtype)
    target = np.dtype(dtype) if dtype is not None else stored
    if target.name not in PARAM_DTYPES:
        raise ValueError(f"dtype must be one of {PARAM_DTYPES}, got {target.name!r}")
    if dtype is not None:
        config = config.replace(param_dtype=target.name, compute_dtype=target.name)
    shardings = resolve_shardings(sharding, config)

    def abstract(p: Path, dt: np.dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(manifest[p]["shape"]), dt, sharding=shardings[p])

    # One tensor at a time, each device's shard read on its own: host memory holds the params once, plus
    # one chunk (CHUNK_BYTES) in flight. Checksums cover the stored bits, so a tensor is checked in the
    # stored dtype, then cast.
    leaves = {}
    fixed = _quantized_dtypes(config)
    for p in manifest:
        leaf = _read_tensor(params_dir, p, abstract(p, np.dtype(fixed.get(p, stored))))
        if verify:
            _verify(params_dir, {p: leaf}, manifest)
        leaves[p] = leaf if target == stored or p in fixed else _cast(leaf, target)
        del leaf
        _release_freed_memory()
    return config, _params_tree(leaves, config), meta


def _params_tree(leaves: dict[Path, jax.Array], config: ModelConfig) -> Params:
    """The params pytree of ``config`` from its tensors by path (quantized weights as their typed leaves)."""
    shapes = param_shapes(config)
    return jax.tree.structure(shapes).unflatten([leaves[p] for p in leaves_by_path(shapes)])


_cast = jax.jit(lambda x, dtype: x.astype(dtype), static_argnums=1)


def _read_tensor(params_dir: pathlib.Path, p: Path, target: jax.ShapeDtypeStruct) -> jax.Array:
    """Tensor ``p`` laid out as ``target`` says, read shard by shard from its TensorStore.

    Orbax restores all shards of a tensor at once, staging a host copy of the whole tensor; reading each
    addressable shard on its own and handing it to its device stages one chunk. A folder whose layout
    this reader does not know (another orbax storage format) is restored by orbax instead.
    """
    try:
        store = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{params_dir}/",
                                                        "path": ".".join(p)}},
                        open=True, read=True, context=_TS_CONTEXT).result()
    except Exception:  # noqa: BLE001 — not the layout this reader knows: orbax reads it (and names errors)
        return _restore(params_dir, {p: target}, partial=True)[p]
    if tuple(store.shape) != target.shape or np.dtype(store.dtype.numpy_dtype) != target.dtype:
        return _restore(params_dir, {p: target}, partial=True)[p]
    devices_by_shard: dict[tuple, list] = {}  # a replicated shard is read once for all its devices
    for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
        devices_by_shard.setdefault(tuple(_bounds(index, target.shape)), []).append(device)
    on_device = {}
    try:
        for bounds, devices in devices_by_shard.items():
            host = store[tuple(slice(a, b) for a, b in bounds)].read().result()
            for device in devices:
                on_device[device] = jax.device_put(host, device)
            jax.block_until_ready([on_device[d] for d in devices])  # the host copy can go now
            del host
    except Exception as e:  # noqa: BLE001 — TensorStore's errors name no tensor
        raise CheckpointError(f"{params_dir}: cannot read tensor {tensor_name(p)!r} (data files truncated or "
                              f"corrupt?): {type(e).__name__}: {str(e)[:400]}") from None
    shards = [on_device[d] for d in target.sharding.addressable_devices_indices_map(target.shape)]
    return jax.make_array_from_single_device_arrays(target.shape, target.sharding, shards)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [sl.indices(n)[:2] for sl, n in zip(index, shape)]


# No TensorStore cache: a chunk read once is not read again.
_TS_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})


def _release_freed_memory() -> None:
    """Hand memory freed by the last tensor back to the OS (glibc keeps freed chunks under its growing
    mmap threshold in the heap, which would count as resident until the process ends)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


_LIBC = _load_libc()


def _check_orbax_metadata(params_dir: pathlib.Path, manifest: Mapping[Path, dict], dtypes: Mapping[Path, str]) -> None:
    """The orbax folder holds exactly the manifest's tensors, with the manifest's shapes and dtypes."""
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir} is missing: the checkpoint has no params")
    try:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            tree = checkpointer.metadata(params_dir).item_metadata.tree
    except Exception as e:  # orbax raises many types (JSON, KeyError, ValueError) for a broken folder
        raise CheckpointError(f"{params_dir}: cannot read the orbax metadata (_METADATA missing, truncated "
                              f"or corrupt?): {type(e).__name__}: {e}") from None
    stored = leaves_by_path(tree)
    _check_tensor_set(manifest, set(stored), where=str(params_dir), what="the orbax params")
    for p, info in stored.items():
        shape, dt = tuple(info.shape), np.dtype(info.dtype).name
        if shape != tuple(manifest[p]["shape"]) or dt != dtypes[p]:
            raise CheckpointError(f"{params_dir}: tensor {tensor_name(p)!r} is stored as {shape} {dt} but "
                                  f"{METADATA_FILE} records {tuple(manifest[p]['shape'])} {dtypes[p]}")


def _restore(params_dir: pathlib.Path, targets: dict[Path, jax.ShapeDtypeStruct], *,
             partial: bool = False) -> dict[Path, jax.Array]:
    """Read ``targets`` from the orbax folder; on failure, find and name the tensor that cannot be read."""
    tree = tree_from_paths(targets)
    args = ocp.args.PyTreeRestore(item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
                                  partial_restore=partial)
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            return leaves_by_path(checkpointer.restore(params_dir, args=args))
    except Exception as e:  # TensorStore's errors name no tensor: find the one that cannot be read
        if len(targets) > 1:
            for p, target in targets.items():
                _restore(params_dir, {p: target}, partial=True)
        names = [tensor_name(p) for p in targets]
        raise CheckpointError(f"{params_dir}: cannot read tensor{'s' if len(names) > 1 else ''} "
                              f"{', '.join(map(repr, names))} (data files truncated or corrupt?): "
                              f"{type(e).__name__}: {str(e)[:400]}") from None


def _verify(params_dir: pathlib.Path, leaves: dict[Path, jax.Array], manifest: Mapping[Path, dict]) -> None:
    for p, actual in checksum.checksums(leaves).items():
        expected = manifest[p]["checksum"]
        if actual != expected:
            raise CheckpointError(f"{params_dir}: tensor {tensor_name(p)!r} fails its checksum ({actual:#010x}, "
                                  f"recorded {expected:#010x}): its data files are corrupt")
