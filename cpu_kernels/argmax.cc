// Greedy decoding's argmax over the vocabulary, as XLA FFI custom calls.
//
// ArgmaxF32: i[b] = the first index of the largest value of x[b, :] (of the first NaN where a row has
// one), as jnp.argmax.
//
// ScreenedArgmax{F32,BF16}: the greedy token of logits x[b] · W (W float32 or bfloat16) that were not
// computed, from logits that were, through a narrower copy of W (its screen: bfloat16 for a float32 W,
// int8 with a scale per column for either: fewer bytes to read; at many rows the int8 one in quads, x
// quantized too: half the arithmetic of bfloat16's), and W itself for the few columns that can still
// win. The token is the unscreened path's, jnp.argmax of matmul.cc's product x · W of the same B rows (x
// rounded to W's dtype): the screen bounds how far each screened logit lies from that product's float32
// logit (llm_jax/backends/cpu/greedy_head.py), and the columns that can still win have their logits
// computed by the product's own inner routines for B rows (panel_row_product), bit for bit its values.
// Both heads take the product's options (attributes `amx` and `bf16_dot`, PanelOptions): the unscreened
// path they stand for is the product with those options, whose path the exact check repeats.
//
// QuadsArgmax{F32,BF16}: the same through the int8 screen in quads, with the screen's product in the same
// call (matmul.cc's quads_units): its logits are bounded a unit of columns at a time, never written.
//
// XLA:CPU computes an argmax as a reduction of (value, index) pairs, one element at a time, a noticeable
// share of a small model's decode step at large batch. Here each row is read once, 32 lanes at a time;
// rows are shared among the threads.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

// The index jnp.argmax gives for one row of V values, in one pass: each of 4 × 8 lanes keeps its largest
// value and where it first saw it (a strict > keeps the first; four independent chains, as one would
// wait on itself every step), then the lanes' maxima are merged, the smallest index winning ties. A row
// with a NaN is scanned again for its first NaN.
int32_t row_argmax(const float* x, int64_t V) {
  const int64_t v_vec = V / 32 * 32;
  f32x8 best[4];
  i32x8 at[4], nans = splat_i32(0);
  const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int u = 0; u < 4; ++u) best[u] = splat(-std::numeric_limits<float>::infinity()), at[u] = splat_i32(0);
  for (int64_t v = 0; v < v_vec; v += 32) {
    for (int u = 0; u < 4; ++u) {
      const f32x8 a = load8(x + v + 8 * u);
      nans |= a != a;  // NaN is unequal to itself
      const i32x8 higher = a > best[u];
      best[u] = higher ? a : best[u];
      at[u] = higher ? lane + static_cast<int32_t>(v + 8 * u) : at[u];
    }
  }
  bool nan = false;
  float m = -std::numeric_limits<float>::infinity();
  int32_t index = 0;
  for (int i = 0; i < 8; ++i) {
    nan |= nans[i] != 0;
    for (int u = 0; u < 4; ++u) {
      if (best[u][i] > m || (best[u][i] == m && at[u][i] < index)) m = best[u][i], index = at[u][i];
    }
  }
  for (int64_t v = v_vec; v < V; ++v) {
    nan |= std::isnan(x[v]);
    if (x[v] > m) m = x[v], index = static_cast<int32_t>(v);
  }
  if (nan) {
    for (int64_t v = 0; v < V; ++v) {
      if (std::isnan(x[v])) return static_cast<int32_t>(v);
    }
  }
  return index;
}

// fn(b) for each of B rows of V values, shared among the threads: rows of at least 16 K values are worth
// a thread each; shorter ones go together.
template <typename Fn>
void for_each_row(ffi::ThreadPool& pool, int64_t B, int64_t V, const Fn& fn) {
  const int64_t rows_per_unit = std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1));
  parallel_for(pool, (B + rows_per_unit - 1) / rows_per_unit, [&](int64_t unit) {
    for (int64_t b = unit * rows_per_unit; b < std::min(B, (unit + 1) * rows_per_unit); ++b) fn(b);
  });
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> x, ffi::ResultBuffer<ffi::S32, 1> out) {
  const int64_t B = x.dimensions()[0], V = x.dimensions()[1];
  const float* data = x.typed_data();
  int32_t* index = out->typed_data();
  for_each_row(pool, B, V, [&](int64_t b) { index[b] = row_argmax(data + b * V, V); });
  return ffi::Error::Success();
}

auto Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32, 2>>().Ret<ffi::Buffer<ffi::S32, 1>>();
}

// The LM head W [D, V] held as panels [V / 16, D, 16] (float32, or bfloat16 bits), its logits as the
// unscreened path computes them: matmul.cc's product of R rows on `threads` threads with `options` (the
// call's R, pool and attributes), a panel of 16 columns of one row at a time (panel_row_product), bit for
// bit that product's float32 values.
template <typename H>
struct Head {
  const H* panels;
  int64_t D, V, R, threads;
  PanelOptions options;

  // logits[0:16] of row x [D] (as_head_rows's) against panel q: columns 16 q … 16 q + 15.
  void panel(const float* x, int64_t q, float* logits) const {
    panel_row_product(x, panels + q * D * 16, V, R, D, threads, options, logits);
  }
};

// n values of x as the head's product reads them (matmul rounds x to W's dtype): a float32 head's as they
// are, a bfloat16 head's rounded to bfloat16, into `rounded`.
inline const float* as_head_rows(const float* x, int64_t, const float*, std::vector<float>&) { return x; }

inline const float* as_head_rows(const float* x, int64_t n, const uint16_t*, std::vector<float>& rounded) {
  rounded.resize(static_cast<size_t>(n));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(rounded.data() + i, round_to_bf16(load8(x + i)));
  for (; i < n; ++i) rounded[i] = round_to_bf16(x[i]);
  return rounded.data();
}

// The radius of a row's screened logits, r_j = s1 · first_j + s2 · norm_j (first_j: errors_j through the
// quads, else scales_j; none: 0), for x [D]: through the quads (`quads`: the int8 screen with x quantized
// too, δ = x − t n, quantize_row's n and t) s1 = c1 · (‖x‖₂ + ‖δ‖₂), s2 = c1 · ‖δ‖₂ + c2 · ‖x‖₂; else s1 =
// c1 · ‖x‖₁, s2 = c2 · ‖x‖₂. `finite`: false for a row with a NaN or an infinity (computed in full).
struct RowBound {
  float s1 = 0.f, s2 = 0.f;
  bool finite = false;
};

RowBound row_bound(const float* x, int64_t D, bool quads, double c1, double c2) {
  // The sums in double, eight lanes at a time where AVX-512 has them (another order of the same sums:
  // their rounding is far below the margin added at the end): the scalar loops' chains of dependent adds
  // are slow, and the fused greedy head bounds all its rows, serially, before its product.
  double l1 = 0.0, l2 = 0.0, d2 = 0.0;
  int64_t d = 0;
#if defined(__AVX512F__)
  __m512d a1 = _mm512_setzero_pd(), a2 = _mm512_setzero_pd();
  for (; d + 8 <= D; d += 8) {
    const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + d));
    a1 = _mm512_add_pd(a1, _mm512_abs_pd(v));
    a2 = _mm512_fmadd_pd(v, v, a2);
  }
  l1 = _mm512_reduce_add_pd(a1), l2 = _mm512_reduce_add_pd(a2);
#endif
  for (; d < D; ++d) {
    l1 += std::fabs(static_cast<double>(x[d]));
    l2 += static_cast<double>(x[d]) * static_cast<double>(x[d]);
  }
  if (quads) {  // what quantizing x changed, exactly (t n is exact in double, and so is x - t n)
    thread_local std::vector<int8_t> n;
    n.resize(static_cast<size_t>(D));
    const double t = quantize_row(x, D, n.data());
    d = 0;
#if defined(__AVX512F__)
    const __m512d tv = _mm512_set1_pd(t);
    __m512d a3 = _mm512_setzero_pd();
    for (; d + 8 <= D; d += 8) {
      int64_t bytes;
      std::memcpy(&bytes, n.data() + d, sizeof bytes);
      const __m512d nv = _mm512_cvtepi32_pd(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
      const __m512d delta = _mm512_fnmadd_pd(tv, nv, _mm512_cvtps_pd(_mm256_loadu_ps(x + d)));
      a3 = _mm512_fmadd_pd(delta, delta, a3);
    }
    d2 = _mm512_reduce_add_pd(a3);
#endif
    for (; d < D; ++d) {
      const double delta = static_cast<double>(x[d]) - t * n[d];
      d2 += delta * delta;
    }
  }
  const double x2 = std::sqrt(l2), delta2 = std::sqrt(d2);
  RowBound b;
  // Rounded up, and far beyond float's rounding of a_j ± r_j below (r_j is at least 0.4 % of |a_j|).
  b.s1 = static_cast<float>((quads ? c1 * (x2 + delta2) : c1 * l1) * (1.0 + 1e-3));
  b.s2 = static_cast<float>((quads ? c1 * delta2 + c2 * x2 : c2 * x2) * (1.0 + 1e-3));
  b.finite = std::isfinite(b.s1) && std::isfinite(b.s2);
  return b;
}

typedef int32_t ivec __attribute__((vector_size(sizeof(fvec))));

// The lanes of a comparison's result that hold true, as bits.
inline uint32_t lanes(ivec m) {
#if defined(__AVX512F__)
  return _mm512_movepi32_mask(reinterpret_cast<__m512i>(m));
#elif defined(__AVX__)
  return static_cast<uint32_t>(_mm256_movemask_ps(reinterpret_cast<__m256>(m)));
#else
  uint32_t bits = 0;
  for (int i = 0; i < kLanes; ++i) bits |= (m[i] != 0) << i;
  return bits;
#endif
}

inline bool any(ivec m) { return lanes(m) != 0; }

// The screened logits a_j = y_j · scales_j (y_j itself without scales) and their radii r_j of one row,
// kLanes columns at a time.
struct Screened {
  const float* scales;  // [V] or null
  const float* first;   // [V] (errors, else scales) or null
  const float* norms;   // [V]
  fvec s1, s2;

  Screened(const float* scales, const float* errors, const float* norms, const RowBound& b)
      : scales(scales), first(errors ? errors : scales), norms(norms), s1(fvec{} + b.s1), s2(fvec{} + b.s2) {}
  // Columns v … v + kLanes − 1, their unscaled logits y.
  void at(fvec y, int64_t v, fvec* a, fvec* r) const {
    const fvec nv = loadv(norms + v);
    *a = scales ? y * loadv(scales + v) : y;
    *r = first ? s1 * loadv(first + v) + s2 * nv : s2 * nv;
  }
  // Column v alone.
  void at(float y, int64_t v, float* a, float* r) const {
    *a = scales ? y * scales[v] : y;
    *r = (first ? s1[0] * first[v] : 0.f) + s2[0] * norms[v];
  }
};

// Where a NaN or an infinity lies in a.
inline ivec not_finite(fvec a) {
  const fvec inf = fvec{} + std::numeric_limits<float>::infinity();
  return (a != a) | (a == inf) | (a == -inf);
}

// The greedy token of x [D] from every logit, as jnp.argmax sees the head's product: the first NaN, else
// the first of the largest (a row with a NaN or an infinity).
template <typename H>
int32_t full_argmax(const float* x, const Head<H>& head) {
  float logits[16], best = -std::numeric_limits<float>::infinity();
  int32_t index = 0;
  for (int64_t q = 0; q < head.V / 16; ++q) {
    head.panel(x, q, logits);
    for (int i = 0; i < 16; ++i) {
      const int32_t v = static_cast<int32_t>(16 * q + i);
      if (std::isnan(logits[i])) return v;
      if (logits[i] > best || v == 0) best = logits[i], index = v;
    }
  }
  return index;
}

// The largest logit of the candidate columns (ascending: the first of equal logits stays), each computed as
// the head's product computes it, a candidate's panel at a time. Every line of every candidate's panel is
// asked for before the first is read (a panel's rows are lines apart, from memory; read one after another
// they wait on each). A lone candidate is the token without its logit: the column whose lower end is the
// threshold t is always a candidate (its upper end is no lower), and every other column's logit is at most
// its upper end, below t, so below the candidate's, which is at least t. A logit that is not finite (a
// float32 sum that overflowed) sends the row to full_argmax, as the unscreened argmax would see it.
template <typename H>
int32_t candidates_argmax(const float* x, const Head<H>& head, const std::vector<int64_t>& candidates) {
  if (candidates.size() <= 1) return candidates.empty() ? 0 : static_cast<int32_t>(candidates[0]);
  const int64_t rows_per_line = std::max<int64_t>(1, 64 / (16 * static_cast<int64_t>(sizeof(H))));
  for (size_t i = 0; i < candidates.size(); ++i) {
    const int64_t q = candidates[i] / 16;
    if (i > 0 && q == candidates[i - 1] / 16) continue;
    const H* w = head.panels + q * head.D * 16;
    for (int64_t d = 0; d < head.D; d += rows_per_line) __builtin_prefetch(w + d * 16);
  }
  float logits[16], best = 0.f;
  int64_t panel = -1;
  int32_t index = -1;
  for (const int64_t v : candidates) {
    if (v / 16 != panel) panel = v / 16, head.panel(x, panel, logits);
    const float e = logits[v % 16];
    if (!std::isfinite(e)) return full_argmax(x, head);
    if (index < 0 || e > best) best = e, index = static_cast<int32_t>(v);
  }
  return index;
}

// The greedy token of row x [D] (as_head_rows's) from its screened logits y [V] (a_j = y_j, or y_j · scale_j
// with `scales`), within r_j of the head's float32 logit e_j (row_bound; `errors`: through the quads). Every
// column whose interval [a_j - r_j, a_j + r_j] reaches the largest lower end has e_j computed as the head's
// product computes it, and the largest wins (the first on ties). Rows with a NaN or an infinity anywhere
// are computed in full, as jnp.argmax would see them (the first NaN wins).
template <typename H>
int32_t screened_row(const float* y, const float* x, const Head<H>& head, const float* scales, const float* errors,
                     const float* norms, double c1, double c2) {
  const int64_t D = head.D, V = head.V;
  const RowBound bound = row_bound(x, D, errors != nullptr, c1, c2);
  const Screened screened(scales, errors, norms, bound);
  // kLanes columns at a time (16 with AVX-512, faster than 8), four vectors a step.
  constexpr int64_t kStep = 4 * kLanes;
  const int64_t v_vec = V / kStep * kStep;
  const fvec inf = fvec{} + std::numeric_limits<float>::infinity();
  // The largest lower end: four independent maxima (one alone would wait on itself every step).
  fvec lo_max[4] = {-inf, -inf, -inf, -inf};
  ivec bad = {};
  for (int64_t v = 0; v < v_vec; v += kStep) {
    for (int u = 0; u < 4; ++u) {
      fvec a, r;
      screened.at(loadv(y + v + kLanes * u), v + kLanes * u, &a, &r);
      bad |= not_finite(a);
      const fvec lo = a - r;
      lo_max[u] = lo > lo_max[u] ? lo : lo_max[u];
    }
  }
  float threshold = -std::numeric_limits<float>::infinity();
  bool finite = bound.finite && !any(bad);
  for (int i = 0; i < kLanes; ++i) {
    for (int u = 0; u < 4; ++u) threshold = std::max(threshold, lo_max[u][i]);
  }
  for (int64_t v = v_vec; v < V; ++v) {
    float a, r;
    screened.at(y[v], v, &a, &r);
    finite &= std::isfinite(a);
    threshold = std::max(threshold, a - r);
  }
  if (!finite) return full_argmax(x, head);
  const fvec tv = fvec{} + threshold;
  thread_local std::vector<int64_t> candidates;
  candidates.clear();
  for (int64_t v = 0; v < v_vec; v += kStep) {
    ivec hit[4], some = {};
    for (int u = 0; u < 4; ++u) {
      fvec a, r;
      screened.at(loadv(y + v + kLanes * u), v + kLanes * u, &a, &r);
      some |= hit[u] = a + r >= tv;
    }
    if (any(some)) {
      for (int i = 0; i < kStep; ++i) {
        if (hit[i / kLanes][i % kLanes]) candidates.push_back(v + i);
      }
    }
  }
  for (int64_t v = v_vec; v < V; ++v) {
    float a, r;
    screened.at(y[v], v, &a, &r);
    if (a + r >= threshold) candidates.push_back(v);
  }
  return candidates_argmax(x, head, candidates);
}

// y [B, V] the screen's logits, x [B, D], the head's panels [V / 16, D, 16], scales [V] (or [0]: none),
// errors [V] (or [0]: none; given, scales are too), norms [V]; attributes c1 and c2 of the bound, and the
// head product's options amx and bf16_dot.
template <ffi::DataType T, typename H>
ffi::Error ScreenedArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> y, ffi::Buffer<ffi::F32, 2> x,
                          ffi::Buffer<T, 3> panels, ffi::Buffer<ffi::F32, 1> scales, ffi::Buffer<ffi::F32, 1> errors,
                          ffi::Buffer<ffi::F32, 1> norms, double c1, double c2, bool amx, bool bf16_dot,
                          ffi::ResultBuffer<ffi::S32, 1> out) {
  const int64_t B = y.dimensions()[0], V = y.dimensions()[1], D = x.dimensions()[1];
  const auto p = panels.dimensions();
  const int64_t S = scales.dimensions()[0], E = errors.dimensions()[0];
  if (x.dimensions()[0] != B || p[0] * 16 != V || p[1] != D || p[2] != 16 || norms.dimensions()[0] != V ||
      (S != V && S != 0) || (E != V && E != 0) || (E != 0 && S == 0)) {
    return ffi::Error::InvalidArgument("screened argmax: y [B, V], x [B, D], panels [V / 16, D, 16], scales [V] or "
                                       "[0], errors [V] (with scales) or [0], norms [V]");
  }
  const Head<H> head{reinterpret_cast<const H*>(panels.untyped_data()), D, V, B, pool.num_threads(),
                     PanelOptions{amx, bf16_dot}};
  const float* scale = S ? scales.typed_data() : nullptr;
  const float* error = E ? errors.typed_data() : nullptr;
  for_each_row(pool, B, V, [&](int64_t b) {
    thread_local std::vector<float> rounded;
    const float* xb = as_head_rows(x.typed_data() + b * D, D, head.panels, rounded);
    out->typed_data()[b] = screened_row(y.typed_data() + b * V, xb, head, scale, error, norms.typed_data(), c1, c2);
  });
  return ffi::Error::Success();
}

// The greedy heads' operands: y [B, V] (ScreenedArgmax) or x [B, D] (QuadsArgmax), then x [B, D] or the
// quads [V / 16, D, 16] (`Second`), the head's panels (of T), scales, errors and norms; attributes c1, c2
// (the bound) and amx, bf16_dot (the head product's options, PanelOptions).
template <typename Second, ffi::DataType T>
auto HeadBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Arg<Second>()
      .template Arg<ffi::Buffer<T, 3>>()
      .template Arg<ffi::Buffer<ffi::F32, 1>>()
      .template Arg<ffi::Buffer<ffi::F32, 1>>()
      .template Arg<ffi::Buffer<ffi::F32, 1>>()
      .template Attr<double>("c1")
      .template Attr<double>("c2")
      .template Attr<bool>("amx")
      .template Attr<bool>("bf16_dot")
      .template Ret<ffi::Buffer<ffi::S32, 1>>();
}

#if defined(__AVX512F__)
// The greedy head through the int8 screen in quads, in one call: the greedy token of each row of x [B, D]
// from the screen q (int8 panels in quads [V / 16, D, 16], scales [V], errors [V], norms [V]) and the head
// W (panels [V / 16, D, 16], float32 or bfloat16). The screen's product (matmul.cc, quads_units) hands
// over its sums a unit of columns at a time, and they go straight into the two passes screened_row makes
// over a row's logits: the unit's largest lower end raises the row's threshold (shared by the threads),
// then the unit's columns whose upper end reaches the threshold as it now stands are kept. So the
// screened logits [B, V] (megabytes at a batch of 32) are never written to memory and read back, which
// would cost about as much again as the product. The threshold only grows,
// to the one screened_row finds; the columns kept include every column whose upper end reaches that, and
// those are computed as the head's product computes them (candidates_argmax), in ascending order: the same
// token as the product and ScreenedArgmax. x is rounded to the head's dtype first, for all of it.
// A row keeps at most kKeptPerRow columns; one that would keep more (x of zeros: every column ties) is
// computed in full, as are rows with a NaN or an infinity.
constexpr int64_t kKeptPerRow = 4096;

struct Kept {
  int32_t column;
  float upper;  // a + r
};

template <ffi::DataType T, typename H>
ffi::Error QuadsArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> x, ffi::Buffer<ffi::S8, 3> quads,
                       ffi::Buffer<T, 3> panels, ffi::Buffer<ffi::F32, 1> scales, ffi::Buffer<ffi::F32, 1> errors,
                       ffi::Buffer<ffi::F32, 1> norms, double c1, double c2, bool amx, bool bf16_dot,
                       ffi::ResultBuffer<ffi::S32, 1> out) {
  const int64_t B = x.dimensions()[0], D = x.dimensions()[1];
  const auto p = panels.dimensions(), q = quads.dimensions();
  const int64_t V = p[0] * 16;
  if (p[1] != D || p[2] != 16 || !std::equal(p.begin(), p.end(), q.begin()) || scales.dimensions()[0] != V ||
      errors.dimensions()[0] != V || norms.dimensions()[0] != V || D % 4 != 0 || D >= kQuadsMaxK) {
    return ffi::Error::InvalidArgument("quads argmax: x [B, D] (D a multiple of 4 below " + std::to_string(kQuadsMaxK) +
                                       "), quads and panels [V / 16, D, 16], scales, errors and norms [V]");
  }
  if (!quads_ready()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "quads argmax: needs AVX-512 VNNI (absent from this build)");
  }
  if (D == 0 || V == 0) {  // logits all zero, or none: jnp.argmax's 0
    std::fill(out->typed_data(), out->typed_data() + B, 0);
    return ffi::Error::Success();
  }
  const Head<H> head{reinterpret_cast<const H*>(panels.untyped_data()), D, V, B, pool.num_threads(),
                     PanelOptions{amx, bf16_dot}};
  thread_local std::vector<float> rounded;  // the caller's; the tasks reach it through `xs`
  const float* xs = as_head_rows(x.typed_data(), B * D, head.panels, rounded);
  const float *scale = scales.typed_data(), *error = errors.typed_data(), *norm = norms.typed_data();
  struct alignas(64) Row {  // a cache line each: the threads raise thresholds and count columns at once
    RowBound bound;
    std::atomic<float> threshold{-std::numeric_limits<float>::infinity()};
    std::atomic<int64_t> kept{0};
    std::atomic<bool> bad{false};  // a screened logit not finite
  };
  const std::unique_ptr<Row[]> rows(new Row[B]);
  for (int64_t b = 0; b < B; ++b) rows[b].bound = row_bound(xs + b * D, D, true, c1, c2);
  const int64_t capacity = std::min(V, kKeptPerRow);
  thread_local std::vector<Kept> kept_buffer;  // the caller's; the units reach it through `kept`
  kept_buffer.resize(static_cast<size_t>(B * capacity));
  Kept* const kept = kept_buffer.data();
  const fvec inf = fvec{} + std::numeric_limits<float>::infinity();
  quads_units(pool, xs, reinterpret_cast<const int8_t*>(quads.untyped_data()), V, B, D,
              [&](int64_t c0, int64_t width, const int32_t* sums, const int32_t* shift, const float* t) {
                thread_local std::vector<float> upper_buffer;  // the unit's a + r, one row at a time
                upper_buffer.resize(static_cast<size_t>(width));
                float* const upper = upper_buffer.data();
                for (int64_t b = 0; b < B; ++b) {
                  Row& row = rows[b];
                  if (!row.bound.finite) continue;
                  const Screened screened(scale, error, norm, row.bound);
                  const int32_t* s = sums + b * width;
                  fvec lo_max = -inf;
                  ivec bad = {};
                  for (int64_t c = 0; c < width; c += kLanes) {
                    fvec a, r;
                    screened.at(quads_floats(s + c, shift[b], t[b]), c0 + c, &a, &r);
                    bad |= not_finite(a);
                    const fvec lo = a - r;
                    lo_max = lo > lo_max ? lo : lo_max;
                    storev(upper + c, a + r);
                  }
                  if (any(bad)) {
                    row.bad.store(true, std::memory_order_relaxed);
                    continue;
                  }
                  // The row's threshold, raised where this unit's largest lower end passes it (rarely, once
                  // a few units are done: the line then stays in both cores' caches).
                  float threshold = row.threshold.load(std::memory_order_relaxed);
                  if (any(lo_max > fvec{} + threshold)) {
                    const float top = _mm512_reduce_max_ps(reinterpret_cast<__m512>(lo_max));
                    while (top > threshold && !row.threshold.compare_exchange_weak(threshold, top)) {
                    }
                    threshold = std::max(top, threshold);
                  }
                  const fvec tv = fvec{} + threshold;
                  for (int64_t c = 0; c < width; c += kLanes) {
                    for (uint32_t hits = lanes(loadv(upper + c) >= tv); hits != 0; hits &= hits - 1) {
                      const int i = __builtin_ctz(hits);
                      const int64_t at = row.kept.fetch_add(1, std::memory_order_relaxed);
                      if (at < capacity) kept[b * capacity + at] = Kept{static_cast<int32_t>(c0 + c + i), upper[c + i]};
                    }
                  }
                }
              });
  for_each_row(pool, B, V, [&](int64_t b) {
    const Row& row = rows[b];
    const float* xb = xs + b * D;
    const int64_t n = row.kept.load();
    if (!row.bound.finite || row.bad.load() || n > capacity) {
      out->typed_data()[b] = full_argmax(xb, head);
      return;
    }
    const float threshold = row.threshold.load();
    thread_local std::vector<int64_t> candidates;
    candidates.clear();
    for (int64_t i = 0; i < n; ++i) {
      const Kept& k = kept[b * capacity + i];
      if (k.upper >= threshold) candidates.push_back(k.column);
    }
    std::sort(candidates.begin(), candidates.end());
    out->typed_data()[b] = candidates_argmax(xb, head, candidates);
  });
  return ffi::Error::Success();
}
#else
template <ffi::DataType T, typename H>
ffi::Error QuadsArgmax(ffi::ThreadPool, ffi::Buffer<ffi::F32, 2>, ffi::Buffer<ffi::S8, 3>, ffi::Buffer<T, 3>,
                       ffi::Buffer<ffi::F32, 1>, ffi::Buffer<ffi::F32, 1>, ffi::Buffer<ffi::F32, 1>, double, double,
                       bool, bool, ffi::ResultBuffer<ffi::S32, 1>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "quads argmax: needs AVX-512 VNNI");
}
#endif


}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArgmaxF32, Argmax, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxF32, (ScreenedArgmax<ffi::F32, float>), (HeadBinding<ffi::Buffer<ffi::F32, 2>, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxBF16, (ScreenedArgmax<ffi::BF16, uint16_t>), (HeadBinding<ffi::Buffer<ffi::F32, 2>, ffi::BF16>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuadsArgmaxF32, (QuadsArgmax<ffi::F32, float>), (HeadBinding<ffi::Buffer<ffi::S8, 3>, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuadsArgmaxBF16, (QuadsArgmax<ffi::BF16, uint16_t>), (HeadBinding<ffi::Buffer<ffi::S8, 3>, ffi::BF16>()));
