// The arithmetic peak of a core, for the compute roofline of the benchmark (scripts/benchmarking/machine.py):
// independent chains of multiply-adds on the kernels' widest float32 vectors (fvec), and, where the
// products of many bfloat16 rows use them, chains of AVX-512's bfloat16 dot products, and where the LM
// head's int8 screen in quads runs, of AVX-512 VNNI's int8 dot products. Twelve chains: a multiply-add's
// latency (4 cycles) times the two a core starts per cycle, and some to spare, so the loop waits on
// neither. Not XLA handlers: called through ctypes, one call per thread; each returns the floating-point
// operations it did (0 where the instructions are missing). Decode at large batch and prefill are bound
// by this, not by memory.

#include <cstdint>

#include "common.h"

namespace {

constexpr int kChains = 12;
volatile float sink;  // where the chains' sums go, so that the compiler keeps them

}  // namespace

extern "C" double LlmJaxMultiplyAddFlops(int64_t iterations) {
  using llm_jax_kernels::fvec;
  using llm_jax_kernels::kLanes;
  fvec acc[kChains];
  fvec b, c;
  for (int j = 0; j < kLanes; ++j) b[j] = 0.999999f, c[j] = 1e-7f;
  for (int i = 0; i < kChains; ++i) acc[i] = b + 1e-7f * static_cast<float>(i);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * b + c;
  }
  fvec total = acc[0];
  for (int i = 1; i < kChains; ++i) total += acc[i];
  sink = total[0];
  return 2.0 * kLanes * kChains * static_cast<double>(iterations);
}

extern "C" double LlmJaxBf16DotFlops(int64_t iterations) {
#if defined(__AVX512BF16__)
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1e-3f * static_cast<float>(i));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, w);
  }
  __m512 total = acc[0];
  for (int i = 1; i < kChains; ++i) total = _mm512_add_ps(total, acc[i]);
  sink = _mm512_reduce_add_ps(total);
  return 2.0 * 32 * kChains * static_cast<double>(iterations);  // 16 lanes, each two products and two adds
#else
  (void)iterations;
  return 0.0;
#endif
}

extern "C" double LlmJaxInt8DotOps(int64_t iterations) {
#if defined(__AVX512VNNI__)
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), w = _mm512_set1_epi8(-2);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, w);
  }
  __m512i total = acc[0];
  for (int i = 1; i < kChains; ++i) total = _mm512_add_epi32(total, acc[i]);
  sink = static_cast<float>(_mm512_reduce_add_epi32(total));
  return 2.0 * 64 * kChains * static_cast<double>(iterations);  // 16 lanes, each four products and four adds
#else
  (void)iterations;
  return 0.0;
#endif
}
