"""Every GPU check of llm_jax in one go, with one table of results at the end.

    scripts/gpu_check.sh             # on a GPU: well under 10 minutes on one H200, with compiles
    scripts/gpu_check.sh --dry-run   # anywhere: the same code on the CPU, interpreted, tiny shapes

(a) ``tests/pallas_kernels`` with the Triton kernels compiled (``LLM_JAX_PALLAS_INTERPRET=0``), and
    the default tiles of both Triton kernels compiled for every head dim and dtype (they must fit
    the device's shared memory);
(b) end-to-end parity: a tiny random Llama-shaped float32 model's logits from ``llm_jax.forward``
    here with backend "pallas" and "xla", against the same computed on the CPU in a subprocess
    (``JAX_PLATFORMS=cpu``), max |Δlogit| <= 1e-4 at the highest matmul precision; and greedy ids
    from ``llm_jax.generate`` identical over 32 tokens;
(c) kernel speed: the decode and prefill kernels against ``jax.nn.dot_product_attention`` ("xla",
    "cudnn"), with the workloads of ``bench_kernels.py``; the decode kernel's K/V bytes read per
    second as a share of the device's peak HBM bandwidth; decode reading a layer of a stacked
    cache in place against slicing it out first; and ragged paged attention over a mixed serving
    step (decodes and prefill chunks, shuffled pages) against its jnp reference, with its K/V
    bytes per second, over bfloat16 pages and over int8 pages with their scales;
(d) TinyLlama-shaped (1.1B) bfloat16 decode at batch 1 with backend "pallas", random weights:
    tokens/s and its share of the HBM roofline (weights and K/V read per step ÷ peak bandwidth).

Peaks come from ``HBM_PEAK`` by device kind (the table prints which entry). The table is also
written as JSON to ``$OUT/gpu_check.json`` when ``OUT`` is set (or to ``--json``). Exit status 1 if
a check failed. Run from the repository root with it on PYTHONPATH (``gpu_check.sh`` does both).
"""

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PARITY_BOUND = 1e-4

# Peak HBM bandwidth, bytes/s, from vendors' data sheets: (substring of jax's device_kind, peak),
# most specific first.
HBM_PEAK = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # the 40 GB parts
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the final table."""

    check: str
    result: str  # PASS, FAIL, INFO (a figure, no bound) or SKIP
    figure: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What the checks run: the real sizes on a GPU, tiny interpreted ones for a dry run."""

    dry_run: bool
    pytest_args: tuple[str, ...]
    parity_new_tokens: int
    big_model: str  # a name for the table
    big_config: dict  # ModelConfig arguments
    big_prompt_len: int
    big_new_tokens: int
    big_repeats: int


TINY_LLAMA = dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                  head_dim=64, d_ff=5632, max_seq_len=2048)
TINY_RANDOM = dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                   d_ff=256, max_seq_len=128)

GPU_PLAN = Plan(
    dry_run=False,
    # The TPU kernels can only be interpreted here, and the dry runs are the CPU's checks.
    pytest_args=("tests/pallas_kernels", "-k", "not tpu and not dry_run"),
    parity_new_tokens=32, big_model="1B (TinyLlama shape)", big_config=TINY_LLAMA,
    big_prompt_len=128, big_new_tokens=256, big_repeats=2)
DRY_PLAN = Plan(
    dry_run=True,
    pytest_args=("tests/pallas_kernels/test_stacked_decode.py", "-k",
                 "reads_the_given_layer and gpu and bfloat16"),
    parity_new_tokens=8, big_model="tiny (dry run)", big_config=TINY_RANDOM,
    big_prompt_len=8, big_new_tokens=8, big_repeats=1)


def hbm_peak(device_kind: str) -> tuple[float | None, str]:
    """(peak bytes/s or None, the table entry that gave it)."""
    for name, peak in HBM_PEAK:
        if name in device_kind:
            return peak, f"{peak / 1e12:.2f} TB/s (table: {name!r})"
    return None, f"no HBM peak in the table for {device_kind!r}"


# (a) The kernel tests, compiled.

def check_kernel_tests(plan: Plan, timeout_s: float) -> list[Row]:
    env = {**os.environ, "LLM_JAX_PALLAS_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *plan.pytest_args, "-q", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    summary = next((line for line in reversed(result.stdout.splitlines())
                    if re.search(r"\d+ (passed|failed|error)", line)), "no summary")
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    mode = "interpreted (no GPU)" if plan.dry_run else "compiled"
    detail = f"{mode}, {time.perf_counter() - start:.0f} s" + (
        f"; first: {failed[0][:120]}" if failed else "")
    passed = result.returncode == 0
    return [Row(check="(a) pallas kernel tests", result="PASS" if passed else "FAIL",
                figure=summary.strip("= "), detail=detail)]


def check_default_tiles() -> list[Row]:
    """Every default tile choice compiles on this device (Triton refuses kernels that need more
    shared memory than it has); without a GPU they are only lowered."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import decode_attention_gpu, flash_attention_gpu, gpu_tiles, shapes

    on_gpu = jax.default_backend() == "gpu"
    failures, cases, shown = [], 0, []
    for H in (64, 80, 128, 256):
        for dtype in (jnp.float32, jnp.bfloat16):
            prefill = shapes.AttentionDims(B=1, T=2048, S=2048, N=8, K=2, H=H)
            decode = shapes.AttentionDims(B=1, T=1, S=4096, N=8, K=2, H=H)
            kv = jax.ShapeDtypeStruct((1, 2048, 2, H), dtype)
            calls = {
                "prefill": (functools.partial(flash_attention_gpu.flash_attention_gpu,
                                              sm_scale=H ** -0.5),
                            (jax.ShapeDtypeStruct((1, 2048, 8, H), dtype), kv, kv),
                            flash_attention_gpu.choose_tiles(prefill, dtype, block_q=None,
                                                             block_k=None, num_stages=None)),
                "decode": (functools.partial(decode_attention_gpu.decode_attention_gpu,
                                             sm_scale=H ** -0.5),
                           (jax.ShapeDtypeStruct((1, 8, H), dtype),
                            *[jax.ShapeDtypeStruct((1, 4096, 2, H), dtype)] * 2),
                           decode_attention_gpu.choose_tiles(decode, dtype, block_k=None,
                                                             num_stages=None)),
            }
            for kind, (fn, args, tiles) in calls.items():
                cases += 1
                name = f"{kind} H={H} {jnp.dtype(dtype).name} ({tiles})"
                if H == 256 and dtype == jnp.float32:
                    shown.append(f"{kind} f32 H=256: {tiles.block_q}x{tiles.block_k} "
                                 f"x{tiles.num_stages}")
                try:
                    traced = jax.jit(fn).trace(*args, jax.ShapeDtypeStruct((1,), jnp.int32))
                    if on_gpu:
                        traced.lower().compile()
                    else:
                        traced.lower(lowering_platforms=("cuda",))
                except Exception as e:  # the smem overrun Triton reports, or any other
                    failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    budget = gpu_tiles.smem_budget()
    detail = failures[0] if failures else (f"{budget.bytes // 1024} KiB per program; "
                                           + "; ".join(shown))
    return [Row(check="(a) default tiles compile", result="FAIL" if failures else "PASS",
                figure=f"{cases - len(failures)}/{cases} {'compiled' if on_gpu else 'lowered'}",
                detail=detail)]


# (b) End-to-end parity against the CPU.

def parity_inputs():
    """Two right-padded prompts (tokens_BT [2, 16], lengths_B) of the tiny model's vocabulary."""
    import numpy as np

    rng = np.random.default_rng(7)
    lengths = np.array([16, 9], np.int32)
    tokens = rng.integers(1, TINY_RANDOM["vocab_size"], (2, 16)).astype(np.int32)
    tokens[1, lengths[1]:] = 0
    return tokens, lengths


def parity_outputs(backend: str, new_tokens: int) -> dict:
    """Logits, greedy ids and a params checksum of the tiny model on this process' platform."""
    import jax
    import numpy as np

    import llm_jax

    config = llm_jax.ModelConfig(**TINY_RANDOM, param_dtype="float32", compute_dtype="float32")
    params = llm_jax.init_params(config, seed=0)
    tokens, lengths = parity_inputs()
    with jax.default_matmul_precision("highest"):
        forward = jax.jit(lambda p, t, n, lora=None: llm_jax.forward(p, config, t, n, backend=backend, lora=lora))
        logits = np.asarray(forward(params, tokens, lengths))
        # Two random LoRA adapters of every projection, one per row (the serving engine's unmerged form).
        lora = llm_jax.LoraBatch.of_slots(_random_lora(config), np.array([[0], [1]], np.int32).repeat(16, 1))
        lora_logits = np.asarray(forward(params, tokens, lengths, lora))
        model = llm_jax.Model(config=config, params=params, tokenizer=None, eos_ids=(),
                              backend=backend)
        prompts = [tokens[b, :n].tolist() for b, n in enumerate(lengths)]
        results = llm_jax.generate(model, prompts, max_new_tokens=new_tokens)
    checksum = float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(params)))
    return dict(logits=logits, lora_logits=lora_logits, ids=np.array([r.output_ids for r in results]),
                checksum=checksum)


def _random_lora(config):
    """Two rank-4 adapters of every projection in a stack, drawn the same on every platform."""
    import numpy as np

    from llm_jax.lora import TARGETS, LoraAdapter, LoraWeights, target_dims

    rng, L, adapters = np.random.default_rng(11), config.n_layers, []
    for i in range(2):
        weights = {t: (rng.normal(0, 0.3, (L, target_dims(config, t)[0], 4)).astype(np.float32),
                       rng.normal(0, 0.3, (L, 4, target_dims(config, t)[1])).astype(np.float32)) for t in TARGETS}
        adapters.append(LoraAdapter(name=f"lora{i}", weights=weights))
    return LoraWeights.stack(adapters, config)


def cpu_reference(out_path: str, new_tokens: int) -> int:
    """The subprocess of check (b): JAX_PLATFORMS=cpu, backend "xla", results to an npz file."""
    import numpy as np

    outputs = parity_outputs("xla", new_tokens)
    np.savez(out_path, **outputs)
    return 0


def check_parity(plan: Plan, timeout_s: float) -> list[Row]:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "reference.npz")
        # The CPU reference computes while this process computes on the device.
        reference_run = subprocess.Popen(
            [sys.executable, __file__, "--cpu-reference", path,
             "--new-tokens", str(plan.parity_new_tokens)],
            env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        try:
            ours = {backend: parity_outputs(backend, plan.parity_new_tokens)
                    for backend in ("pallas", "xla")}
            _, stderr = reference_run.communicate(timeout=timeout_s)
        finally:
            if reference_run.poll() is None:
                reference_run.kill()
        if reference_run.returncode:
            raise RuntimeError(f"the CPU reference failed: {stderr.strip().splitlines()[-1:]}")
        reference = dict(np.load(path))
    _, lengths = parity_inputs()
    valid_BT = np.arange(reference["logits"].shape[1])[None, :] < lengths[:, None]
    rows = []
    for backend, out in ours.items():
        if out["checksum"] != float(reference["checksum"]):
            raise RuntimeError("the CPU reference drew other random weights")
        for name, key in (("logits", "logits"), ("LoRA logits", "lora_logits")):
            delta = float(np.max(np.abs(out[key] - reference[key])[valid_BT]))
            rows.append(Row(check=f"(b) {name} {backend} vs cpu", result="PASS" if delta <= PARITY_BOUND
                            else "FAIL", figure=f"max|Δ| {delta:.1e}",
                            detail=f"bound {PARITY_BOUND:g}, float32, matmul precision highest"))
        same = np.array_equal(out["ids"], reference["ids"])
        rows.append(Row(check=f"(b) greedy ids {backend} vs cpu", result="PASS" if same else "FAIL",
                        figure=f"{out['ids'].shape[1]} tokens x {out['ids'].shape[0]}",
                        detail="identical" if same else
                        f"first differing step {_first_difference(out, reference)}"))
    return rows


def _first_difference(ours, reference) -> int:
    import numpy as np

    differs = np.any(ours["ids"] != reference["ids"], axis=0)
    return int(np.argmax(differs))


# (c) Kernel speed.

def check_kernel_speed(plan: Plan, peak: float | None) -> list[Row]:
    import jax
    import jax.numpy as jnp

    import bench_kernels as bench

    on_gpu = jax.default_backend() == "gpu"
    if plan.dry_run:
        workloads = [bench.Workload(kind=bench.Kind.DECODE, B=1, S=256, N=4, K=2, H=64),
                     bench.Workload(kind=bench.Kind.PREFILL, B=1, S=64, N=4, K=2, H=64)]
    else:
        workloads = [bench.Workload(kind=bench.Kind.DECODE, B=1, S=32768, N=32, K=8, H=128),
                     bench.Workload(kind=bench.Kind.DECODE, B=8, S=8192, N=32, K=8, H=128),
                     bench.Workload(kind=bench.Kind.PREFILL, B=4, S=4096, N=32, K=8, H=128)]
    rows = []
    for w in workloads:
        inputs = w.inputs()
        times, reference = {}, None
        for impl in (bench.Impl.XLA, bench.Impl.OURS, bench.Impl.CUDNN):
            if impl is bench.Impl.CUDNN and not on_gpu:
                rows.append(Row(check=f"(c) {w.kind.value} {impl.value}", result="SKIP",
                                detail=f"{w}: needs a GPU"))
                continue
            fn = jax.jit(bench.attention_fn(impl, w, interpret=not on_gpu))
            try:
                out = fn(*inputs).astype(jnp.float32)
                times[impl] = bench.seconds_per_call(fn, inputs, min_seconds=0.05)
            except Exception as e:  # cuDNN rejects some shapes; report and go on
                rows.append(Row(check=f"(c) {w.kind.value} {impl.value}", result="FAIL",
                                detail=f"{w}: {type(e).__name__}: {str(e).splitlines()[0][:100]}"))
                continue
            reference = out if reference is None else reference
            rows.append(_speed_row(w, impl, times, out, reference, peak))
        del inputs
    rows.append(_stacked_decode_row(plan, on_gpu))
    return rows


def _speed_row(w, impl, times: dict, out, reference, peak: float | None) -> Row:
    import jax.numpy as jnp

    import bench_kernels as bench

    seconds = times[impl]
    error = float(jnp.max(jnp.abs(out - reference)) / jnp.max(jnp.abs(reference)))
    vs_xla = times[bench.Impl.XLA] / seconds
    figure = f"{seconds * 1e3:.3f} ms, {vs_xla:.2f}x xla"
    detail = f"{w}; rel max|Δ| vs xla {error:.1e}"
    if w.kind is bench.Kind.DECODE:
        kv_bytes = 2 * w.B * w.S * w.K * w.H * bench.DTYPE.itemsize
        gbps = kv_bytes / seconds / 1e9
        share = f" = {gbps * 1e9 / peak:.0%} of peak" if peak else ""
        figure += f", K/V {gbps:.0f} GB/s{share}"
    else:
        figure += f", {w.flops / seconds / 1e12:.1f} TFLOP/s"
    return Row(check=f"(c) {w.kind.value} {impl.value}", result="PASS" if error <= 2e-2 else "FAIL",
               figure=figure, detail=detail)


def _stacked_decode_row(plan: Plan, on_gpu: bool) -> Row:
    """Decode over layer l of a stacked cache: read in place, and sliced out first (the old way)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import bench_kernels as bench
    from pallas_kernels import decode_attention

    L, B, S, N, K, H = (4, 1, 256, 4, 2, 64) if plan.dry_run else (8, 1, 8192, 32, 8, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, N, H), jnp.bfloat16)
    k, v = (jax.random.normal(key, (L, B, S, K, H), jnp.bfloat16) for key in keys[1:])
    lengths = jnp.full((B,), S, jnp.int32)
    attend = functools.partial(decode_attention, sm_scale=H ** -0.5, interpret=not on_gpu)
    in_place = jax.jit(lambda q, k, v, n, layer: attend(q, k, v, n, layer=layer))
    sliced = jax.jit(lambda q, k, v, n, layer: attend(
        q, lax.dynamic_index_in_dim(k, layer, keepdims=False),
        lax.dynamic_index_in_dim(v, layer, keepdims=False), n))
    args = (q, k, v, lengths, jnp.int32(L // 2))
    error = float(jnp.max(jnp.abs(in_place(*args).astype(jnp.float32)
                                  - sliced(*args).astype(jnp.float32))))
    t_in_place, t_sliced = (bench.seconds_per_call(f, args, min_seconds=0.05)
                            for f in (in_place, sliced))
    return Row(check="(c) decode stacked layer", result="PASS" if error == 0.0 else "FAIL",
               figure=f"{t_in_place * 1e3:.3f} ms in place, {t_sliced * 1e3:.3f} ms sliced",
               detail=f"L={L} B={B} S={S} N={N} K={K} H={H}; max|Δ| {error:g}")


def check_ragged_paged(plan: Plan, peak: float | None) -> list[Row]:
    """One serving step over a paged bfloat16 cache: decodes at a long context and prefill chunks
    ending at it, pages shuffled; the kernel against ``ragged_paged_attention_reference`` (XLA).
    Then the same step over int8 pages (the bfloat16 pages quantized by ``kv_cache.quantize_kv``,
    passed as pairs of values and scales), the kernel and the reference on the same pairs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bench_kernels as bench
    from llm_jax.kv_cache import quantize_kv
    from pallas_kernels import ragged_paged_attention
    from pallas_kernels.reference import ragged_paged_attention_reference

    on_gpu = jax.default_backend() == "gpu"
    decodes, chunks, chunk, context, N, K, H, Z = (
        (3, 1, 8, 40, 4, 2, 64, 16) if plan.dry_run else (60, 2, 128, 2048, 32, 8, 128, 16))
    num_tokens = np.array([1] * decodes + [chunk] * chunks, np.int32)
    B, X, T = len(num_tokens), -(-context // Z), int(num_tokens.sum())
    rng = np.random.default_rng(0)
    P = B * X + 1
    block_tables = rng.permutation(P)[:B * X].reshape(B, X).astype(np.int32)
    query_start = (np.cumsum(num_tokens) - num_tokens).astype(np.int32)
    seq_lens = np.full(B, context, np.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (T, N, H), jnp.bfloat16)
    k, v = (jax.random.normal(key, (P, Z, K, H), jnp.bfloat16) for key in keys[1:])
    tables = tuple(map(jnp.asarray, (block_tables, query_start, num_tokens, seq_lens)))
    ours = jax.jit(functools.partial(ragged_paged_attention, sm_scale=H ** -0.5,
                                     interpret=not on_gpu))
    reference = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=H ** -0.5))
    pages = {"": ((k, v), "bf16", H * 2),
             " int8": (tuple(quantize_kv(x) for x in (k, v)), "int8 pages + f32 scales", H + 4)}
    rows = []
    for name, ((k_pages, v_pages), kind, bytes_per_head) in pages.items():
        args = (q, k_pages, v_pages, *tables)
        out, ref = (f(*args).astype(jnp.float32) for f in (ours, reference))
        error = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        t_ours, t_ref = (bench.seconds_per_call(f, args, min_seconds=0.05)
                         for f in (ours, reference))
        kv_bytes = 2 * B * context * K * bytes_per_head  # each sequence's keys and values, once
        gbps = kv_bytes / t_ours / 1e9
        share = f" = {gbps * 1e9 / peak:.0%} of peak" if peak else ""
        rows.append(Row(
            check=f"(c) ragged paged attention{name}", result="PASS" if error <= 2e-2 else "FAIL",
            figure=f"{t_ours * 1e3:.3f} ms, {t_ref / t_ours:.1f}x reference, K/V "
                   f"{gbps:.0f} GB/s{share}",
            detail=f"{decodes} decodes + {chunks} chunks of {chunk} at context {context}, "
                   f"T={T} N={N} K={K} H={H} Z={Z} bf16 q, {kind}; rel max|Δ| vs reference "
                   f"{error:.1e}"))
    return rows


# (d) 1B decode.

def check_big_decode(plan: Plan, peak: float | None, peak_note: str) -> list[Row]:
    import jax
    import numpy as np

    import llm_jax

    config = llm_jax.ModelConfig(**plan.big_config, param_dtype="bfloat16",
                                 compute_dtype="bfloat16")
    params = llm_jax.init_params(config, seed=0)
    model = llm_jax.Model(config=config, params=params, tokenizer=None, eos_ids=(),
                          backend="pallas")
    prompt = np.random.default_rng(1).integers(1, config.vocab_size, plan.big_prompt_len).tolist()
    run = functools.partial(llm_jax.generate, model, [prompt], max_new_tokens=plan.big_new_tokens)
    run()  # compiles
    rates = [run()[0].metrics.decode_tokens_per_s for _ in range(plan.big_repeats)]
    rate = max(rates)
    itemsize = config.param_jnp_dtype.itemsize  # weights and cache are bfloat16
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not config.tie_embeddings:  # a step reads one row of the embedding table
        weight_bytes -= config.vocab_size * config.d_model * itemsize
    mean_context = plan.big_prompt_len + plan.big_new_tokens / 2
    kv_bytes = 2 * config.n_layers * mean_context * config.n_kv_heads * config.head_dim * itemsize
    step_bytes = weight_bytes + kv_bytes
    figure = f"{rate:.1f} tokens/s"
    if peak:
        figure += f", {rate * step_bytes / peak:.0%} of roofline ({peak / step_bytes:.0f} tokens/s)"
    detail = (f"batch 1, prompt {plan.big_prompt_len}, {plan.big_new_tokens} new, best of "
              f"{plan.big_repeats}; {step_bytes / 1e9:.3f} GB/step (weights "
              f"{weight_bytes / 1e9:.3f} + K/V {kv_bytes / 1e9:.4f}); peak {peak_note}")
    return [Row(check=f"(d) {plan.big_model} bf16 decode pallas", result="INFO", figure=figure,
                detail=detail)]


# The run.

def device_row() -> tuple[Row, float | None, str]:
    import jax

    from pallas_kernels import gpu_tiles

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    peak, peak_note = hbm_peak(kind)
    smem = gpu_tiles.smem_budget(device)
    row = Row(check="device", result="INFO", figure=kind,
              detail=f"jax {jax.__version__}; shared memory {smem.bytes // 1024} KiB per program "
                     f"({smem.source}); HBM peak {peak_note}")
    return row, peak, peak_note


def guarded(name: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """The check's rows, or one FAIL row naming the exception."""
    start = time.perf_counter()
    print(f"--- {name}", flush=True)
    try:
        rows = fn()
    except Exception as e:  # one broken check must not hide the others
        message = (str(e).strip().splitlines() or [""])[0][:160]
        rows = [Row(check=name, result="FAIL", detail=f"{type(e).__name__}: {message}")]
    for row in rows:
        print(f"    {row.result:4}  {row.check}: {row.figure}  {row.detail}", flush=True)
    print(f"    ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def print_table(rows: list[Row]) -> None:
    header = ["check", "result", "figure", "detail"]
    cells = [header] + [[r.check, r.result, r.figure, r.detail] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    for i, c in enumerate(cells):
        print("  ".join(x.ljust(w) for x, w in zip(c[:3], widths)) + "  " + c[3])
        if i == 0:
            print("  ".join("-" * w for w in widths) + "  " + "-" * 6)


def run(plan: Plan, budget_s: float, json_path: str | None) -> int:
    start = time.perf_counter()

    def left() -> float:
        return budget_s - (time.perf_counter() - start)

    # The tests run first, in their own process, before this one holds the GPU.
    # What the other checks take on an H200, compiles included, is about 240 s.
    rows = guarded("(a) pallas kernel tests",
                   lambda: check_kernel_tests(plan, timeout_s=max(60.0, left() - 240)))
    info, peak, peak_note = device_row()
    rows.insert(0, info)
    checks = [("(a) default tiles", check_default_tiles),
              ("(b) parity", lambda: check_parity(plan, timeout_s=max(30.0, left()))),
              ("(c) kernel speed", lambda: check_kernel_speed(plan, peak)),
              ("(c) ragged paged attention", lambda: check_ragged_paged(plan, peak)),
              ("(d) big decode", lambda: check_big_decode(plan, peak, peak_note))]
    for name, fn in checks:
        if left() <= 0:
            rows.append(Row(check=name, result="SKIP", detail=f"time budget of {budget_s:.0f} s"))
            continue
        rows.extend(guarded(name, fn))
    elapsed = time.perf_counter() - start
    print(f"\ngpu_check{' --dry-run' if plan.dry_run else ''}: {elapsed:.0f} s\n")
    print_table(rows)
    failed = sum(r.result == "FAIL" for r in rows)
    print(f"\n{len(rows)} rows, {failed} failed")
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(
            dict(dry_run=plan.dry_run, seconds=round(elapsed, 1),
                 rows=[dataclasses.asdict(r) for r in rows]), indent=1))
        print(f"written {json_path}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the same checks on the CPU: interpreted kernels, tiny shapes")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no check after this many seconds (default 480)")
    parser.add_argument("--json", help="write the table here (default $OUT/gpu_check.json)")
    parser.add_argument("--cpu-reference", help=argparse.SUPPRESS)  # check (b)'s subprocess
    parser.add_argument("--new-tokens", type=int, default=32, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_reference:
        return cpu_reference(args.cpu_reference, args.new_tokens)
    json_path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json")
                              if os.environ.get("OUT") else None)
    return run(DRY_PLAN if args.dry_run else GPU_PLAN, args.budget_s, json_path)


if __name__ == "__main__":
    sys.exit(main())
