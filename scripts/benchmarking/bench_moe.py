"""A mixture of experts' decode, with each step's few (token, expert) pairs run on their own against the
``ragged_dot`` path, side by side in one run:

    PYTHONPATH=scripts python -m benchmarking.bench_moe                 # Mixtral-shaped, about 6 minutes
    PYTHONPATH=scripts python -m benchmarking.bench_moe --layers 2 --dtypes float32 --backends cpu
    PYTHONPATH=scripts python -m benchmarking.bench_moe --quantize int8 int4 --backends cpu   # float vs integers

A Mixtral-shaped model with random weights (D=1024, F=3584, E=8 experts, top 2, a few layers; a small
vocabulary, so that the experts are most of what a step reads) decodes greedily at batch 1 on each backend
(the CPU kernels, XLA) and dtype, by each path:

- ``gathered``: the backends as they are: a decode step's B·k pairs (no more than E,
  ``llm_jax.backends.base.gathers_experts``) each multiplied with its expert's matrices alone, read where
  they lie in the stack by the CPU kernels (as the panels ``prepare`` makes of them), gathered by XLA;
- ``ragged_dot``: the path before, every mixture sorted by expert through ``jax.lax.ragged_dot``
  (:func:`ragged_only`; the experts in the canonical layout), which XLA:CPU computes as a product of every
  row with every expert.

Both give the same greedy tokens (checked). Beside each the roofline: a step must read the dense weights
(attention, routers, norms, the LM head) and the k of E experts each token chose, k/E of the experts'
bytes; at the streaming-read bandwidth measured beside the runs, that bounds tokens/s. The paths run in
turns, ``--repeats`` times, and each row gives the best run (the machine may be shared) and the range.

With ``--quantize`` the rows are the weights' forms instead, each by the backends as they are (the
``gathered`` path): floats in each of ``--dtypes``, then every projection, the experts' included, quantized
by each scheme named (``int8`` per output channel, ``int4`` in groups of 32; the router, norms and tables in
float32), whose integers and scales a step reads in place of the floats' bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys

import jax
import numpy as np

from llm_jax.backends import Backend, CpuKernels, Xla
from llm_jax.config import Experts, ModelConfig
from llm_jax.model import init_params
from llm_jax.quantization import parse_quantization, quantize_params
from llm_jax.weights.placement import leaves_by_path

from benchmarking.llm_jax_engine import LlmJaxEngine, Workload
from benchmarking.machine import cpu_name, measure_run_bandwidth
from benchmarking.results import format_table


def mixtral_shaped(*, layers: int, dtype: str) -> ModelConfig:
    """Mixtral's mixture (8 experts, top 2, SwiGLU) at a quarter of its width: D=1024, F=3584, N=8, K=2."""
    return ModelConfig(vocab_size=4096, d_model=1024, n_layers=layers, n_heads=8, n_kv_heads=2, head_dim=128,
                       d_ff=3584, max_seq_len=1024, experts=Experts(num_experts=8, top_k=2), param_dtype=dtype,
                       compute_dtype=dtype)


def ragged_only(backend: Backend) -> Backend:
    """``backend`` (a copy of it, of a subclass of its class) with every mixture sorted by expert through
    ``ragged_dot``, however few its pairs: the path before decode read only the chosen experts."""
    cls = type(backend)
    ragged = type(f"{cls.__name__}RaggedDot", (cls,), {"chosen_experts": _sorted_by_expert})
    return ragged(**{field.name: getattr(backend, field.name) for field in dataclasses.fields(backend)})


def _sorted_by_expert(self, *args):
    """:meth:`Backend.chosen_experts` as :meth:`Backend.sorted_experts` computes it (through ``ragged_dot``)."""
    return self.sorted_experts(*args)


EXPERTS = ("gate_proj", "up_proj", "down_proj")


def step_bytes(params, config: ModelConfig) -> tuple[int, int]:
    """(bytes a decode step of one row must read, the experts' bytes of all E) of ``params`` as they are stored
    (a quantized leaf's integers, scales and offsets): the dense weights (an untied embedding table only its
    row) and k/E of the experts'."""
    must_read, experts = 0.0, 0
    for path, leaf in leaves_by_path(params).items():
        n = leaf.nbytes
        if path[:2] == ("layers", "moe") and path[2] in EXPERTS:
            experts += n
            must_read += n * config.experts.top_k / config.experts.num_experts
        elif path[:2] == ("embedder", "embedding") and not config.tie_embeddings:
            must_read += n / config.vocab_size
        else:
            must_read += n
    return int(must_read), experts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--backends", nargs="+", default=["cpu", "xla"], choices=["cpu", "xla"])
    parser.add_argument("--new-tokens", type=int, default=17, help="per run, the first (from prefill) included")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantize", nargs="+", choices=["int8", "int4"], default=None,
                        help="rows of float weights (--dtypes) against these integer forms, each backend as it is")
    args = parser.parse_args(argv)

    workload = Workload(batch=1, prompt_len=16, new_tokens=args.new_tokens, chunk_steps=8)
    if args.quantize is not None:
        return forms_main(args, workload)
    rows, bandwidths = [], []
    for dtype in args.dtypes:
        config = mixtral_shaped(layers=args.layers, dtype=dtype)
        params = init_params(config)
        must_read, all_experts = step_bytes(params, config)
        for name in args.backends:
            backend = CpuKernels() if name == "cpu" else Xla()
            weights = backend.prepare(params, config)
            # The path before: the experts in the canonical layout, as the backends then held them.
            before = {**weights, "layers": {**weights["layers"], "moe": params["layers"]["moe"]}}
            engines = {"ragged_dot": LlmJaxEngine(before, config, workload, backend=ragged_only(backend)),
                       "gathered": LlmJaxEngine(weights, config, workload, backend=backend)}
            for engine in engines.values():
                engine.compile()
            rates: dict[str, list[float]] = {path: [] for path in engines}
            tokens = {}
            for _ in range(args.repeats):
                for path, engine in engines.items():
                    bandwidths.append(measure_run_bandwidth().sustained_gbps)
                    run = engine.run()
                    rates[path].append(run.decode_tokens / run.decode_s)
                    tokens[path] = run.tokens
            if not np.array_equal(tokens["ragged_dot"], tokens["gathered"]):
                print(f"{dtype} {name}: the paths' greedy tokens differ", file=sys.stderr)
                return 1
            for path in engines:
                rows.append((dtype, name, path, rates[path], rates["ragged_dot"], must_read, all_experts))
            del weights, engines
    bandwidth = max(bandwidths)
    cells = []
    for dtype, name, path, rate, ragged, must_read, all_experts in rows:
        roofline = bandwidth * 1e9 / must_read
        cells.append([dtype, name, path, f"{max(rate):.2f} ({min(rate):.2f}–{max(rate):.2f})",
                      f"{1e3 / max(rate):.1f}", f"{max(rate) / max(ragged):.2f}", f"{must_read / 1e6:.0f}",
                      f"{all_experts / 1e6:.0f}", f"{roofline:.1f}", f"{max(rate) / roofline:.0%}"])
    print(f"\n{datetime.date.today()}, {cpu_name()}, {jax.device_count()} device(s), jax {jax.__version__}; "
          f"Mixtral-shaped, {args.layers} layers, D=1024 F=3584 E=8 k=2, batch 1, {workload.decode_steps} decode "
          f"steps a run, best of {args.repeats}; bandwidth {bandwidth:.1f} GB/s (best read beside the runs)\n")
    print(format_table(["dtype", "backend", "path", "tokens/s (range)", "ms/step", "× ragged_dot",
                        "MB/step (k/E)", "MB experts (E)", "roofline tok/s", "of roofline"], cells, left=3))
    return 0


def forms_main(args, workload: Workload) -> int:
    """``--quantize``: one row per form of the weights (floats in each dtype, then each scheme) and backend, the
    backends as they are; the forms run in turns, as the paths do."""
    forms = {}
    for dtype in args.dtypes:
        config = mixtral_shaped(layers=args.layers, dtype=dtype)
        forms[dtype] = (config, init_params(config))
    base = mixtral_shaped(layers=args.layers, dtype="float32")
    floats = forms["float32"][1] if "float32" in forms else init_params(base)
    for scheme in args.quantize:
        forms[scheme] = quantize_params(floats, base, parse_quantization(scheme))
    rows, bandwidths = [], []
    for name in args.backends:
        backend = CpuKernels() if name == "cpu" else Xla()
        engines = {form: LlmJaxEngine(backend.prepare(params, config), config, workload, backend=backend)
                   for form, (config, params) in forms.items()}
        for engine in engines.values():
            engine.compile()
        rates: dict[str, list[float]] = {form: [] for form in engines}
        for _ in range(args.repeats):
            for form, engine in engines.items():
                bandwidths.append(measure_run_bandwidth().sustained_gbps)
                run = engine.run()
                rates[form].append(run.decode_tokens / run.decode_s)
        for form, (config, params) in forms.items():
            rows.append((form, name, rates[form], rates[next(iter(forms))], *step_bytes(params, config)))
        del engines
    bandwidth = max(bandwidths)
    cells = []
    for form, name, rate, first, must_read, all_experts in rows:
        roofline = bandwidth * 1e9 / must_read
        cells.append([form, name, f"{max(rate):.2f} ({min(rate):.2f}–{max(rate):.2f})", f"{1e3 / max(rate):.1f}",
                      f"{max(rate) / max(first):.2f}", f"{must_read / 1e6:.0f}", f"{all_experts / 1e6:.0f}",
                      f"{roofline:.1f}", f"{max(rate) / roofline:.0%}"])
    print(f"\n{datetime.date.today()}, {cpu_name()}, {jax.device_count()} device(s), jax {jax.__version__}; "
          f"Mixtral-shaped, {args.layers} layers, D=1024 F=3584 E=8 k=2, batch 1, {workload.decode_steps} decode "
          f"steps a run, best of {args.repeats}; bandwidth {bandwidth:.1f} GB/s (best read beside the runs)\n")
    print(format_table(["weights", "backend", "tokens/s (range)", "ms/step", f"× {next(iter(forms))}",
                        "MB/step (k/E)", "MB experts (E)", "roofline tok/s", "of roofline"], cells, left=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
