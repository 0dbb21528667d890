// Products with quantized weights (llm_jax/quantization.py) on CPU, as an XLA FFI custom call:
// y [R, N] = x [R, K] · W, W[k, n] = s[k / G, n] · q[k, n], read from the integers as they lie.
//
// Weights are in the panel layout of the float kernels (cpu_kernels.to_panels), stacked over layers:
//   q  int8 [L, N / 16, K, 16]           (8 bits: q itself)
//      uint8 [L, N / 16, K / 2, 16]      (4 bits: byte j of a column holds inputs 2j (low nibble) and
//                                         2j + 1 (high nibble), each q + 8)
//   s  float32 [L, N / 16, ceil(K / G), 16]  one scale per group of G inputs and column.
//   o  float32 [L, N / 16, ceil(K / G), 16]  (the _offsets handlers) an offset per group and column:
//      W[k, n] = s[k / G, n] · q[k, n] + o[k / G, n], summed as s_g · (Σ x_k q_k) + o_g · (Σ x_k).
// Each panel's 16 columns are converted to float32 in registers (no dequantized copy in memory) and
// summed group by group: y = Σ_groups s_g · (Σ_{k in g} x_k q_k), the order the XLA path's
// dequantize-then-multiply reaches within float32 rounding. Decode reads the bytes once per step: a
// quarter (int8) or an eighth (int4) of float32's.
//
// Each panel row is two 8-wide float vectors; AVX2 widens the bytes (and splits the nibbles) with its
// own instructions, other targets with a plain loop (the portable path).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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

// Integers to floats without a conversion instruction (Zen 2 converts on one pipe; these run on the
// integer and add pipes): the bits 0x4B000000 | v are the float 2^23 + v for v < 2^23, and subtracting
// 2^23 + offset leaves v - offset exactly.
constexpr uint32_t kMagic = 0x4B000000;

#if defined(__AVX2__)
inline f32x8 magic_float(__m256i bits, __m256 bias) {
  const __m256 f = _mm256_sub_ps(_mm256_castsi256_ps(bits), bias);
  f32x8 out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}

// 16 bytes zero-extended to two vectors of 8 32-bit lanes (bytes 0-7, 8-15): one load into both halves,
// then a byte shuffle per vector.
inline void widen16(const uint8_t* p, __m256i* a, __m256i* b) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                      4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i hi = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                      12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
  *a = _mm256_shuffle_epi8(v, lo);
  *b = _mm256_shuffle_epi8(v, hi);
}
#endif

// One row of an 8-bit panel: q[k, 0:16]. The byte b of q (two's complement) gives q + 128 = b ^ 0x80.
inline Row16 row_q8(const int8_t* p) {
#if defined(__AVX2__)
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  const __m256i flip = _mm256_set1_epi32(kMagic | 0x80);
  const __m256 bias = _mm256_set1_ps(8388608.f + 128.f);
  __m256i a, b;
  widen16(u, &a, &b);
  return {magic_float(_mm256_xor_si256(a, flip), bias), magic_float(_mm256_xor_si256(b, flip), bias)};
#else
  Row16 w;
  for (int i = 0; i < 8; ++i) w.a[i] = static_cast<float>(p[i]), w.b[i] = static_cast<float>(p[8 + i]);
  return w;
#endif
}

// One byte row of a 4-bit panel: q of inputs 2j (low nibbles, u - 8) and 2j + 1 (high nibbles).
inline void rows_q4(const uint8_t* p, Row16* lo, Row16* hi) {
#if defined(__AVX2__)
  __m256i a, b;
  widen16(p, &a, &b);
  const __m256i mask = _mm256_set1_epi32(15), magic = _mm256_set1_epi32(kMagic);
  const __m256 bias = _mm256_set1_ps(8388608.f + 8.f);
  auto low = [&](__m256i v) { return magic_float(_mm256_or_si256(_mm256_and_si256(v, mask), magic), bias); };
  auto high = [&](__m256i v) { return magic_float(_mm256_or_si256(_mm256_srli_epi32(v, 4), magic), bias); };
  *lo = {low(a), low(b)};
  *hi = {high(a), high(b)};
#else
  for (int i = 0; i < 8; ++i) {
    lo->a[i] = static_cast<float>((p[i] & 15) - 8), lo->b[i] = static_cast<float>((p[8 + i] & 15) - 8);
    hi->a[i] = static_cast<float>((p[i] >> 4) - 8), hi->b[i] = static_cast<float>((p[8 + i] >> 4) - 8);
  }
#endif
}

inline void fma_row(Row16& acc, float x, const Row16& w) {
  acc.a += splat(x) * w.a;
  acc.b += splat(x) * w.b;
}

// Independent sums per row of x, so that several multiply-add chains run at once: 2 for two rows, 1 for
// more (one row: panels_one_row).
template <int RB>
constexpr int kSplits = RB <= 2 ? 2 : 1;

// Σ_{k in [k0, k1)} x_r[k] · q[k, 0:16] for the RB rows x_r = x + r · K, into part[r]: one group. Input
// k goes to sum k mod S (4 bits: byte row j's low and high nibbles to sums 2j and 2j + 1 mod S).
template <int kBits, int RB>
inline void group_sums(const float* x, int64_t K, const void* panel, int64_t k0, int64_t k1, Row16* part) {
  constexpr int S = kSplits<RB>;
  Row16 sums[RB][S];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < S; ++j) sums[r][j] = Row16{};
  int64_t k = k0;
  if constexpr (kBits == 8) {
    const int8_t* q = static_cast<const int8_t*>(panel);
    for (; k + S <= k1; k += S) {
      for (int j = 0; j < S; ++j) {
        const Row16 w = row_q8(q + (k + j) * kWidth);
        for (int r = 0; r < RB; ++r) fma_row(sums[r][j], x[r * K + k + j], w);
      }
    }
    for (; k < k1; ++k) {
      const Row16 w = row_q8(q + k * kWidth);
      for (int r = 0; r < RB; ++r) fma_row(sums[r][0], x[r * K + k], w);
    }
  } else {  // k0 even: pairs of inputs from one byte; an odd k1 ends on a low nibble
    const uint8_t* q = static_cast<const uint8_t*>(panel);
    constexpr int kPairs = S >= 2 ? S / 2 : 1;  // byte rows per round
    Row16 lo, hi;
    for (; k + 2 * kPairs <= k1; k += 2 * kPairs) {
      for (int j = 0; j < kPairs; ++j) {
        rows_q4(q + ((k / 2) + j) * kWidth, &lo, &hi);
        for (int r = 0; r < RB; ++r) {
          fma_row(sums[r][(2 * j) % S], x[r * K + k + 2 * j], lo);
          fma_row(sums[r][(2 * j + 1) % S], x[r * K + k + 2 * j + 1], hi);
        }
      }
    }
    for (; k + 1 < k1; k += 2) {
      rows_q4(q + (k / 2) * kWidth, &lo, &hi);
      for (int r = 0; r < RB; ++r) {
        fma_row(sums[r][0], x[r * K + k], lo);
        fma_row(sums[r][S - 1], x[r * K + k + 1], hi);
      }
    }
    if (k < k1) {
      rows_q4(q + (k / 2) * kWidth, &lo, &hi);
      for (int r = 0; r < RB; ++r) fma_row(sums[r][0], x[r * K + k], lo);
    }
  }
  for (int r = 0; r < RB; ++r) {
    part[r] = sums[r][0];
    for (int j = 1; j < S; ++j) {
      part[r].a += sums[r][j].a;
      part[r].b += sums[r][j].b;
    }
  }
}

// y[r, 0:16] for RB rows of one panel: group by group, each group's sums scaled and added.
// Offsets (or nullptr): the panel's [groups, 16]; xsums: each row's group sums of x, rows `groups` apart.
template <int kBits, int RB>
inline void panel_rows(const float* x, int64_t K, const void* panel, const float* scales, int64_t G, float* y,
                       int64_t N, const float* offsets, const float* xsums, int64_t groups) {
  Row16 acc[RB], part[RB];
  for (int r = 0; r < RB; ++r) acc[r] = Row16{};
  for (int64_t g = 0; g * G < K; ++g) {
    group_sums<kBits, RB>(x, K, panel, g * G, std::min(K, (g + 1) * G), part);
    const f32x8 s0 = load8(scales + g * kWidth), s1 = load8(scales + g * kWidth + 8);
    for (int r = 0; r < RB; ++r) {
      acc[r].a += part[r].a * s0;
      acc[r].b += part[r].b * s1;
    }
    if (offsets != nullptr) {
      const f32x8 o0 = load8(offsets + g * kWidth), o1 = load8(offsets + g * kWidth + 8);
      for (int r = 0; r < RB; ++r) {
        const f32x8 xs = splat(xsums[r * groups + g]);
        acc[r].a += xs * o0;
        acc[r].b += xs * o1;
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    store8(y + r * N, acc[r].a);
    store8(y + r * N + 8, acc[r].b);
  }
}

// One row of x (decode) against NP panels `panel_bytes` apart, read side by side: NP streams at once, and
// NP · S · 2 multiply-add chains (S sums per panel, as group_sums splits them), each stream asked for
// kAheadBytes ahead (the hardware's prefetchers stop at every 4 KiB page). On Zen 2 the conversions bound
// it, not the chains: about 4 cycles per 16 int8 weights and 8 per 32 int4 ones, with the data in cache.
constexpr int64_t kAheadBytes = 1024;

template <int kBits, int NP, int S>
void panels_one_row(const float* x, int64_t K, const uint8_t* q, int64_t panel_bytes, const float* scales,
                    int64_t scale_stride, int64_t G, float* y, const float* offsets, const float* xsums) {
  constexpr int64_t kRowBytes = kWidth;  // bytes per row of a panel: one input (8 bits) or two (4 bits)
  Row16 acc[NP];
  for (int i = 0; i < NP; ++i) acc[i] = Row16{};
  for (int64_t g = 0; g * G < K; ++g) {
    const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
    Row16 sums[NP][S];
    for (int i = 0; i < NP; ++i)
      for (int j = 0; j < S; ++j) sums[i][j] = Row16{};
    if constexpr (kBits == 8) {
      int64_t k = k0;
      for (; k + S <= k1; k += S) {
        if (k % 4 < S) {  // a cache line holds 4 rows
          for (int i = 0; i < NP; ++i) __builtin_prefetch(q + i * panel_bytes + k * kRowBytes + kAheadBytes, 0, 2);
        }
        for (int j = 0; j < S; ++j) {
          for (int i = 0; i < NP; ++i) {
            fma_row(sums[i][j], x[k + j], row_q8(reinterpret_cast<const int8_t*>(q + i * panel_bytes) + (k + j) * kRowBytes));
          }
        }
      }
      for (; k < k1; ++k) {
        for (int i = 0; i < NP; ++i) {
          fma_row(sums[i][0], x[k], row_q8(reinterpret_cast<const int8_t*>(q + i * panel_bytes) + k * kRowBytes));
        }
      }
    } else {  // k0 even; an odd k1 ends on a low nibble
      Row16 lo, hi;
      int64_t k = k0;
      for (; k + 1 < k1; k += 2) {
        const int64_t b = (k / 2) * kRowBytes;
        if ((k / 2) % 4 == 0) {
          for (int i = 0; i < NP; ++i) __builtin_prefetch(q + i * panel_bytes + b + kAheadBytes, 0, 2);
        }
        for (int i = 0; i < NP; ++i) {
          rows_q4(q + i * panel_bytes + b, &lo, &hi);
          fma_row(sums[i][0], x[k], lo);
          fma_row(sums[i][S - 1], x[k + 1], hi);
        }
      }
      if (k < k1) {
        for (int i = 0; i < NP; ++i) {
          rows_q4(q + i * panel_bytes + (k / 2) * kRowBytes, &lo, &hi);
          fma_row(sums[i][0], x[k], lo);
        }
      }
    }
    for (int i = 0; i < NP; ++i) {
      for (int j = 1; j < S; ++j) {
        sums[i][0].a += sums[i][j].a;
        sums[i][0].b += sums[i][j].b;
      }
      const float* sc = scales + i * scale_stride + g * kWidth;
      acc[i].a += sums[i][0].a * load8(sc);
      acc[i].b += sums[i][0].b * load8(sc + 8);
      if (offsets != nullptr) {  // laid out as the scales
        const float* o = offsets + i * scale_stride + g * kWidth;
        const f32x8 xs = splat(xsums[g]);
        acc[i].a += xs * load8(o);
        acc[i].b += xs * load8(o + 8);
      }
    }
  }
  for (int i = 0; i < NP; ++i) {
    store8(y + i * kWidth, acc[i].a);
    store8(y + i * kWidth + 8, acc[i].b);
  }
}

// Panels [p0, p1) for one row of x: a few at a time (8 bits: 4 panels, 4 bits: 3; one sum each, as many
// as the 16 vector registers hold without spilling a sum to memory), the rest one by one.
template <int kBits>
void panels_row(const float* x, int64_t K, const uint8_t* q, int64_t panel_bytes, const float* s, int64_t groups,
                int64_t G, float* y, int64_t p0, int64_t p1, const float* o, const float* xsums) {
  constexpr int NP = kBits == 8 ? 4 : 3, S = 1;
  const int64_t ss = groups * kWidth;
  auto at = [&](int64_t p) { return o == nullptr ? nullptr : o + p * ss; };
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) {
    panels_one_row<kBits, NP, S>(x, K, q + p * panel_bytes, panel_bytes, s + p * ss, ss, G, y + p * kWidth, at(p),
                                 xsums);
  }
  for (; p < p1; ++p) {
    panels_one_row<kBits, 1, 2>(x, K, q + p * panel_bytes, panel_bytes, s + p * ss, ss, G, y + p * kWidth, at(p),
                                xsums);
  }
}

// Every row of x against one panel: blocks of 4 rows, then the 1-3 left in one pass (one row as decode
// reads it, panels_one_row).
template <int kBits>
void panel_all_rows(const float* x, int64_t R, int64_t K, const void* panel, const float* scales, int64_t G, float* y,
                    int64_t N, const float* offsets, const float* xsums, int64_t groups) {
  int64_t r = 0;
  auto sums = [&](int64_t row) { return xsums == nullptr ? nullptr : xsums + row * groups; };
  for (; r + kRowBlock <= R; r += kRowBlock) {
    panel_rows<kBits, kRowBlock>(x + r * K, K, panel, scales, G, y + r * N, N, offsets, sums(r), groups);
  }
  switch (R - r) {
    case 3: panel_rows<kBits, 3>(x + r * K, K, panel, scales, G, y + r * N, N, offsets, sums(r), groups); break;
    case 2: panel_rows<kBits, 2>(x + r * K, K, panel, scales, G, y + r * N, N, offsets, sums(r), groups); break;
    case 1:
      panels_one_row<kBits, 1, 2>(x + r * K, K, static_cast<const uint8_t*>(panel), 0, scales, 0, G, y + r * N,
                                  offsets, sums(r));
      break;
    default: break;
  }
}

// The product, with offsets `o` (laid out as s) where `o` is not null.
template <ffi::DataType T, int kBits>
ffi::Error QuantMatmulImpl(ffi::ThreadPool& pool, ffi::Buffer<ffi::S32, 0>& layer_index, ffi::Buffer<ffi::F32, 2>& x,
                           ffi::Buffer<T, 4>& q, ffi::Buffer<ffi::F32, 4>& s, const ffi::Buffer<ffi::F32, 4>* o,
                           ffi::ResultBuffer<ffi::F32, 2>& y, int64_t group_size) {
  const int64_t R = x.dimensions()[0], K = x.dimensions()[1];
  const auto qd = q.dimensions(), sd = s.dimensions();
  const int64_t L = qd[0], P = qd[1], N = P * kWidth, G = group_size;
  const int64_t k_rows = kBits == 8 ? K : (K + 1) / 2, groups = G > 0 ? (K + G - 1) / G : 0;
  const int64_t layer = *layer_index.typed_data();
  const bool offsets_fit = o == nullptr || (o->dimensions()[0] == L && o->dimensions()[1] == P &&
                                             o->dimensions()[2] == groups && o->dimensions()[3] == kWidth);
  if (G <= 0 || (kBits == 4 && G % 2) || qd[2] != k_rows || qd[3] != kWidth || sd[0] != L || sd[1] != P ||
      sd[2] != groups || sd[3] != kWidth || y->dimensions()[0] != R || y->dimensions()[1] != N || !offsets_fit) {
    return ffi::Error::InvalidArgument(
        "cpu_kernels quant_matmul: x [R, K] = [" + std::to_string(R) + ", " + std::to_string(K) +
        "], q [L, N / 16, " + (kBits == 8 ? "K" : "K / 2") + ", 16], s (and o) [L, N / 16, ceil(K / G), 16] and "
        "y [R, N] (an even G for 4 bits) do not fit: G = " + std::to_string(G));
  }
  if (layer < 0 || layer >= L) {
    return ffi::Error::InvalidArgument("cpu_kernels quant_matmul: layer " + std::to_string(layer) +
                                       " outside the stack of " + std::to_string(L));
  }
  const auto* q_data = q.typed_data() + layer * P * k_rows * kWidth;
  const float* s_data = s.typed_data() + layer * P * groups * kWidth;
  const float* xs = x.typed_data();
  float* out = y->typed_data();
  const float* o_data = o == nullptr ? nullptr : o->typed_data() + layer * P * groups * kWidth;
  std::vector<float> xsums;  // with offsets: each row's sums of x over each group, [R, groups]
  if (o_data != nullptr) {
    xsums.assign(R * groups, 0.f);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t k = 0; k < K; ++k) xsums[r * groups + k / G] += xs[r * K + k];
    }
  }
  const float* sums = o_data == nullptr ? nullptr : xsums.data();
  const int64_t panel_bytes = k_rows * kWidth;
  const int64_t per_unit = std::max<int64_t>(1, kUnitBytes / std::max<int64_t>(panel_bytes, 1));
  const int64_t units = (P + per_unit - 1) / per_unit;
  auto unit = [&](int64_t u) {
    const int64_t p0 = u * per_unit, p1 = std::min(P, (u + 1) * per_unit);
    if (R == 1) {
      panels_row<kBits>(xs, K, reinterpret_cast<const uint8_t*>(q_data), panel_bytes, s_data, groups, G, out, p0, p1,
                        o_data, sums);
      return;
    }
    for (int64_t p = p0; p < p1; ++p) {
      const float* op = o_data == nullptr ? nullptr : o_data + p * groups * kWidth;
      panel_all_rows<kBits>(xs, R, K, q_data + p * panel_bytes, s_data + p * groups * kWidth, G, out + p * kWidth, N,
                            op, sums, groups);
    }
  };
  if (units > 1) {
    parallel_for(pool, units, unit);
  } else if (units == 1) {
    unit(0);
  }
  return ffi::Error::Success();
}

template <ffi::DataType T, int kBits>
ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 2> x,
                       ffi::Buffer<T, 4> q, ffi::Buffer<ffi::F32, 4> s, ffi::ResultBuffer<ffi::F32, 2> y,
                       int64_t group_size) {
  return QuantMatmulImpl<T, kBits>(pool, layer_index, x, q, s, nullptr, y, group_size);
}

template <ffi::DataType T, int kBits>
ffi::Error QuantMatmulOffsets(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 2> x,
                              ffi::Buffer<T, 4> q, ffi::Buffer<ffi::F32, 4> s, ffi::Buffer<ffi::F32, 4> o,
                              ffi::ResultBuffer<ffi::F32, 2> y, int64_t group_size) {
  return QuantMatmulImpl<T, kBits>(pool, layer_index, x, q, s, &o, y, group_size);
}

// The layer index, x, q (int8 or packed uint8) and s; then o for the _offsets handlers, y, and the group size
// as an attribute.
template <ffi::DataType T>
auto QuantArgs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .Arg<ffi::Buffer<T, 4>>()
      .template Arg<ffi::Buffer<ffi::F32, 4>>();
}

template <ffi::DataType T>
auto Binding() {
  return QuantArgs<T>().template Ret<ffi::Buffer<ffi::F32, 2>>().template Attr<int64_t>("group_size");
}

template <ffi::DataType T>
auto BindingOffsets() {
  return QuantArgs<T>()
      .template Arg<ffi::Buffer<ffi::F32, 4>>()
      .template Ret<ffi::Buffer<ffi::F32, 2>>()
      .template Attr<int64_t>("group_size");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulI8, (QuantMatmul<ffi::S8, 8>), Binding<ffi::S8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulI4, (QuantMatmul<ffi::U8, 4>), Binding<ffi::U8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulI8Offsets, (QuantMatmulOffsets<ffi::S8, 8>), BindingOffsets<ffi::S8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulI4Offsets, (QuantMatmulOffsets<ffi::U8, 4>), BindingOffsets<ffi::U8>());
