// Greedy decoding's argmax over the vocabulary, as XLA FFI custom calls.
//
// ArgmaxF32: i[b] = the first index of the largest value of x[b, :] (of the first NaN where a row has
// one), as jnp.argmax.
//
// ScreenedArgmaxF32: the greedy token of float32 logits x[b] · W that were not computed, from logits
// a[b] = bf16(x[b]) · bf16(W) that were (W's bfloat16 copy, half the bytes to read and, on CPUs with
// bfloat16 dot products, half the arithmetic), and W itself for the few columns that can still win;
// see llm_jax/model/greedy_head.py for the bound that makes it exact.
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

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> x, ffi::ResultBuffer<ffi::S32, 1> out) {
  const int64_t B = x.dimensions()[0], V = x.dimensions()[1];
  const float* data = x.typed_data();
  int32_t* index = out->typed_data();
  // Rows of at least 16 K values are worth a thread each; shorter ones go together.
  const int64_t rows_per_unit = std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1));
  parallel_for(pool, (B + rows_per_unit - 1) / rows_per_unit, [&](int64_t unit) {
    for (int64_t b = unit * rows_per_unit; b < std::min(B, (unit + 1) * rows_per_unit); ++b) {
      index[b] = row_argmax(data + b * V, V);
    }
  });
  return ffi::Error::Success();
}

auto Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32, 2>>().Ret<ffi::Buffer<ffi::S32, 1>>();
}

// Column j of W [D, V] held as panels [V / 16, D, 16], dotted with x [D] in double precision.
double column_dot(const float* x, const float* panels, int64_t D, int64_t j) {
  const float* w = panels + (j / 16) * D * 16 + j % 16;
  double sum = 0.0;
  for (int64_t d = 0; d < D; ++d) sum += static_cast<double>(x[d]) * static_cast<double>(w[d * 16]);
  return sum;
}

// The greedy token of row x [D] from its screened logits a [V]: every column whose interval
// [a_j - r_j, a_j + r_j], r_j = scale · norm_j, reaches the largest lower end is computed exactly, and
// the largest exact logit wins (the first on ties). Rows with a NaN or an infinity anywhere are computed
// in full, as jnp.argmax would see them (the first NaN wins).
int32_t screened_row(const float* a, const float* x, const float* panels, const float* norms, int64_t D, int64_t V,
                     double c) {
  double sq = 0.0;
  for (int64_t d = 0; d < D; ++d) sq += static_cast<double>(x[d]) * static_cast<double>(x[d]);
  // Rounded up, and far beyond float's rounding of a_j ± r_j below (r_j ≥ 0.0078 |a_j|, see the bound).
  const float scale = static_cast<float>(c * std::sqrt(sq) * (1.0 + 1e-3));
  bool finite = std::isfinite(scale);
  // The largest lower end: four independent maxima (one alone would wait on itself every step).
  const int64_t v_vec = V / 32 * 32;
  const f32x8 s8 = splat(scale), inf8 = splat(std::numeric_limits<float>::infinity());
  f32x8 lo_max[4] = {-inf8, -inf8, -inf8, -inf8};
  i32x8 bad = splat_i32(0);
  for (int64_t v = 0; v < v_vec; v += 32) {
    for (int u = 0; u < 4; ++u) {
      const f32x8 av = load8(a + v + 8 * u), lo = av - s8 * load8(norms + v + 8 * u);
      bad |= (av != av) | (av == inf8) | (av == -inf8);  // NaN or ±inf
      lo_max[u] = lo > lo_max[u] ? lo : lo_max[u];
    }
  }
  float threshold = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < 8; ++i) {
    finite &= bad[i] == 0;
    for (int u = 0; u < 4; ++u) threshold = std::max(threshold, lo_max[u][i]);
  }
  for (int64_t v = v_vec; v < V; ++v) {
    finite &= std::isfinite(a[v]);
    threshold = std::max(threshold, a[v] - scale * norms[v]);
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
  // is read (a column is D lines 64 bytes apart, from memory; read one after another they wait on each).
  const f32x8 t8 = splat(threshold);
  std::vector<int64_t> candidates;
  for (int64_t v = 0; v < v_vec; v += 32) {
    i32x8 hit[4], any = splat_i32(0);
    for (int u = 0; u < 4; ++u) any |= hit[u] = load8(a + v + 8 * u) + s8 * load8(norms + v + 8 * u) >= t8;
    if (any[0] | any[1] | any[2] | any[3] | any[4] | any[5] | any[6] | any[7]) {
      for (int i = 0; i < 32; ++i) {
        if (hit[i / 8][i % 8]) candidates.push_back(v + i);
      }
    }
  }
  for (int64_t v = v_vec; v < V; ++v) {
    if (a[v] + scale * norms[v] >= threshold) candidates.push_back(v);
  }
  for (const int64_t v : candidates) {
    const float* w = panels + (v / 16) * D * 16 + v % 16;
    for (int64_t d = 0; d < D; ++d) __builtin_prefetch(w + d * 16);
  }
  for (const int64_t v : candidates) {  // ascending: the first of equal logits stays
    const double e = column_dot(x, panels, D, v);
    if (e > best) best = e, index = static_cast<int32_t>(v);
  }
  return index;
}

ffi::Error ScreenedArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> a, ffi::Buffer<ffi::F32, 2> x,
                          ffi::Buffer<ffi::F32, 3> panels, ffi::Buffer<ffi::F32, 1> norms, double c,
                          ffi::ResultBuffer<ffi::S32, 1> out) {
  const int64_t B = a.dimensions()[0], V = a.dimensions()[1], D = x.dimensions()[1];
  const auto p = panels.dimensions();
  if (x.dimensions()[0] != B || p[0] * 16 != V || p[1] != D || p[2] != 16 || norms.dimensions()[0] != V) {
    return ffi::Error::InvalidArgument("screened argmax: a [B, V], x [B, D], panels [V / 16, D, 16], norms [V]");
  }
  const int64_t rows_per_unit = std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1));
  parallel_for(pool, (B + rows_per_unit - 1) / rows_per_unit, [&](int64_t unit) {
    for (int64_t b = unit * rows_per_unit; b < std::min(B, (unit + 1) * rows_per_unit); ++b) {
      out->typed_data()[b] = screened_row(a.typed_data() + b * V, x.typed_data() + b * D, panels.typed_data(),
                                          norms.typed_data(), D, V, c);
    }
  });
  return ffi::Error::Success();
}

auto ScreenedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .Arg<ffi::Buffer<ffi::F32, 3>>()
      .Arg<ffi::Buffer<ffi::F32, 1>>()
      .Attr<double>("c")
      .Ret<ffi::Buffer<ffi::S32, 1>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArgmaxF32, Argmax, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxF32, ScreenedArgmax, ScreenedBinding());
