// Vector pieces the attention kernels share (decode_attention.cc, prefill_attention.cc, paged_attention.cc):
// scores of a query against up to eight keys, of 16 query rows against a tile of keys, and p · v runs.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace llm_jax_kernels {

constexpr int kTileRows = 16;  // query rows of a qk_tile: one column of 16 per key (one vector, or two 8-wide)

// The sums of eight vectors: {Σ a[0], ..., Σ a[7]}.
inline f32x8 sums8(const f32x8 a[8]) {
#if defined(__AVX__)
  auto m = [](f32x8 v) { __m256 r; std::memcpy(&r, &v, sizeof r); return r; };
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(m(a[0]), m(a[1])), _mm256_hadd_ps(m(a[2]), m(a[3])));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(m(a[4]), m(a[5])), _mm256_hadd_ps(m(a[6]), m(a[7])));
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  f32x8 v;
  std::memcpy(&v, &r, sizeof v);
  return v;
#else
  f32x8 v;
  for (int j = 0; j < 8; ++j) v[j] = hsum(a[j]);
  return v;
#endif
}

// {⟨q, k_0⟩, ..., ⟨q, k_{nk-1}⟩, 0...} for nk <= 8 keys `stride` apart, over H values (float32, or
// bfloat16 widened as it is read).
template <typename C>
inline f32x8 dots8(const float* q, const C* k, int64_t stride, int64_t H, int nk) {
  f32x8 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = splat(0.f);
  const int64_t h_vec = H / 8 * 8;
  if (nk == 8) {
    for (int64_t h = 0; h < h_vec; h += 8) {
      const f32x8 qv = load8(q + h);
      for (int j = 0; j < 8; ++j) acc[j] += qv * load8(k + j * stride + h);
    }
  } else {
    for (int64_t h = 0; h < h_vec; h += 8) {
      const f32x8 qv = load8(q + h);
      for (int j = 0; j < nk; ++j) acc[j] += qv * load8(k + j * stride + h);
    }
  }
  f32x8 s = sums8(acc);
  for (int j = 0; j < nk; ++j) {
    for (int64_t h = h_vec; h < H; ++h) s[j] += q[h] * load1(k + j * stride + h);
  }
  return s;
}

// o[0:8·NV] += Σ_{j < n} p[j] · v_j[0:8·NV], values v_j `stride` apart (float32 or bfloat16).
template <int NV, typename C>
inline void pv_run(const float* p, const C* v, int64_t stride, int64_t n, float* o) {
  f32x8 acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = load8(o + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const f32x8 pj = splat(p[j]);
    for (int c = 0; c < NV; ++c) acc[c] += pj * load8(v + j * stride + 8 * c);
  }
  for (int c = 0; c < NV; ++c) store8(o + 8 * c, acc[c]);
}

// s[j, 0:16] = ⟨k_j, q_i⟩ for NJ keys k_j (rows `stride` apart) and the unit's 16 queries, packed as
// qt [H, 16].
template <int NJ>
void qk_tile(const float* k, int64_t stride, const float* qt, int64_t H, float* s) {
  constexpr int V = kTileRows / kLanes;
  fvec acc[NJ][V] = {};
  for (int64_t h = 0; h < H; ++h) {
    fvec b[V];
    for (int c = 0; c < V; ++c) b[c] = loadv(qt + h * kTileRows + c * kLanes);
    for (int j = 0; j < NJ; ++j) {
      const float a = k[j * stride + h];
      for (int c = 0; c < V; ++c) acc[j][c] += a * b[c];
    }
  }
  for (int j = 0; j < NJ; ++j) {
    for (int c = 0; c < V; ++c) storev(s + j * kTileRows + c * kLanes, acc[j][c]);
  }
}

// Not inlined: inside attend_unit the tile's eight key pointers no longer fit in registers.
__attribute__((noinline)) inline void qk_tiles(int n, const float* k, int64_t stride, const float* qt, int64_t H, float* s) {
  switch (n) {
#if defined(__AVX512F__)
    case 8: return qk_tile<8>(k, stride, qt, H, s);
    case 7: return qk_tile<7>(k, stride, qt, H, s);
#endif
    case 6: return qk_tile<6>(k, stride, qt, H, s);
    case 5: return qk_tile<5>(k, stride, qt, H, s);
    case 4: return qk_tile<4>(k, stride, qt, H, s);
    case 3: return qk_tile<3>(k, stride, qt, H, s);
    case 2: return qk_tile<2>(k, stride, qt, H, s);
    default: return qk_tile<1>(k, stride, qt, H, s);
  }
}

}  // namespace llm_jax_kernels
