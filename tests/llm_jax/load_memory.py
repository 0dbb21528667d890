"""Host memory of loading a model, against what it holds in the end.

    python tests/llm_jax/load_memory.py save DIR [--scale N]      # random model, llm_jax checkpoint
    python tests/llm_jax/load_memory.py save-hf DIR [--scale N]   # the same shapes, Hugging Face folder
    python tests/llm_jax/load_memory.py load DIR --mesh data=1,model=8
    python tests/llm_jax/load_memory.py load DIR --mesh none      # one device: params and the backend's form

``load`` runs in a fresh process (for 8 simulated CPU devices, with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``), loads once with ``llm_jax.load(DIR, mesh=...)``
and prints JSON: the peak resident memory the load added over what the process held before, against
``device_bytes``, what the devices must hold in the end (one copy of the params per ``data`` replica).
With ``--mesh none`` it loads on one device and derives the backend's execution form (``model.weights``:
the CPU kernels' panels and the LM head's screens), and ``device_bytes`` counts both.
On CPU the devices' buffers are host memory, so a load that reads each device's shard straight from
the files peaks near 1× ``device_bytes`` (plus a constant for compiling and the I/O machinery, tens
of MB, which only small models notice); one that stages a full host copy first peaks near 2×.
(A second load in the same process would under-count: it reuses memory the allocator kept.)
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import resource
import sys

import jax
import numpy as np


def config_for(scale: int):
    from llm_jax.config import ModelConfig

    # A Llama-shaped model: 20M params (82 MB in float32) at scale 1, 134M (535 MB) at scale 3.
    return ModelConfig(vocab_size=8192, d_model=512 * scale, n_layers=4, n_heads=8 * scale, n_kv_heads=2 * scale,
                       head_dim=64, d_ff=1536 * scale, max_seq_len=256)


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def save(folder: pathlib.Path, scale: int) -> None:
    from llm_jax.model import init_params
    from llm_jax.weights.checkpoint import save_checkpoint

    config = config_for(scale)
    save_checkpoint(folder, config=config, params=init_params(config, seed=0), force=True)


def save_hf(folder: pathlib.Path, scale: int) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from hf_models import save_tiny_llama

    c = config_for(scale)
    save_tiny_llama(folder, vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                    num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                    max_position_embeddings=c.max_seq_len, perturb_norms=False)


def load(folder: pathlib.Path, mesh_spec: str) -> dict:
    import llm_jax
    from llm_jax.model import param_shapes
    from llm_jax.weights import sources
    from llm_jax.weights.checkpoint import read_metadata

    mesh = None if mesh_spec == "none" else llm_jax.make_mesh(mesh_spec)
    fmt = sources.detect_format(folder)
    config = read_metadata(folder)[0] if fmt is sources.WeightFormat.LLM_JAX else sources.source_config(folder, fmt)
    param_bytes = sum(s.size * np.dtype(config.param_dtype).itemsize for s in jax.tree.leaves(param_shapes(config)))

    gc.collect()
    before = _status_kib("VmRSS")
    reset = _reset_peak()
    model = llm_jax.load(folder, mesh=mesh)
    held = jax.block_until_ready([model.params, model.weights])  # the backend's form too, derived once
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    added = (peak - before) * 1024
    unique = {id(leaf): leaf for leaf in jax.tree.leaves(held)}.values()  # leaves both hold count once
    device_bytes = sum(s.data.nbytes for leaf in unique for s in leaf.addressable_shards)
    return {"devices": jax.device_count(), "mesh": None if mesh is None else dict(mesh.shape),
            "backend": type(model.backend).__name__, "param_bytes": param_bytes, "device_bytes": device_bytes,
            "peak_added_bytes": added, "ratio": added / device_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["save", "save-hf", "load"])
    p.add_argument("folder", type=pathlib.Path)
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--mesh", default="data=1,model=8", help="a mesh spec, or none for one device")
    args = p.parse_args(argv)
    if args.command == "save":
        save(args.folder, args.scale)
    elif args.command == "save-hf":
        save_hf(args.folder, args.scale)
    else:
        json.dump(load(args.folder, args.mesh), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
