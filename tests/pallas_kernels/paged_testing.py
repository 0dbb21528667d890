"""Shared pieces of the ragged paged attention tests: a serving step's cases, their inputs (pages
and rows in shuffled order, or int8 pages with their scales), stale pages, and the calls of the
reference and both variants.

A case lists each sequence's (num_tokens, seq_len): (1, n) a decode token, (n, n) a whole prompt,
(n, m > n) a prefill chunk after m - n cached tokens, (0, 0) a padding sequence.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attention_testing import GPU_INTERPRET, TPU_INTERPRET
from llm_jax.kv_cache import dequantize_kv, quantize_kv
from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu
from pallas_kernels.reference import ragged_paged_attention_reference

NULL_PAGE = 0  # what the scheduler pads block tables with (llm_jax.serving.blocks.NULL_BLOCK)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCase:
    """One serving step: each sequence's (num_tokens, seq_len); (0, 0) is a padding sequence."""

    seqs: tuple[tuple[int, int], ...]
    T: int  # rows of q; those past the sequences' tokens are padding, spread between them
    N: int
    K: int
    H: int
    Z: int  # tokens per page
    spare_pages: int = 3  # pool pages no sequence uses
    dtype: str = "float32"
    sliding_window: int | None = None
    logit_softcap: float | None = None
    block_q: int | None = None
    block_k: int | None = None  # GPU
    num_splits: int | None = None  # GPU
    pages_per_step: int | None = None  # TPU

    def __post_init__(self):
        assert self.N % self.K == 0 and sum(n for n, _ in self.seqs) <= self.T, self
        assert all(0 <= n <= length for n, length in self.seqs), self

    def __str__(self):
        seqs = "-".join(f"{n}of{length}" for n, length in self.seqs)
        fields = [f"T{self.T}N{self.N}K{self.K}H{self.H}Z{self.Z}", self.dtype, seqs]
        for name in ("sliding_window", "logit_softcap", "block_q", "block_k", "num_splits",
                     "pages_per_step"):
            if (value := getattr(self, name)) is not None:
                fields.append(f"{name}={value}")
        return ",".join(fields)

    @property
    def X(self) -> int:
        return max(1, max(-(-length // self.Z) for _, length in self.seqs))

    @property
    def options(self) -> dict:
        return dict(sm_scale=self.H ** -0.5, sliding_window=self.sliding_window,
                    logit_softcap=self.logit_softcap)


@dataclasses.dataclass(frozen=True)
class PagedInputs:
    q_TNH: jax.Array
    k_pages: jax.Array  # [P, Z, K, H], or [L, P, Z, K, H]
    v_pages: jax.Array
    block_tables_BX: jax.Array
    query_start_B: jax.Array
    num_tokens_B: jax.Array
    seq_lens_B: jax.Array

    @property
    def args(self) -> tuple:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def replace(self, **changes) -> "PagedInputs":
        return dataclasses.replace(self, **changes)


def paged_inputs(case: PagedCase, seed: int = 0, num_layers: int | None = None) -> PagedInputs:
    """Standard normal q and pages; sequences' rows of q and their pages in shuffled order."""
    rng = np.random.default_rng(seed)
    B, Z = len(case.seqs), case.Z
    num_tokens = np.array([n for n, _ in case.seqs], np.int32)
    seq_lens = np.array([length for _, length in case.seqs], np.int32)
    pages_needed = -(-seq_lens // Z)
    P = int(pages_needed.sum()) + case.spare_pages
    pool = rng.permutation(P)
    block_tables = np.full((B, case.X), NULL_PAGE, np.int32)
    used = 0
    for b, count in enumerate(pages_needed):
        block_tables[b, :count] = pool[used:used + count]
        used += count
    # Runs of rows in shuffled order, the padding rows spread over the gaps between them.
    gaps = np.bincount(rng.integers(0, B + 1, case.T - num_tokens.sum()), minlength=B + 1)
    query_start = np.zeros(B, np.int32)
    row = gaps[0]
    for i, b in enumerate(rng.permutation(B)):
        query_start[b] = row
        row += num_tokens[b] + gaps[i + 1]
    dtype = jnp.dtype(case.dtype)
    stack = () if num_layers is None else (num_layers,)
    pages_shape = (*stack, P, Z, case.K, case.H)
    return PagedInputs(
        q_TNH=jnp.asarray(rng.standard_normal((case.T, case.N, case.H)), dtype),
        k_pages=jnp.asarray(rng.standard_normal(pages_shape), dtype),
        v_pages=jnp.asarray(rng.standard_normal(pages_shape), dtype),
        block_tables_BX=jnp.asarray(block_tables),
        query_start_B=jnp.asarray(query_start),
        num_tokens_B=jnp.asarray(num_tokens),
        seq_lens_B=jnp.asarray(seq_lens),
    )


def int8_inputs(inputs: PagedInputs, seed: int = 0) -> PagedInputs:
    """The inputs with int8 pages: each page row's keys and values times a random magnitude per
    slot and kv head (0.2 to 5, so every scale differs), quantized by llm_jax's ``quantize_kv``
    into pairs (int8 values, float32 scales)."""
    rng = np.random.default_rng(seed)

    def quantized(pages):
        magnitude = rng.uniform(0.2, 5.0, (*pages.shape[:-1], 1))
        return quantize_kv(jnp.asarray(np.asarray(pages, np.float32) * magnitude))

    return inputs.replace(k_pages=quantized(inputs.k_pages), v_pages=quantized(inputs.v_pages))


def dequantized(inputs: PagedInputs) -> PagedInputs:
    """Int8 inputs with their pages dequantized to float32 (``dequantize_kv``)."""
    return inputs.replace(k_pages=dequantize_kv(*inputs.k_pages),
                          v_pages=dequantize_kv(*inputs.v_pages))


def stale_pages(pages: jax.Array, inputs: PagedInputs, Z: int) -> jax.Array:
    """pages with NaN in every row no sequence holds: unused pages, tails of partial pages."""
    held = np.zeros(pages.shape[-4:-2], bool)
    tables, lengths = np.asarray(inputs.block_tables_BX), np.asarray(inputs.seq_lens_B)
    for b, length in enumerate(lengths):
        for s in range(length):
            held[tables[b, s // Z], s % Z] = True
    return jnp.where(jnp.asarray(held)[..., None, None], pages, jnp.nan)


def reference(case: PagedCase, inputs: PagedInputs, layer=None) -> jax.Array:
    return ragged_paged_attention_reference(*inputs.args, **case.options, layer=layer)


def run_gpu(case: PagedCase, inputs: PagedInputs, **kwargs) -> jax.Array:
    return ragged_paged_attention_gpu(
        *inputs.args, **case.options, block_q=case.block_q, block_k=case.block_k,
        num_splits=case.num_splits, interpret=GPU_INTERPRET, poison_output=True, **kwargs)


def run_tpu(case: PagedCase, inputs: PagedInputs, poison_output: bool = True, **kwargs
            ) -> jax.Array:
    return ragged_paged_attention_tpu(
        *inputs.args, **case.options, block_q=case.block_q, pages_per_step=case.pages_per_step,
        interpret=TPU_INTERPRET, poison_output=poison_output, **kwargs)


def assert_padding_rows_zero(out: jax.Array, inputs: PagedInputs) -> None:
    owned = np.zeros(out.shape[0], bool)
    for start, n in zip(np.asarray(inputs.query_start_B), np.asarray(inputs.num_tokens_B)):
        owned[start:start + n] = True
    assert not np.asarray(out, np.float32)[~owned].any(), "padding rows of q must give exactly 0"


def random_cases(count: int, seed: int) -> list[PagedCase]:
    """Seeded random steps mixing every kind of sequence, odd shapes, every option."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        seqs = []
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.choice(["decode", "chunk", "prompt", "padding"], p=[0.4, 0.3, 0.2, 0.1])
            if kind == "decode":
                seqs.append((1, int(rng.integers(1, 60))))
            elif kind == "chunk":
                n = int(rng.integers(2, 20))
                seqs.append((n, n + int(rng.integers(1, 40))))
            elif kind == "prompt":
                n = int(rng.integers(1, 25))
                seqs.append((n, n))
            else:
                seqs.append((0, 0))
        K, G = int(rng.integers(1, 4)), int(rng.choice([1, 2, 3, 4, 8]))
        T = max(1, sum(n for n, _ in seqs) + int(rng.integers(0, 4)))
        cases.append(PagedCase(
            seqs=tuple(seqs), T=T, N=K * G, K=K, H=int(rng.choice([16, 24, 40, 64])),
            Z=int(rng.choice([3, 4, 5, 8, 16])), dtype=str(rng.choice(["float32", "bfloat16"])),
            sliding_window=rng.choice([None, int(rng.integers(1, 30))]),
            logit_softcap=rng.choice([None, 5.0]),
            block_q=int(rng.choice([1, 2, 3, 5, 8])), block_k=int(rng.choice([16, 32])),
            num_splits=int(rng.choice([1, 2, 3])),
        ))
    return cases


def int8_cache_step(backend, mesh=None, seed: int = 0) -> tuple:
    """One serving step of ``backend.paged_attention`` (llm_jax) over an int8 paged cache
    (``kv_cache.Int8KV``) whose every slot holds something already, written through
    ``kv_cache.write_slots`` at various magnitudes: a chunk of 5 tokens, two decode tokens and a
    padding sequence; GQA 2, pages of 3 in shuffled order, partial last pages, a window of 6 and a
    soft-cap of 20 on layer 1 of 2. Returns (o_TNH, k pages, v pages) after the step's writes."""
    from llm_jax import kv_cache as kvc
    from llm_jax.config import ModelConfig

    config = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=16, d_ff=32, max_seq_len=64, attn_logit_softcap=20.0)
    P, Z, K, H, N = 14, 3, config.n_kv_heads, config.head_dim, config.n_heads
    rng = np.random.default_rng(seed)
    cache = kvc.init_paged_cache(config, P, Z, "int8")
    old = rng.normal(size=(P * Z, K, H)) * rng.uniform(0.2, 5.0, (P * Z, K, 1))
    cache = kvc.PagedKVCache(*(kvc.write_slots(pages, 1, jnp.arange(P * Z),
                                               jnp.asarray(old * w, jnp.float32))
                               for pages, w in ((cache.k_LPZKH, 1.0), (cache.v_LPZKH, 3.0))))
    # Sequence 0: 5 tokens ending at position 10 (pages 9, 2, 12, 5); 1: a decode token at 6
    # (pages 7, 3, 11); 2: padding; 3: a decode token at 0 (page 4). T = 8: one padding row.
    slots = [2 * Z + 0, 2 * Z + 1, 2 * Z + 2, 12 * Z + 0, 12 * Z + 1, 11 * Z + 0, 4 * Z, -1]
    batch = kvc.PagedBatch(
        slots_T=jnp.array(slots, jnp.int32),
        block_tables_BX=jnp.array([[9, 2, 12, 5], [7, 3, 11, 0], [0, 0, 0, 0], [4, 0, 0, 0]],
                                  jnp.int32),
        query_start_B=jnp.array([0, 5, 7, 6], jnp.int32),
        num_tokens_B=jnp.array([5, 1, 0, 1], jnp.int32),
        seq_lens_B=jnp.array([11, 7, 0, 1], jnp.int32), max_query_len=5)
    q_TNH, k_TKH, v_TKH = (jnp.asarray(rng.normal(size=(8, n, H)), jnp.float32)
                           for n in (N, K, K))

    @jax.jit
    def step(q, k, v, k_pages, v_pages):
        return backend.paged_attention(q, k, v, k_pages, v_pages, jnp.int32(1), batch,
                                       config=config, window=6, mesh=mesh)

    return step(q_TNH, k_TKH, v_TKH, cache.k_LPZKH, cache.v_LPZKH)
