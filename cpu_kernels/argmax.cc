// Greedy decoding's argmax over the vocabulary, as XLA FFI custom calls.
//
// ArgmaxF32: i[b] = the first index of the largest value of x[b, :] (of the first NaN where a row has
// one), as jnp.argmax.
//
// ScreenedArgmax{F32,BF16}: the greedy token of logits x[b] · W (W float32 or bfloat16) that were not
// computed, from logits that were, through a narrower copy of W (its screen: bfloat16 for a float32 W,
// int8 with a scale per column for either: fewer bytes to read; at many rows the int8 one in quads, x
// quantized too: half the arithmetic of bfloat16's), and W itself for the few columns that can still
// win; see llm_jax/model/greedy_head.py for the bound that makes it exact.
//
// XLA:CPU computes an argmax as a reduction of (value, index) pairs, one element at a time: 1.3 ms for
// [32, 32000] float32 logits, 8 % of a 15M decode step at batch 32. Here each row is read once, 32 lanes
// at a time; rows are shared among the threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
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

// Column j of W [D, V] held as panels [V / 16, D, 16] (float32, or bfloat16 bits), dotted with x [D] in
// double precision.
template <typename H>
double column_dot(const float* x, const H* panels, int64_t D, int64_t j) {
  const H* w = panels + (j / 16) * D * 16 + j % 16;
  double sum = 0.0;
  for (int64_t d = 0; d < D; ++d) sum += static_cast<double>(x[d]) * static_cast<double>(load1(w + d * 16));
  return sum;
}

// The greedy token of row x [D] from its screened logits: a_j = y_j (or y_j · scale_j, `scales` given),
// within r_j of the exact logit x · W[:, j]: r_j = c1 · ‖x‖₁ · scale_j + c2 · ‖x‖₂ · norm_j, or, with
// `errors` (the int8 screen in quads, whose product quantized x too: δ = x - t n, quantize_row's n and
// t), r_j = c1 · (‖x‖₂ + ‖δ‖₂) · error_j + (c1 · ‖δ‖₂ + c2 · ‖x‖₂) · norm_j. Every column whose interval
// [a_j - r_j, a_j + r_j] reaches the largest lower end is computed exactly, and the largest exact logit
// wins (the first on ties). Rows with a NaN or an infinity anywhere are computed in full, as jnp.argmax
// would see them (the first NaN wins).
template <typename H>
int32_t screened_row(const float* y, const float* x, const H* panels, const float* scales, const float* errors,
                     const float* norms, int64_t D, int64_t V, double c1, double c2) {
  double l1 = 0.0, l2 = 0.0, d2 = 0.0;
  for (int64_t d = 0; d < D; ++d) {
    l1 += std::fabs(static_cast<double>(x[d]));
    l2 += static_cast<double>(x[d]) * static_cast<double>(x[d]);
  }
  if (errors) {  // what quantizing x changed, exactly (t n is exact in double, and so is x - t n)
    thread_local std::vector<int8_t> n;
    n.resize(static_cast<size_t>(D));
    const double t = quantize_row(x, D, n.data());
    for (int64_t d = 0; d < D; ++d) {
      const double delta = static_cast<double>(x[d]) - t * n[d];
      d2 += delta * delta;
    }
  }
  const double x2 = std::sqrt(l2), delta2 = std::sqrt(d2);
  // Rounded up, and far beyond float's rounding of a_j ± r_j below (r_j is at least 0.4 % of |a_j|).
  const float s1 = static_cast<float>((errors ? c1 * (x2 + delta2) : c1 * l1) * (1.0 + 1e-3));
  const float s2 = static_cast<float>((errors ? c1 * delta2 + c2 * x2 : c2 * x2) * (1.0 + 1e-3));
  const float* first = errors ? errors : scales;  // the columns r_j's first term is proportional to
  bool finite = std::isfinite(s1) && std::isfinite(s2);
  // kLanes columns at a time, four vectors a step (16 with AVX-512: 0.73–0.81 of the time of 8 at 32 rows
  // of 32,000 columns, Zen 5, processes taking turns).
  typedef int32_t ivec __attribute__((vector_size(sizeof(fvec))));
  constexpr int64_t kStep = 4 * kLanes;
  const int64_t v_vec = V / kStep * kStep;
  const fvec s1v = fvec{} + s1, s2v = fvec{} + s2, infv = fvec{} + std::numeric_limits<float>::infinity();
  // a_j and r_j of the kLanes columns from v.
  auto bounds = [&](int64_t v, fvec* a, fvec* r) {
    const fvec yv = loadv(y + v), nv = loadv(norms + v);
    *a = scales ? yv * loadv(scales + v) : yv;
    *r = first ? s1v * loadv(first + v) + s2v * nv : s2v * nv;
  };
  auto any = [](ivec m) {
    for (int i = 0; i < kLanes; ++i) {
      if (m[i]) return true;
    }
    return false;
  };
  // The largest lower end: four independent maxima (one alone would wait on itself every step).
  fvec lo_max[4] = {-infv, -infv, -infv, -infv};
  ivec bad = {};
  for (int64_t v = 0; v < v_vec; v += kStep) {
    for (int u = 0; u < 4; ++u) {
      fvec a, r;
      bounds(v + kLanes * u, &a, &r);
      bad |= (a != a) | (a == infv) | (a == -infv);  // NaN or ±inf
      const fvec lo = a - r;
      lo_max[u] = lo > lo_max[u] ? lo : lo_max[u];
    }
  }
  float threshold = -std::numeric_limits<float>::infinity();
  finite &= !any(bad);
  for (int i = 0; i < kLanes; ++i) {
    for (int u = 0; u < 4; ++u) threshold = std::max(threshold, lo_max[u][i]);
  }
  auto scalar = [&](int64_t v, float* a, float* r) {
    *a = scales ? y[v] * scales[v] : y[v];
    *r = (first ? s1 * first[v] : 0.f) + s2 * norms[v];
  };
  for (int64_t v = v_vec; v < V; ++v) {
    float a, r;
    scalar(v, &a, &r);
    finite &= std::isfinite(a);
    threshold = std::max(threshold, a - r);
  }
  double best = -std::numeric_limits<double>::infinity();
  int32_t index = 0;
  if (!finite) {  // in full: the exact logits, jnp.argmax's rules
    for (int64_t v = 0; v < V; ++v) {
      const double e = column_dot(x, panels, D, v);
      if (std::isnan(e)) return static_cast<int32_t>(v);
      if (e > best || v == 0) best = e, index = static_cast<int32_t>(v);
    }
    return index;
  }
  // The candidates first, then their columns: every line of every candidate asked for before the first
  // is read (a column is D lines apart, from memory; read one after another they wait on each).
  const fvec tv = fvec{} + threshold;
  thread_local std::vector<int64_t> candidates;
  candidates.clear();
  for (int64_t v = 0; v < v_vec; v += kStep) {
    ivec hit[4], some = {};
    for (int u = 0; u < 4; ++u) {
      fvec a, r;
      bounds(v + kLanes * u, &a, &r);
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
    scalar(v, &a, &r);
    if (a + r >= threshold) candidates.push_back(v);
  }
  const int64_t rows_per_line = std::max<int64_t>(1, 64 / (16 * static_cast<int64_t>(sizeof(H))));
  for (const int64_t v : candidates) {
    const H* w = panels + (v / 16) * D * 16 + v % 16;
    for (int64_t d = 0; d < D; d += rows_per_line) __builtin_prefetch(w + d * 16);
  }
  for (const int64_t v : candidates) {  // ascending: the first of equal logits stays
    const double e = column_dot(x, panels, D, v);
    if (e > best) best = e, index = static_cast<int32_t>(v);
  }
  return index;
}

// y [B, V] the screen's logits, x [B, D], the head's panels [V / 16, D, 16], scales [V] (or [0]: none),
// errors [V] (or [0]: none; given, scales are too), norms [V]; attributes c1 and c2 of the bound.
template <ffi::DataType T, typename H>
ffi::Error ScreenedArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> y, ffi::Buffer<ffi::F32, 2> x,
                          ffi::Buffer<T, 3> panels, ffi::Buffer<ffi::F32, 1> scales, ffi::Buffer<ffi::F32, 1> errors,
                          ffi::Buffer<ffi::F32, 1> norms, double c1, double c2, ffi::ResultBuffer<ffi::S32, 1> out) {
  const int64_t B = y.dimensions()[0], V = y.dimensions()[1], D = x.dimensions()[1];
  const auto p = panels.dimensions();
  const int64_t S = scales.dimensions()[0], E = errors.dimensions()[0];
  if (x.dimensions()[0] != B || p[0] * 16 != V || p[1] != D || p[2] != 16 || norms.dimensions()[0] != V ||
      (S != V && S != 0) || (E != V && E != 0) || (E != 0 && S == 0)) {
    return ffi::Error::InvalidArgument("screened argmax: y [B, V], x [B, D], panels [V / 16, D, 16], scales [V] or "
                                       "[0], errors [V] (with scales) or [0], norms [V]");
  }
  const H* head = reinterpret_cast<const H*>(panels.untyped_data());
  const float* scale = S ? scales.typed_data() : nullptr;
  const float* error = E ? errors.typed_data() : nullptr;
  for_each_row(pool, B, V, [&](int64_t b) {
    out->typed_data()[b] = screened_row(y.typed_data() + b * V, x.typed_data() + b * D, head, scale, error,
                                        norms.typed_data(), D, V, c1, c2);
  });
  return ffi::Error::Success();
}

template <ffi::DataType T>
auto ScreenedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Arg<ffi::Buffer<T, 3>>()
      .template Arg<ffi::Buffer<ffi::F32, 1>>()
      .template Arg<ffi::Buffer<ffi::F32, 1>>()
      .template Arg<ffi::Buffer<ffi::F32, 1>>()
      .template Attr<double>("c1")
      .template Attr<double>("c2")
      .template Ret<ffi::Buffer<ffi::S32, 1>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArgmaxF32, Argmax, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxF32, (ScreenedArgmax<ffi::F32, float>), ScreenedBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxBF16, (ScreenedArgmax<ffi::BF16, uint16_t>), ScreenedBinding<ffi::BF16>());
