// Products with quantized weights (llm_jax/quantization.py) on CPU, as an XLA FFI custom call:
// y [R, N] = x [R, K] · W, W[k, n] = s[k / G, n] · q[k, n], read from the integers as they lie.
//
// Weights are in the panel layout of the float kernels (cpu_kernels.to_panels), stacked over layers:
//   q  int8 [L, N / 16, K, 16]           (8 bits: q itself)
//      uint8 [L, N / 16, K / 2, 16]      (4 bits: byte j of a column holds inputs 2j (low nibble) and
//                                         2j + 1 (high nibble), each q + 8)
//   s  float32 [L, N / 16, ceil(K / G), 16]  one scale per group of G inputs and column.
// Each panel's 16 columns are converted to float32 in registers (no dequantized copy in memory) and
// summed group by group: y = Σ_groups s_g · (Σ_{k in g} x_k q_k), the order the XLA path's
// dequantize-then-multiply reaches within float32 rounding. Decode reads the bytes once per step: a
// quarter (int8) or an eighth (int4) of float32's.
//
// Each panel row is two 8-wide float vectors; AVX2 widens the bytes (and splits the nibbles) with its
// own instructions, other targets with a plain loop (the portable path). 4-bit nibbles are summed as
// they are stored (q + 8) and the offset taken off once per group, 8 · Σ x over the group.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

constexpr int64_t kWidth = 16;           // columns per panel
constexpr int64_t kRowBlock = 4;         // rows of x sharing each converted weight vector
constexpr int64_t kUnitBytes = 1 << 16;  // weight bytes per unit of work (a few panels)

// A panel's 16 columns as two 8-wide float vectors.
struct Row16 {
  f32x8 a, b;
};

inline Row16 row_i8(const int8_t* p) { return {load8(p), load8(p + 8)}; }

// One byte row of a 4-bit panel: the nibbles u (q + 8) of inputs 2j (low) and 2j + 1 (high), as floats.
// The offset of 8 is taken off once per group (group_sums): Σ x (u - 8) = Σ x u - 8 Σ x.
inline void rows_u4(const uint8_t* p, Row16* lo, Row16* hi) {
#if defined(__AVX2__)
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i mask = _mm256_set1_epi32(15);
  auto as_floats = [](__m256i v) {
    const __m256 f = _mm256_cvtepi32_ps(v);
    f32x8 out;
    std::memcpy(&out, &f, sizeof out);
    return out;
  };
  *lo = {as_floats(_mm256_and_si256(a, mask)), as_floats(_mm256_and_si256(b, mask))};
  *hi = {as_floats(_mm256_srli_epi32(a, 4)), as_floats(_mm256_srli_epi32(b, 4))};
#else
  for (int i = 0; i < 8; ++i) {
    lo->a[i] = static_cast<float>(p[i] & 15), lo->b[i] = static_cast<float>(p[8 + i] & 15);
    hi->a[i] = static_cast<float>(p[i] >> 4), hi->b[i] = static_cast<float>(p[8 + i] >> 4);
  }
#endif
}

inline void fma_row(Row16& acc, float x, const Row16& w) {
  acc.a += splat(x) * w.a;
  acc.b += splat(x) * w.b;
}

// Σ_{k in [k0, k1)} x_r[k] · q[k, 0:16] for the RB rows x_r = x + r · K, into part[r]: one group. Even and
// odd inputs go to separate sums (added at the end), so that consecutive multiply-adds do not wait on
// each other.
template <int kBits, int RB>
inline void group_sums(const float* x, int64_t K, const void* panel, int64_t k0, int64_t k1, Row16* part) {
  Row16 odd[RB];
  for (int r = 0; r < RB; ++r) part[r] = odd[r] = Row16{};
  int64_t k = k0;
  if constexpr (kBits == 8) {
    const int8_t* q = static_cast<const int8_t*>(panel);
    for (; k + 1 < k1; k += 2) {
      const Row16 w0 = row_i8(q + k * kWidth), w1 = row_i8(q + (k + 1) * kWidth);
      for (int r = 0; r < RB; ++r) {
        fma_row(part[r], x[r * K + k], w0);
        fma_row(odd[r], x[r * K + k + 1], w1);
      }
    }
    if (k < k1) {
      const Row16 w0 = row_i8(q + k * kWidth);
      for (int r = 0; r < RB; ++r) fma_row(part[r], x[r * K + k], w0);
    }
  } else {  // k0 even: pairs of inputs from one byte; an odd k1 ends on a low nibble
    const uint8_t* q = static_cast<const uint8_t*>(panel);
    Row16 lo, hi;
    float x_sum[RB] = {};
    for (; k + 1 < k1; k += 2) {
      rows_u4(q + (k / 2) * kWidth, &lo, &hi);
      for (int r = 0; r < RB; ++r) {
        fma_row(part[r], x[r * K + k], lo);
        fma_row(odd[r], x[r * K + k + 1], hi);
        x_sum[r] += x[r * K + k] + x[r * K + k + 1];
      }
    }
    if (k < k1) {
      rows_u4(q + (k / 2) * kWidth, &lo, &hi);
      for (int r = 0; r < RB; ++r) {
        fma_row(part[r], x[r * K + k], lo);
        x_sum[r] += x[r * K + k];
      }
    }
    for (int r = 0; r < RB; ++r) {  // the offset: Σ x (u - 8) = Σ x u - 8 Σ x
      part[r].a -= splat(8.f * x_sum[r]);
      part[r].b -= splat(8.f * x_sum[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    part[r].a += odd[r].a;
    part[r].b += odd[r].b;
  }
}

// y[r, 0:16] for RB rows of one panel: group by group, each group's sums scaled and added.
template <int kBits, int RB>
inline void panel_rows(const float* x, int64_t K, const void* panel, const float* scales, int64_t G, float* y,
                       int64_t N) {
  Row16 acc[RB], part[RB];
  for (int r = 0; r < RB; ++r) acc[r] = Row16{};
  for (int64_t g = 0; g * G < K; ++g) {
    group_sums<kBits, RB>(x, K, panel, g * G, std::min(K, (g + 1) * G), part);
    const f32x8 s0 = load8(scales + g * kWidth), s1 = load8(scales + g * kWidth + 8);
    for (int r = 0; r < RB; ++r) {
      acc[r].a += part[r].a * s0;
      acc[r].b += part[r].b * s1;
    }
  }
  for (int r = 0; r < RB; ++r) {
    store8(y + r * N, acc[r].a);
    store8(y + r * N + 8, acc[r].b);
  }
}

template <int kBits>
void panel_all_rows(const float* x, int64_t R, int64_t K, const void* panel, const float* scales, int64_t G, float* y,
                    int64_t N) {
  int64_t r = 0;
  for (; r + kRowBlock <= R; r += kRowBlock) panel_rows<kBits, kRowBlock>(x + r * K, K, panel, scales, G, y + r * N, N);
  for (; r < R; ++r) panel_rows<kBits, 1>(x + r * K, K, panel, scales, G, y + r * N, N);
}

template <ffi::DataType T, int kBits>
ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 2> x,
                       ffi::Buffer<T, 4> q, ffi::Buffer<ffi::F32, 4> s, ffi::ResultBuffer<ffi::F32, 2> y,
                       int64_t group_size) {
  const int64_t R = x.dimensions()[0], K = x.dimensions()[1];
  const auto qd = q.dimensions(), sd = s.dimensions();
  const int64_t L = qd[0], P = qd[1], N = P * kWidth, G = group_size;
  const int64_t k_rows = kBits == 8 ? K : (K + 1) / 2, groups = G > 0 ? (K + G - 1) / G : 0;
  const int64_t layer = *layer_index.typed_data();
  if (G <= 0 || (kBits == 4 && G % 2) || qd[2] != k_rows || qd[3] != kWidth || sd[0] != L || sd[1] != P ||
      sd[2] != groups || sd[3] != kWidth || y->dimensions()[0] != R || y->dimensions()[1] != N) {
    return ffi::Error::InvalidArgument(
        "cpu_kernels quant_matmul: x [R, K] = [" + std::to_string(R) + ", " + std::to_string(K) +
        "], q [L, N / 16, " + (kBits == 8 ? "K" : "K / 2") + ", 16], s [L, N / 16, ceil(K / G), 16] and y [R, N] "
        "(an even G for 4 bits) do not fit: G = " + std::to_string(G));
  }
  if (layer < 0 || layer >= L) {
    return ffi::Error::InvalidArgument("cpu_kernels quant_matmul: layer " + std::to_string(layer) +
                                       " outside the stack of " + std::to_string(L));
  }
  const auto* q_data = q.typed_data() + layer * P * k_rows * kWidth;
  const float* s_data = s.typed_data() + layer * P * groups * kWidth;
  const float* xs = x.typed_data();
  float* out = y->typed_data();
  const int64_t panel_bytes = k_rows * kWidth;
  const int64_t per_unit = std::max<int64_t>(1, kUnitBytes / std::max<int64_t>(panel_bytes, 1));
  const int64_t units = (P + per_unit - 1) / per_unit;
  auto unit = [&](int64_t u) {
    for (int64_t p = u * per_unit; p < std::min(P, (u + 1) * per_unit); ++p) {
      panel_all_rows<kBits>(xs, R, K, q_data + p * panel_bytes, s_data + p * groups * kWidth, G, out + p * kWidth, N);
    }
  };
  if (units > 1) {
    parallel_for(pool, units, unit);
  } else if (units == 1) {
    unit(0);
  }
  return ffi::Error::Success();
}

// x, then q (int8 or packed uint8) and s; the group size as an attribute.
#define QUANT_BINDING(T)                  \
  ffi::Ffi::Bind()                        \
      .Ctx<ffi::ThreadPool>()             \
      .Arg<ffi::Buffer<ffi::S32, 0>>()    \
      .Arg<ffi::Buffer<ffi::F32, 2>>()    \
      .Arg<ffi::Buffer<T, 4>>()           \
      .Arg<ffi::Buffer<ffi::F32, 4>>()    \
      .Ret<ffi::Buffer<ffi::F32, 2>>()    \
      .Attr<int64_t>("group_size")

auto BindingI8() { return QUANT_BINDING(ffi::S8); }
auto BindingI4() { return QUANT_BINDING(ffi::U8); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulI8, (QuantMatmul<ffi::S8, 8>), BindingI8());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulI4, (QuantMatmul<ffi::U8, 4>), BindingI4());
