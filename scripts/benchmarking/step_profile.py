"""Where a decode step's time goes: one decode chunk run under JAX's profiler, its ops' times per step.

XLA records every operation it runs (a matrix-product kernel, a fused elementwise op, a loop) as an event
of the host trace, with the program (``hlo_module``) and the op (``hlo_op``) it belongs to. This module
runs one chunk of ``decode`` inside ``jax.profiler.trace``, reads the trace back (the Perfetto JSON that
``create_perfetto_trace=True`` writes beside the TensorBoard files), and sums each op's *exclusive* time
(its span less the spans of ops inside it) per decode step. A loop's or a conditional's own time is
then its bookkeeping and the gaps between the ops it runs: the executor's cost of dispatching them. The
op names are the compiled program's, so each one is labelled from that program's text: where
in the model it runs (the path JAX records, e.g. ``DecoderLayer/attn.project``) and, for a kernel, its
target and shapes (``matmul_panels_f32 f32[32,288] · f32[6,54,288,16] → f32[32,864]``: q/k/v of 15M at
batch 32), for any other op ``XLA <op name>``. A matrix product's flops (2 · R · K · N, from the same
text) give its rate, GFLOP/s, to set against the machine's arithmetic peak.

On CPU the ops run on the host, so their times are the step's; on an accelerator the host trace holds
the launches, not the device's work, and the profile says so.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import pathlib
import re
import tempfile
import time

import jax
import numpy as np

from benchmarking.llm_jax_engine import LlmJaxEngine

MODULE = "jit_decode"  # the name XLA gives the program of llm_jax.decoding.decode


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpTime:
    label: str  # "llm_jax_matmul_panels_f32 → f32[32,864]", "XLA wrapped_scatter", ...
    calls_per_step: float
    us_per_step: float
    flops_per_call: int | None = None  # matrix products: 2 · R · K · N

    @property
    def gflops(self) -> float | None:
        """The op's arithmetic rate (10^9 flops/s), where its flops are known."""
        if self.flops_per_call is None or self.us_per_step <= 0:
            return None
        return self.flops_per_call * self.calls_per_step / (self.us_per_step * 1e3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepProfile:
    """One decode chunk of ``steps`` steps, traced: ``wall_ms_per_step`` is its time on the host's clock
    (with the profiler's own cost), ``ops`` the ops' exclusive times, largest first."""

    steps: int
    wall_ms_per_step: float
    ops: tuple[OpTime, ...]
    on_host: bool  # the ops ran on the host (CPU): their times are the step's

    @property
    def ops_ms_per_step(self) -> float:
        return sum(op.us_per_step for op in self.ops) / 1e3

    def to_dict(self) -> dict:
        return {"steps": self.steps, "wall_ms_per_step": self.wall_ms_per_step, "on_host": self.on_host,
                "ops_ms_per_step": self.ops_ms_per_step, "ops": [dataclasses.asdict(op) for op in self.ops]}


def profile_decode(engine: LlmJaxEngine) -> StepProfile:
    """Trace one decode chunk of ``engine`` (compiled already: call after :meth:`LlmJaxEngine.compile`)."""
    text = engine.decode_program_text()
    labels, flops = op_labels(text), op_flops(text)
    cache, state = engine._prefill()
    cache, state, emitted = engine._decode(cache, state)  # the chunk before warms the caches
    np.asarray(emitted.tokens_BS)
    with tempfile.TemporaryDirectory(prefix="llm_jax_profile_") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            t0 = time.perf_counter()
            cache, state, emitted = engine._decode(cache, state)
            np.asarray(emitted.tokens_BS)
            wall = time.perf_counter() - t0
        events = read_trace(pathlib.Path(tmp))
    steps = engine.workload.chunk_steps
    totals = exclusive_times(events, MODULE)
    if not totals:
        raise RuntimeError(f"the profiler's trace holds no op of {MODULE}: nothing to attribute the step to")
    by_label: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, None])
    for op, (us, calls) in totals.items():
        entry = by_label[labels.get(op, f"XLA {op}")]
        entry[0] += us
        entry[1] += calls
        entry[2] = flops.get(op)  # one label, one shape: the same flops
    ops = sorted((OpTime(label=label, calls_per_step=calls / steps, us_per_step=us / steps, flops_per_call=f)
                  for label, (us, calls, f) in by_label.items()), key=lambda op: -op.us_per_step)
    return StepProfile(steps=steps, wall_ms_per_step=wall / steps * 1e3, ops=tuple(ops),
                       on_host=jax.default_backend() == "cpu")


def read_trace(folder: pathlib.Path) -> list[dict]:
    """The complete events ("ph": "X") of the Perfetto trace the profiler wrote under ``folder``."""
    found = sorted(folder.rglob("*.trace.json.gz"))
    if not found:
        raise RuntimeError(f"the profiler wrote no Perfetto trace under {folder}")
    with gzip.open(found[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def exclusive_times(events: list[dict], module: str) -> dict[str, tuple[float, int]]:
    """{hlo_op: (exclusive µs, calls)} over the events of ``module``: each event's span less the spans of
    the events nested in it on the same thread (a loop's body, a conditional's branch)."""
    mine = [e for e in events if (e.get("args") or {}).get("hlo_module") == module and (e.get("args") or {}).get("hlo_op")]
    by_thread: dict = collections.defaultdict(list)
    for e in mine:
        by_thread[e.get("pid"), e.get("tid")].append(e)
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        open_spans: list[list] = []  # [end, op, exclusive µs]
        for e in thread_events:
            start, dur = float(e["ts"]), float(e["dur"])
            while open_spans and open_spans[-1][0] <= start:
                _close(open_spans.pop(), totals)
            if open_spans:
                open_spans[-1][2] -= dur  # nested: its time is its own, not its parent's
            open_spans.append([start + dur, e["args"]["hlo_op"], dur])
        while open_spans:
            _close(open_spans.pop(), totals)
    return {op: (us, calls) for op, (us, calls) in totals.items()}


def _close(span: list, totals: dict) -> None:
    _, op, exclusive = span
    totals[op][0] += max(exclusive, 0.0)
    totals[op][1] += 1


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\(")
_SHAPE = re.compile(r"[a-z]+\d*\[[\d,]*\]")
# Steps of an op's metadata path that say how it is nested, not where in the model it comes from.
_PLUMBING = re.compile(r"^(jit\(.*\)|while|body|closed_call|cond|branch_\d+_fun|checkpoint|remat|pjit)$")


def op_labels(program_text: str) -> dict[str, str]:
    """{op name: label} from a compiled program's text. A kernel (custom call) is labelled by where in the
    model it runs, its target, its float operands and its result, e.g. ``DecoderLayer/attn.project:
    matmul_panels_f32 f32[32,288] · f32[6,54,288,16] → f32[32,864]``; any other op by its name and where
    it runs, ``XLA wrapped_scatter (DecoderLayer)``."""
    labels = {}
    for line in program_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, result, opcode = m.groups()
        path = re.search(r'op_name="([^"]*)"', line)
        where = "/".join(step for step in (path.group(1).split("/")[:-1] if path else [])
                         if not _PLUMBING.match(step))
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if opcode == "custom-call" and target:
            constraints = re.search(r"operand_layout_constraints=\{(.*?)\}, \w+=", line)
            operands = [shape for shape in _SHAPE.findall(constraints.group(1) if constraints else "")
                        if not shape.startswith(("s32", "pred"))]  # not the layer index, positions, lengths
            call = target.group(1).removeprefix("llm_jax_")
            shapes = " · ".join(operands)
            labels[name] = (f"{where + ': ' if where else ''}{call}{' ' + shapes if shapes else ''} → "
                            f"{' + '.join(_SHAPE.findall(result))}")
        else:
            labels[name] = f"XLA {name}" + (f" ({where})" if where else "")
    return labels


def op_flops(program_text: str) -> dict[str, int]:
    """{op name: flops per call} for the matrix-product kernels of a compiled program's text: x [R, K] (the
    first float operand) times weights giving results [R, N_i], 2 · R · K · Σ N_i."""
    flops = {}
    for line in program_text.splitlines():
        m = _INSTRUCTION.match(line)
        target = re.search(r'custom_call_target="llm_jax_matmul_[^"]*"', line)
        constraints = re.search(r"operand_layout_constraints=\{(.*?)\}, \w+=", line)
        if not (m and m.group(3) == "custom-call" and target and constraints):
            continue
        operands = [s for s in _SHAPE.findall(constraints.group(1)) if s.startswith(("f", "bf"))]
        results = [_dims(s) for s in _SHAPE.findall(m.group(2))]
        if not operands or not results:
            continue
        R, K = _dims(operands[0])[-2:]
        flops[m.group(1)] = 2 * R * K * sum(dims[-1] for dims in results)
    return flops


def _dims(shape: str) -> list[int]:
    inside = shape[shape.index("[") + 1:-1]
    return [int(d) for d in inside.split(",")] if inside else []


def table(profile: StepProfile, title: str, top: int = 16) -> str:
    """The profile as text: the ``top`` largest ops, the rest in one line, and the ops' total against the
    chunk's wall time."""
    ops = list(profile.ops)
    shown, rest = ops[:top], ops[top:]
    total_us = profile.ops_ms_per_step * 1e3
    width = max([len(op.label) for op in shown] + [24])
    where = "" if profile.on_host else " (not on the host: launches only, not the device's work)"
    lines = [f"where a decode step's time goes: {title}, {profile.steps} traced steps{where}",
             f"  {'op'.ljust(width)}  calls/step   µs/step   share  GFLOP/s"]
    for op in shown:
        rate = "" if op.gflops is None else f"{op.gflops:7.1f}"
        lines.append(f"  {op.label.ljust(width)}  {op.calls_per_step:10.1f}  {op.us_per_step:8.1f}  "
                     f"{100 * op.us_per_step / total_us:5.1f} %  {rate}".rstrip())
    if rest:
        us = sum(op.us_per_step for op in rest)
        label = f"{len(rest)} more ops"
        lines.append(f"  {label.ljust(width)}  {sum(op.calls_per_step for op in rest):10.1f}  {us:8.1f}  "
                     f"{100 * us / total_us:5.1f} %")
    lines.append(f"  ops in all {profile.ops_ms_per_step:.2f} ms per step; the traced chunk took "
                 f"{profile.wall_ms_per_step:.2f} ms per step on the host's clock")
    return "\n".join(lines)
