"""Benchmark rows: repeated runs summarised (median, min, max), printed as a table or written as JSON."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import numpy as np

from benchmarking.llm_jax_engine import Compiled, Run, Workload
from benchmarking.machine import Machine, RunBandwidth
from benchmarking.roofline import ComputeRoofline, Roofline, arithmetic_seconds, head_peak, product_peak


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        values = np.asarray(values, np.float64)
        return cls(median=float(np.median(values)), min=float(values.min()), max=float(values.max()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One engine on one workload. Scalars are medians over the repeats; ``*_spread`` give min and max."""

    engine: str
    backend: str | None  # the llm_jax backend's name ("cpu", "xla", "pallas"); None for transformers
    shape: str
    dtype: str
    batch: int
    prompt_len: int
    new_tokens: int  # generated per sequence (decode steps rounded up to whole chunks, plus the first)
    repeats: int
    compile_s: float  # prefill + decode
    compile_prefill_s: float
    compile_decode_s: float
    first_ttft_s: float  # the first call's time to first token, compilation included
    ttft_s: float
    itl_p50_s: float
    itl_p90_s: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    roofline_tokens_per_s: float
    roofline_fraction: float
    bytes_per_step: int
    # The same bound at the bandwidth a read of bytes_per_step bytes reaches (they may stay in a cache
    # between steps: then it is the cache's, and beats the roofline of memory); None when not measured.
    bandwidth_at_size_gbps: float | None
    roofline_at_size_tokens_per_s: float | None
    roofline_at_size_fraction: float | None
    # The bandwidth a streaming read sustained around each run (the better of just before and just after;
    # None with --bandwidth), and the median over the runs of each run's rate over the roofline at its own
    # bandwidth: like for like on a machine whose bandwidth moves while it runs. The same for the fastest
    # single read around each run (a burst of the host's memory, which a run lasting longer sees only
    # part of).
    run_bandwidth_gbps: Spread | None
    roofline_at_run_fraction: float | None
    run_burst_bandwidth_gbps: Spread | None
    roofline_at_run_burst_fraction: float | None
    # The arithmetic bound (roofline.compute_roofline): the flops of a step, and the token rate the
    # arithmetic peaks measured before and after the runs allow (None where not measured). It binds where
    # it is below the memory roofline: batched decode.
    product_flops_per_step: int
    attention_flops_per_step: int
    # The screen llm_jax's greedy steps read the LM head through ("int8", "bfloat16", "int8_quads"; None:
    # the head itself; llm_jax.backends.cpu.greedy_head): bytes_per_step counts it in place of the head,
    # for every engine's row (the bound of the computation llm_jax does); and of product_flops_per_step,
    # the LM head's when through the bfloat16 screen or the quads, at the bfloat16 or int8 peak.
    head_screen: str | None
    screened_head_flops_per_step: int
    compute_roofline_tokens_per_s: float | None
    compute_roofline_fraction: float | None
    kv_cache_bytes_per_token: int
    peak_rss_mb: float
    kv_cache_mb: float | None  # the allocated cache (llm_jax)
    decode_aliased_mb: float | None  # decode outputs written into donated inputs (≥ the cache: in place)
    decode_temp_mb: float | None  # decode scratch memory
    decode_tokens_per_s_spread: Spread
    decode_tokens_per_s_runs: tuple[float, ...]  # each run's, in the order of the repeats (for paired ratios)
    ttft_s_spread: Spread
    prefill_tokens_per_s_spread: Spread

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarise(*, engine: str, backend: str | None, shape: str, dtype: str, workload: Workload, compiled: Compiled,
              runs: Sequence[Run], roofline: Roofline, compute: ComputeRoofline, kv_bytes_per_token: int,
              peak_rss_mb: float, run_bandwidths: Sequence[RunBandwidth] = (), peaks_measured: bool = True,
              head_screen: str | None = None) -> Row:
    """``runs`` in one row; ``run_bandwidths[i]`` is the bandwidth measured around run i; ``compute``
    at the measured arithmetic peaks (without ``peaks_measured``, its flops only)."""
    B = workload.batch
    decode_rate = [r.decode_tokens / r.decode_s for r in runs]

    def around_runs(gbps: Sequence[float]) -> tuple[Spread | None, float | None]:
        if not run_bandwidths:
            return None, None
        return Spread.of(gbps), float(np.median([rate * roofline.bytes_per_step / (B * g * 1e9)
                                                 for rate, g in zip(decode_rate, gbps)]))

    at_run = around_runs([b.sustained_gbps for b in run_bandwidths])
    at_burst = around_runs([b.burst_gbps for b in run_bandwidths])
    prefill_rate = [B * workload.prompt_len / r.ttft_s for r in runs]
    steps = np.concatenate([r.step_s for r in runs])
    decode = Spread.of(decode_rate)
    memory = compiled.decode_memory
    return Row(engine=engine, backend=backend, shape=shape, dtype=dtype, batch=B, prompt_len=workload.prompt_len,
               new_tokens=1 + workload.decode_steps, repeats=len(runs),
               compile_s=compiled.prefill_s + compiled.decode_s, compile_prefill_s=compiled.prefill_s,
               compile_decode_s=compiled.decode_s, first_ttft_s=compiled.first_ttft_s,
               ttft_s=float(np.median([r.ttft_s for r in runs])),
               itl_p50_s=float(np.percentile(steps, 50)), itl_p90_s=float(np.percentile(steps, 90)),
               decode_tokens_per_s=decode.median, prefill_tokens_per_s=float(np.median(prefill_rate)),
               roofline_tokens_per_s=roofline.tokens_per_s, roofline_fraction=decode.median / roofline.tokens_per_s,
               bytes_per_step=roofline.bytes_per_step, bandwidth_at_size_gbps=None,
               roofline_at_size_tokens_per_s=None, roofline_at_size_fraction=None,
               run_bandwidth_gbps=at_run[0], roofline_at_run_fraction=at_run[1],
               run_burst_bandwidth_gbps=at_burst[0], roofline_at_run_burst_fraction=at_burst[1],
               product_flops_per_step=compute.product_flops,
               attention_flops_per_step=compute.attention_flops,
               head_screen=head_screen, screened_head_flops_per_step=compute.screened_head_flops,
               compute_roofline_tokens_per_s=compute.tokens_per_s if peaks_measured else None,
               compute_roofline_fraction=decode.median / compute.tokens_per_s if peaks_measured else None,
               kv_cache_bytes_per_token=kv_bytes_per_token,
               peak_rss_mb=peak_rss_mb, kv_cache_mb=_mib(memory and memory.cache_bytes),
               decode_aliased_mb=_mib(memory and memory.aliased_bytes),
               decode_temp_mb=_mib(memory and memory.temp_bytes),
               decode_tokens_per_s_spread=decode, decode_tokens_per_s_runs=tuple(decode_rate),
               ttft_s_spread=Spread.of([r.ttft_s for r in runs]), prefill_tokens_per_s_spread=Spread.of(prefill_rate))


def at_bandwidth(row: Row, bandwidth_gbps: float, measured_gbps: float) -> Row:
    """``row`` (its roofline from ``bandwidth_gbps``) with the roofline of ``measured_gbps`` instead."""
    scale = measured_gbps / bandwidth_gbps
    return dataclasses.replace(row, roofline_tokens_per_s=row.roofline_tokens_per_s * scale,
                               roofline_fraction=row.roofline_fraction / scale)


def at_size(row: Row, bandwidth_gbps: float) -> Row:
    """``row`` with the roofline of ``bandwidth_gbps``, the bandwidth of reading ``row.bytes_per_step`` bytes."""
    roof = row.batch * bandwidth_gbps * 1e9 / row.bytes_per_step
    return dataclasses.replace(row, bandwidth_at_size_gbps=bandwidth_gbps, roofline_at_size_tokens_per_s=roof,
                               roofline_at_size_fraction=row.decode_tokens_per_s / roof)


def at_peaks(row: Row, peaks: tuple[float, float, float]) -> Row:
    """``row`` with the compute roofline of (float32, bfloat16, int8) arithmetic ``peaks``."""
    seconds = arithmetic_seconds(row.product_flops_per_step, row.attention_flops_per_step,
                                 product_peak(row.dtype, peaks), peaks[0],
                                 head_flops=row.screened_head_flops_per_step,
                                 head_gflops=head_peak(row.head_screen, peaks))
    roof = row.batch / seconds
    return dataclasses.replace(row, compute_roofline_tokens_per_s=roof,
                               compute_roofline_fraction=row.decode_tokens_per_s / roof)


def paired_ratio(row: Row, base: Row) -> Spread:
    """``row``'s decode rate over ``base``'s, repeat by repeat (runs of the same round, which took turns:
    the same moments of the machine), summarised as median, min and max."""
    if len(row.decode_tokens_per_s_runs) != len(base.decode_tokens_per_s_runs):
        raise ValueError(f"paired_ratio needs rows of as many repeats, got {row.repeats} and {base.repeats}")
    return Spread.of([a / b for a, b in zip(row.decode_tokens_per_s_runs, base.decode_tokens_per_s_runs)])


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def agreement(a_BS: np.ndarray, b_BS: np.ndarray) -> float:
    """Fraction of rows whose greedy tokens agree, measured up to each row's first difference: 1.0 when
    both engines generate the same text."""
    n = min(a_BS.shape[1], b_BS.shape[1])
    same = a_BS[:, :n] == b_BS[:, :n]
    prefix = np.where(same.all(axis=1), n, same.argmin(axis=1))
    return float(prefix.mean() / n)


@dataclasses.dataclass(frozen=True)
class Difference:
    """Where a row of greedy tokens first differs from the reference's."""

    row: int
    step: int  # 0: the token after the prompt
    # ours is the reference's second choice there: its logit lies ``gap`` below the reference's best
    # (None where it is not, or the reference did not say)
    gap: float | None = None

    @property
    def at_tie(self) -> bool:
        """The reference's two best logits were equal there, and ours is the one its argmax did not take."""
        return self.gap == 0.0


def first_differences(ours_BS: np.ndarray, reference_BS: np.ndarray, runner_up_BS: np.ndarray | None = None,
                      runner_up_gap_BS: np.ndarray | None = None) -> list[Difference]:
    """Each row's first difference from the reference (rows that agree throughout are left out);
    ``runner_up_BS`` and ``runner_up_gap_BS`` as in ``Run.runner_up`` and ``Run.runner_up_gap`` for the
    reference."""
    n = min(ours_BS.shape[1], reference_BS.shape[1])
    out = []
    for b in range(ours_BS.shape[0]):
        differs = np.flatnonzero(ours_BS[b, :n] != reference_BS[b, :n])
        if differs.size:
            s = int(differs[0])
            second = runner_up_BS is not None and runner_up_gap_BS is not None and runner_up_BS[b, s] == ours_BS[b, s]
            out.append(Difference(row=b, step=s, gap=float(runner_up_gap_BS[b, s]) if second else None))
    return out


def describe_differences(differences: Sequence[Difference], reference: str = "transformers") -> str:
    """``differences`` from the ``reference`` engine's tokens in words, for the agreement line of the benchmark."""
    if not differences:
        return ""
    first = min(differences, key=lambda d: d.step)
    where = f"row {first.row} first at step {first.step}" if len(differences) > 1 else f"at step {first.step}"
    gaps = [d.gap for d in differences if d.gap is not None]
    owner = f"{reference}'" if reference.endswith("s") else f"{reference}'s"
    said = f"; {len(differences)} row(s) differ, {where}; "
    if not gaps:
        return said + f"none of them first where ours is {owner} second choice"
    return (said + f"{len(gaps)} of them first where ours is {owner} second choice, "
            f"{', '.join(f'{g:.3g}' for g in gaps)} below its best logit (0: a tie, which its argmax breaks by the "
            f"lower id)")


COLUMNS = ("engine", "shape", "dtype", "B", "prompt", "new", "compile s", "ttft ms", "itl p50/p90 ms",
           "decode tok/s (min–max)", "prefill tok/s", "roofline", "% roof", "% roof@run", "% @burst", "% roof@size",
           "flop roof", "% flop", "peak MiB")


def table(rows: Sequence[Row], ratios: dict[int, float] | None = None) -> str:
    """Rows as a fixed-width table; ``ratios[i]`` (llm_jax ÷ transformers decode rate) adds a column."""
    header = COLUMNS + (("× hf",) if ratios else ())
    cells = []
    for i, r in enumerate(rows):
        d = r.decode_tokens_per_s_spread
        row = (r.engine, r.shape, r.dtype, str(r.batch), str(r.prompt_len), str(r.new_tokens),
               f"{r.compile_prefill_s:.1f}+{r.compile_decode_s:.1f}", f"{r.ttft_s * 1e3:.1f}",
               f"{r.itl_p50_s * 1e3:.2f}/{r.itl_p90_s * 1e3:.2f}", f"{d.median:.1f} ({d.min:.1f}–{d.max:.1f})",
               f"{r.prefill_tokens_per_s:.0f}", f"{r.roofline_tokens_per_s:.0f}", f"{100 * r.roofline_fraction:.0f}",
               _percent(r.roofline_at_run_fraction), _percent(r.roofline_at_run_burst_fraction),
               _percent(r.roofline_at_size_fraction),
               "" if r.compute_roofline_tokens_per_s is None else f"{r.compute_roofline_tokens_per_s:.0f}",
               _percent(r.compute_roofline_fraction),
               f"{r.peak_rss_mb:.0f}")
        if ratios:
            row += (f"{ratios[i]:.2f}" if i in ratios else "",)
        cells.append(row)
    return format_table(header, cells, left=3)


def format_table(header: Sequence[str], cells: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """Fixed-width columns under a rule: the first ``left`` columns aligned left (names), the rest right
    (numbers)."""
    widths = [max([len(h), *(len(c[j]) for c in cells)]) for j, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) if j < left else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths)))
             for line in (header, *cells)]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _percent(fraction: float | None) -> str:
    return "" if fraction is None else f"{100 * fraction:.0f}"


def write_json(path: pathlib.Path, machine: Machine, rows: Sequence[Row], extra: dict | None = None) -> None:
    """The report as JSON at ``path``, whole or not at all (written beside it, then renamed)."""
    import os

    payload = {"machine": machine.to_dict(), "rows": [r.to_dict() for r in rows], **(extra or {})}
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(partial, path)
