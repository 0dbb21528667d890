// What the kernels share: 8-wide float vectors, loads of float32 and bfloat16 (as its bits, uint16)
// widened to float32, a loop that shares units of work with XLA's intra-op thread pool, and the entries
// argmax.cc takes into matmul.cc's products.

#ifndef LLM_JAX_CPU_KERNELS_COMMON_H_
#define LLM_JAX_CPU_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace llm_jax_kernels {

namespace ffi = xla::ffi;

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

template <typename Vec>
inline Vec vload(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename Vec>
inline void vstore(float* p, Vec v) {
  std::memcpy(p, &v, sizeof v);
}

inline f32x8 load8(const float* p) { return vload<f32x8>(p); }

// bfloat16 is the top half of a float32: widen to 32 bits and shift.
inline f32x8 load8(const uint16_t* p) {
#if defined(__AVX2__)
  // One widening load and a shift. GCC compiles the portable form below into two 4-wide widenings, a
  // byte shift and an insert per 8 values, which slows the bfloat16 streams of decode.
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
#endif
  f32x8 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// int8 (the LM head's screen, llm_jax/backends/cpu/greedy_head.py): sign-extended and converted.
inline f32x8 load8(const int8_t* p) {
#if defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  f32x8 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  f32x8 out;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

inline float load1(const float* p) { return *p; }

inline float load1(const int8_t* p) { return static_cast<float>(*p); }

inline float load1(const uint16_t* p) {
  uint32_t w = uint32_t(*p) << 16;
  float v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline void store8(float* p, f32x8 v) { vstore(p, v); }

inline f32x8 splat(float v) { return f32x8{v, v, v, v, v, v, v, v}; }

// The widest float vector the CPU has, `fvec` of kLanes floats: 16 with AVX-512 (one per 64-byte line;
// twice the multiply-adds per instruction), else 8. loadv widens bfloat16 like load8.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
typedef float fvec __attribute__((vector_size(64)));

inline fvec loadv(const float* p) { return vload<fvec>(p); }

inline fvec loadv(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  fvec v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline fvec loadv(const int8_t* p) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  fvec out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

inline void storev(float* p, fvec v) { vstore(p, v); }
#else
constexpr int kLanes = 8;
typedef f32x8 fvec;

template <typename T>
inline fvec loadv(const T* p) {
  return load8(p);
}

inline void storev(float* p, fvec v) { store8(p, v); }
#endif


typedef int32_t i32x8 __attribute__((vector_size(32)));

inline i32x8 splat_i32(int32_t v) { return i32x8{v, v, v, v, v, v, v, v}; }

inline f32x8 as_f32(u32x8 v) {
  f32x8 f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}

inline u32x8 as_u32(f32x8 v) {
  u32x8 u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// float32 rounded to the nearest bfloat16 (ties to even), as float32: what XLA's convert does (a NaN stays
// a NaN, made quiet: rounding its low bits up could carry it into infinity).
inline float round_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    u = (u | 0x00400000u) & 0xffff0000u;
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
  }
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline f32x8 round_to_bf16(f32x8 v) {
  const u32x8 u = as_u32(v);
  const u32x8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const u32x8 quiet_nan = (u | 0x00400000u) & 0xffff0000u;
  return as_f32((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// e^x for a vector of floats F (I: its int32 lanes; Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a
// degree-6 polynomial for e^r; within 2 ulp of the true value). Flushes to 0 below -87.3 and saturates
// at e^88; NaN stays NaN.
template <typename F, typename I>
inline F exp_lanes(F x) {
  const F lo = F{} - 87.33654f, hi = F{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const F magic = F{} + 12582912.f;  // 1.5 · 2^23: adding and subtracting it rounds to an integer
  const F n = (x * 1.44269504088896341f + magic) - magic;
  const F r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  F y = F{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const I two_n = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &two_n, sizeof scale);
  return y * scale;
}

inline f32x8 exp8(f32x8 x) { return exp_lanes<f32x8, i32x8>(x); }

inline float hsum(f32x8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// n rows of H values (`stride` apart) as float32: in place when they are (*ld = stride), else widened into
// `scratch` [n, H] (*ld = H).
inline const float* as_f32_rows(const float* x, int64_t stride, int64_t, int64_t, std::vector<float>&, int64_t* ld) {
  *ld = stride;
  return x;
}

inline const float* as_f32_rows(const uint16_t* x, int64_t stride, int64_t n, int64_t H, std::vector<float>& scratch,
                                int64_t* ld) {
  scratch.resize(static_cast<size_t>(n * H));
  for (int64_t j = 0; j < n; ++j) {
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) store8(scratch.data() + j * H + h, load8(x + j * stride + h));
    for (; h < H; ++h) scratch[j * H + h] = load1(x + j * stride + h);
  }
  *ld = H;
  return scratch.data();
}

// o[r, 0:W·NV] += Σ_{j < n} p[r · p_row + j · p_key] · v_j[0:W·NV] for MR query rows sharing the values
// v_j (`stride` apart), outputs `ldo` apart, in vectors Vec of W floats: the p · v register tile of both
// attention kernels (decode: a row of scores per query head; prefill: 16 rows' scores side by side per
// key). Each value is loaded once for the MR rows; each sum runs over j in order.
template <int MR, int NV, typename Vec = f32x8>
inline void pv_tile(const float* p, int64_t p_row, int64_t p_key, const float* v, int64_t stride, int64_t n, float* o,
                    int64_t ldo) {
  constexpr int W = sizeof(Vec) / sizeof(float);
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = vload<Vec>(o + r * ldo + W * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec b[NV];
    for (int c = 0; c < NV; ++c) b[c] = vload<Vec>(v + j * stride + W * c);
    for (int r = 0; r < MR; ++r) {
      const float a = p[r * p_row + j * p_key];
      for (int c = 0; c < NV; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) vstore(o + r * ldo + W * c, acc[r][c]);
  }
}

// pv_tile over all H columns of o: the widest tiles first (AVX-512: 64, 32, 16 columns; else 16), then
// 8 columns, then one at a time.
template <int MR>
inline void pv_columns(const float* p, int64_t p_row, int64_t p_key, const float* v, int64_t stride, int64_t n,
                       float* o, int64_t ldo, int64_t H) {
  int64_t h = 0;
#if defined(__AVX512F__)
  for (; h + 64 <= H; h += 64) pv_tile<MR, 4, fvec>(p, p_row, p_key, v + h, stride, n, o + h, ldo);
  for (; h + 32 <= H; h += 32) pv_tile<MR, 2, fvec>(p, p_row, p_key, v + h, stride, n, o + h, ldo);
  for (; h + 16 <= H; h += 16) pv_tile<MR, 1, fvec>(p, p_row, p_key, v + h, stride, n, o + h, ldo);
#else
  for (; h + 16 <= H; h += 16) pv_tile<MR, 2>(p, p_row, p_key, v + h, stride, n, o + h, ldo);
#endif
  for (; h + 8 <= H; h += 8) pv_tile<MR, 1>(p, p_row, p_key, v + h, stride, n, o + h, ldo);
  for (; h < H; ++h) {
    for (int r = 0; r < MR; ++r) {
      float acc = o[r * ldo + h];
      for (int64_t j = 0; j < n; ++j) acc += p[r * p_row + j * p_key] * v[j * stride + h];
      o[r * ldo + h] = acc;
    }
  }
}

// Whether probabilities are rounded to bfloat16 before they meet values of this type (as XLA does).
inline bool rounds_to_bf16(const float*) { return false; }
inline bool rounds_to_bf16(const uint16_t*) { return true; }

// A row x [K] of float32 as int8 n [K] and a step t, for the products of the LM head's int8 screen on
// AVX-512 VNNI (matmul.cc, "int8 in quads of rows") and its bound (argmax.cc): t = max |x| / 127 and
// n = x / t rounded to the nearest integer (ties to even), so |x - t n| <= t / 2 (1 + 2^-16) (x / t is
// within 127 (1 + 2^-23) of zero, rounded once before its integer). A row of zeros, or one whose t
// underflows to zero, gives t = 0 and n = 0; a row with a NaN or an infinity gives t = NaN and n = 0. One
// function for both kernels: the bound is computed from the very n and t the product used.
inline float quantize_row(const float* x, int64_t K, int8_t* n) {
  float m = 0.f;
  bool finite = true;
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // Sixteen at a time, with the same result: the maximum is exact in any order, and the quotient, its
  // rounding to the nearest integer (ties to even, as nearbyint in the default mode) and the clamp are
  // each the scalar loop's. Vectorized because the fused greedy head quantizes every row twice (here and
  // in argmax.cc's bound) as serial work before its product.
  const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 mv = _mm512_setzero_ps();
  __mmask16 finite_lanes = 0xffff;
  for (; k + 16 <= K; k += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + k));
    finite_lanes &= _mm512_cmp_ps_mask(a, largest, _CMP_LE_OQ);
    mv = _mm512_max_ps(mv, a);
  }
  m = _mm512_reduce_max_ps(mv);
  finite = finite_lanes == 0xffff;
#endif
  for (; k < K; ++k) {
    const float a = std::fabs(x[k]);
    finite &= a <= std::numeric_limits<float>::max();  // false for NaN and infinity
    m = std::max(m, a);
  }
  const float t = finite ? m / 127.f : std::numeric_limits<float>::quiet_NaN();
  if (!(t > 0.f)) {  // zeros, an underflow, or not finite
    std::memset(n, 0, static_cast<size_t>(K));
    return t == t ? 0.f : t;
  }
  k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 tv = _mm512_set1_ps(t), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; k + 16 <= K; k += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), tv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i i = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(n + k), _mm512_cvtepi32_epi8(i));
  }
#endif
  for (; k < K; ++k) n[k] = static_cast<int8_t>(std::clamp(std::nearbyint(x[k] / t), -127.f, 127.f));
  return t;
}

#if defined(__AVX512F__)
// 16 columns of one row of the quads product's sums as floats: float(sums − shift) · t (matmul.cc's y, and
// the screened logits argmax.cc's fused greedy head takes from the same sums, before their scales).
inline __m512 quads_floats(const int32_t* sums, int32_t shift, float t) {
  const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums), _mm512_set1_epi32(shift));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(t));
}
#endif

// matmul.cc's int8 product in quads of rows (x [R, K] quantized per row by quantize_row; Q [N / 16, K, 16]
// in quads, to_quads's layout), its int32 sums handed over a unit of columns at a time instead of written
// as y: done(c0, width, sums [R, width], shift [R], t [R]) for columns [c0, c0 + width), y[r, c0 + c] =
// float(sums[r, c] − shift[r]) · t[r] (quads_floats); K a multiple of 4 from 4 up to kQuadsMaxK (excluded).
// Units run on the pool's threads, several at once.
// quads_ready(): whether it can run here (AVX-512 VNNI built); whether a call uses it is its caller's choice
// (the `int8_dot` option, cpu_kernels.quads_argmax).
// The longest rows (K) of the quads' products: their int32 sums of K products of at most 127 · 255 cannot
// overflow.
constexpr int64_t kQuadsMaxK = 1 << 16;
using QuadsUnitFn =
    std::function<void(int64_t c0, int64_t width, const int32_t* sums, const int32_t* shift, const float* t)>;
bool quads_ready();
void quads_units(ffi::ThreadPool& pool, const float* x, const int8_t* q, int64_t N, int64_t R, int64_t K,
                 const QuadsUnitFn& done);

// The instruction paths a product on panels may take beyond the float32 register tiles, each where the
// CPU and the build have it: AMX's tiles (`amx`) and AVX-512's bfloat16 dot products (`bf16_dot`), for
// bfloat16 products of many rows. The backend's options (llm_jax.backends.CpuKernels), given to each call
// as FFI attributes of the same names.
struct PanelOptions {
  bool amx = true;
  bool bf16_dot = true;
  // The call's weights are too large to stay in the caches between calls (matmul.cc's kStreamedBytes): its
  // few-rows tiles ask for their panels ahead. How the sums run does not depend on it.
  bool streamed = false;
};

// matmul.cc's product on panels, one row and one panel: y[0:16] = x [K] · p [K, 16], panel of a matrix
// [K, N] of float32 or bfloat16 (its bits), each sum bit for bit the float32 value the product of R rows
// gives that element on `threads` threads (the pool's num_threads()) with the same `options`, whatever its
// other rows: the same path for R and the options, the same inner routines, the same order of sums. x as
// the product reads it: rounded to W's dtype. The greedy heads' exact logits (argmax.cc), which must be
// given the options the head's product ran with, or they could take another path and disagree with it.
void panel_row_product(const float* x, const float* p, int64_t N, int64_t R, int64_t K, int64_t threads,
                       const PanelOptions& options, float* y);
void panel_row_product(const float* x, const uint16_t* p, int64_t N, int64_t R, int64_t K, int64_t threads,
                       const PanelOptions& options, float* y);

// Whether a prefetch of locality 2 (prefetcht1) fills L2 and not L1 on the CPUs this build targets: so
// on those with AVX-512 (AMD's and Intel's), where a stream asked for into L2 can run further ahead than
// L1's few misses in flight allow (decode_attention.cc's rows, matmul.cc's batch-1 panels); AMD's cores
// without AVX-512 fill L1 whatever the hint.
#if defined(__AVX512F__)
constexpr bool kPrefetchT1FillsL2 = true;
#else
constexpr bool kPrefetchT1FillsL2 = false;
#endif

// Cache lines of a block of memory — `left` lines of runs `run` bytes long, `stride` apart — asked for
// one at a time, while other work runs (a block of W for the next tile; the next row's keys and values):
// into every level of cache (kLocality 3), or into L2 and below (2) for lines that will be read once.
struct Prefetcher {
  const char* p = nullptr;
  int64_t stride = 0, run = 0, offset = 0, left = 0;
  template <int kLocality = 3>
  void one() {
    if (left <= 0) return;
    __builtin_prefetch(p + offset, 0, kLocality);
    if ((offset += 64) >= run) offset = 0, p += stride;
    --left;
  }
  template <int kLocality = 3>
  void some(int64_t lines) {
    for (int64_t i = 0; i < lines && left > 0; ++i) one<kLocality>();
  }
};

// Runs fn(unit) for unit in [0, units) on the caller and up to threads - 1 pool tasks.
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t units, const Fn& fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, units, &fn] {
    for (int64_t i; (i = shared->next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      fn(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(units, std::max<int64_t>(pool.num_threads(), 1)) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([drain] { drain(); });
  drain();
  while (shared->done.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

// Runs fn(unit, next) for unit in [0, units), like parallel_for, but each worker (the caller and up to
// threads - 1 pool tasks) first takes the units of its own contiguous range in order, so `next` — the
// unit it will most likely run next, -1 at the end of its range — can be prefetched while `unit` runs.
// A worker done with its range takes units from the others' (a task that starts late, or never, has
// its range done by the others).
template <typename Fn>
void parallel_for_ranges(ffi::ThreadPool& pool, int64_t units, const Fn& fn) {
  const int64_t workers = std::min<int64_t>(units, std::max<int64_t>(pool.num_threads(), 1));
  if (workers <= 0) return;
  struct Shared {
    std::unique_ptr<std::atomic<int64_t>[]> next;
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->next.reset(new std::atomic<int64_t>[workers]);
  for (int64_t w = 0; w < workers; ++w) shared->next[w].store(w * units / workers, std::memory_order_relaxed);
  auto drain = [shared, units, workers, &fn](int64_t self) {
    for (int64_t j = 0; j < workers; ++j) {
      const int64_t w = (self + j) % workers, end = (w + 1) * units / workers;
      for (int64_t i; (i = shared->next[w].fetch_add(1, std::memory_order_relaxed)) < end;) {
        fn(i, i + 1 < end ? i + 1 : -1);
        shared->done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  for (int64_t t = 1; t < workers; ++t) pool.Schedule([drain, t] { drain(t); });
  drain(0);
  while (shared->done.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

// The FFI signature both attention kernels share: layer index, q [.., H] (rank kQRank), the stacked K
// and V caches [L, B, S, K, H] of type DT, query positions (rank kPositionsRank) and kv lengths [B];
// o like q; attributes scale, window and softcap.
template <ffi::DataType DT, size_t kQRank, size_t kPositionsRank>
auto attention_binding() {
  using Cache = ffi::Buffer<DT, 5>;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()
      .template Arg<ffi::Buffer<ffi::F32, kQRank>>()
      .template Arg<Cache>()
      .template Arg<Cache>()
      .template Arg<ffi::Buffer<ffi::S32, kPositionsRank>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::F32, kQRank>>()
      .template Attr<float>("scale")
      .template Attr<int64_t>("window")
      .template Attr<float>("softcap");
}

}  // namespace llm_jax_kernels

#endif  // LLM_JAX_CPU_KERNELS_COMMON_H_
