// Greedy decoding's argmax over the vocabulary, as an XLA FFI custom call: i[b] = the first index of the
// largest value of x[b, :] (of the first NaN where a row has one), as jnp.argmax.
//
// XLA:CPU computes an argmax as a reduction of (value, index) pairs, one element at a time: 1.3 ms for
// [32, 32000] float32 logits, 8 % of a 15M decode step at batch 32. Here each row is read once, 8 lanes
// at a time; rows are shared among the threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

// The index jnp.argmax gives for one row of V values, in one pass: each of 8 lanes keeps its largest
// value and where it first saw it (a strict > keeps the first), then the lanes' maxima are merged,
// the smallest index winning ties. A row with a NaN is scanned again for its first NaN.
int32_t row_argmax(const float* x, int64_t V) {
  const int64_t v_vec = V / 8 * 8;
  f32x8 best = splat(-std::numeric_limits<float>::infinity());
  i32x8 at = splat_i32(0), lane = {0, 1, 2, 3, 4, 5, 6, 7}, nans = splat_i32(0);
  for (int64_t v = 0; v < v_vec; v += 8, lane += 8) {
    const f32x8 a = load8(x + v);
    nans |= a != a;  // NaN is unequal to itself
    const i32x8 higher = a > best;
    best = higher ? a : best;
    at = higher ? lane : at;
  }
  bool nan = false;
  float m = -std::numeric_limits<float>::infinity();
  int32_t index = 0;
  for (int i = 0; i < 8; ++i) {
    nan |= nans[i] != 0;
    if (best[i] > m || (best[i] == m && at[i] < index)) m = best[i], index = at[i];
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArgmaxF32, Argmax, Binding());
