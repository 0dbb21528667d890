// Attention of many queries per row on CPU (prefill, a full forward, a prompt continuing a cache), as an
// XLA FFI custom call: q [B, T, N, H] against one layer of keys and values [L, B, S, K, H], read where
// they lie.
//
// XLA computes every score of the [T, S] square (half of them masked away by causality), in a
// separate product, then a mask, softmax and second product, each a pass over [B, N, T, S] in memory,
// with the keys and values transposed first: half of a long prompt's prefill. Here a unit
// of work is 16 query rows — (position, head) pairs of one row of the batch and one kv head — and the
// keys they see: only those, as register tiles (q·k: 6 keys × 16 queries, 8 × 16 with AVX-512; p·v: 6
// queries × 16 values' columns, × 64 with AVX-512), with the 16 rows' scores side by side so softmax
// runs 8 of them at a time.
//
// Semantics are llm_jax.backends.base.xla_attention's: the query at t sits at q_positions[b, t]; key
// slot s is visible iff s <= position, s < kv_lengths[b] and (no window or position - s < window);
// scores q·k · scale, then softcap · tanh(score / softcap) when a softcap is given; softmax over the
// visible slots (a row with none gives zeros); probabilities rounded to the values' dtype; o = Σ p_s ·
// v_s, in float32. Keys and values are float32, or bfloat16 (also as its bits, uint16); q is float32
// with N = K · G, query head n = k · G + g.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_tiles.h"
#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

constexpr int64_t kRows = kTileRows;  // query rows per unit: one column of 16 per key (one vector, or two 8-wide)
#if defined(__AVX512F__)
constexpr int kKeys = 8;       // keys per q·k register tile (8 accumulators of 16)
#else
constexpr int kKeys = 6;       // keys per q·k register tile (12 accumulators of 8)
#endif
constexpr int kOutRows = 6;    // query rows per p·v register tile
constexpr int64_t kValueBlock = 256;  // keys per pass of p·v

struct Dims {
  int64_t B, T, S, K, G, H;
};

// o[r, 0:H] += Σ_j p[j, r] · v_j for mr query rows; p is [n, 16].
__attribute__((noinline)) void pv_tiles(int mr, const float* p, const float* v, int64_t stride, int64_t n, float* o,
                                        int64_t H) {
  switch (mr) {
    case 6: return pv_columns<6>(p, 1, kRows, v, stride, n, o, H, H);
    case 5: return pv_columns<5>(p, 1, kRows, v, stride, n, o, H, H);
    case 4: return pv_columns<4>(p, 1, kRows, v, stride, n, o, H, H);
    case 3: return pv_columns<3>(p, 1, kRows, v, stride, n, o, H, H);
    case 2: return pv_columns<2>(p, 1, kRows, v, stride, n, o, H, H);
    default: return pv_columns<1>(p, 1, kRows, v, stride, n, o, H, H);
  }
}

// Query rows [first, first + 16) of row b and kv head kh — row i is position t = i / G, query head
// kh · G + i % G — against the keys they see. Probabilities are rounded to bfloat16 when `round_p` (the
// values were bfloat16).
void attend_unit(const float* q, const float* k_layer, const float* v_layer, const int32_t* positions, int64_t length,
                 float* o, const Dims& d, int64_t b, int64_t kh, int64_t first, float scale, int64_t window,
                 float softcap, bool round_p) {
  const int64_t T = d.T, S = d.S, K = d.K, G = d.G, H = d.H, N = K * G;
  const int64_t rows = std::min(kRows, T * G - first);
  thread_local std::vector<float> qt, scores, out;
  qt.assign(static_cast<size_t>(H * kRows), 0.f);
  // Visible slots of row i: [lo[i], hi[i]); empty for rows past the end.
  alignas(32) int32_t lo[kRows] = {}, hi[kRows] = {};
  int64_t s_lo = S, s_hi = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = (first + i) / G, n = kh * G + (first + i) % G, position = positions[b * T + t];
    const float* qi = q + ((b * T + t) * N + n) * H;
    for (int64_t h = 0; h < H; ++h) qt[h * kRows + i] = qi[h];
    const int64_t l = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
    const int64_t e = std::min<int64_t>(std::min<int64_t>(position + 1, length), S);
    if (e > l) lo[i] = static_cast<int32_t>(l), hi[i] = static_cast<int32_t>(e), s_lo = std::min(s_lo, l),
               s_hi = std::max(s_hi, e);
  }
  out.assign(static_cast<size_t>(kRows * H), 0.f);
  const int64_t n = s_hi - s_lo;
  if (n > 0) {
    const int64_t slot = K * H;  // between slots s and s + 1 of one row
    const float* k0 = k_layer + ((b * S + s_lo) * K + kh) * H;
    const float* v0 = v_layer + ((b * S + s_lo) * K + kh) * H;
    scores.resize(static_cast<size_t>(n * kRows));
    float* sc = scores.data();  // [n, 16]: key j's scores for the 16 rows side by side
    // bfloat16 keys and values are widened a tile (a block) at a time: scratch stays small at any length.
    for (int64_t j = 0; j < n; j += kKeys) {
      const int nj = static_cast<int>(std::min<int64_t>(kKeys, n - j));
      qk_tiles(nj, k0 + j * slot, slot, qt.data(), H, sc + j * kRows);
    }
    // Softmax down each column, 8 rows at a time.
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int half = 0; half < 2; ++half) {
      const int c = 8 * half;
      i32x8 l8, h8;
      std::memcpy(&l8, lo + c, sizeof l8);
      std::memcpy(&h8, hi + c, sizeof h8);
      f32x8 top = splat(neg_inf);
      for (int64_t j = 0; j < n; ++j) {
        f32x8 x = load8(sc + j * kRows + c) * splat(scale);
        if (softcap > 0.f) {
          for (int e = 0; e < 8; ++e) x[e] = softcap * std::tanh(x[e] / softcap);
        }
        const i32x8 s = splat_i32(static_cast<int32_t>(s_lo + j));
        x = (s >= l8) & (s < h8) ? x : splat(neg_inf);
        top = x > top ? x : top;
        store8(sc + j * kRows + c, x);
      }
      f32x8 total = splat(0.f);
      for (int64_t j = 0; j < n; ++j) {
        const f32x8 x = load8(sc + j * kRows + c);
        const f32x8 e = x == splat(neg_inf) ? splat(0.f) : exp8(x - top);
        total += e;
        store8(sc + j * kRows + c, e);
      }
      const f32x8 denom = total > splat(std::numeric_limits<float>::min()) ? total
                                                                           : splat(std::numeric_limits<float>::min());
      for (int64_t j = 0; j < n; ++j) {
        const f32x8 p = load8(sc + j * kRows + c) / denom;
        store8(sc + j * kRows + c, round_p ? round_to_bf16(p) : p);
      }
    }
    // o += p · v, kValueBlock keys at a time: tiles of rows (6 + 6 + 4) × 16 (then 8, then single)
    // columns of H. Each sum still runs over the keys in order.
    for (int64_t j = 0; j < n; j += kValueBlock) {
      const int64_t m = std::min(kValueBlock, n - j);
      const float* v = v0 + j * slot;
      const float* p = sc + j * kRows;
      for (int64_t r0 = 0; r0 < rows; r0 += kOutRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kOutRows, rows - r0));
        pv_tiles(mr, p + r0, v, slot, m, out.data() + r0 * H, H);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = (first + i) / G, n_head = kh * G + (first + i) % G;
    std::copy_n(out.data() + i * H, H, o + ((b * T + t) * N + n_head) * H);
  }
}

// A layer of keys or values [B, S, K, H] as float32 (slots below `slots` of each row): bfloat16 ones are
// widened once per call into `buffer`, not once by each unit of 16 queries that reads them (which, for a
// long prompt, would widen the same keys and values again for every unit).
const float* as_f32_layer(ffi::ThreadPool&, const float* layer, int64_t, int64_t, int64_t, int64_t,
                          std::vector<float>&) {
  return layer;
}

const float* as_f32_layer(ffi::ThreadPool& pool, const uint16_t* layer, int64_t B, int64_t S, int64_t slots,
                          int64_t KH, std::vector<float>& buffer) {
  buffer.resize(static_cast<size_t>(B * S * KH));
  float* out = buffer.data();
  constexpr int64_t kSlotsPerUnit = 64;
  const int64_t chunks = (slots + kSlotsPerUnit - 1) / kSlotsPerUnit;
  parallel_for(pool, B * chunks, [&](int64_t unit) {
    const int64_t b = unit / chunks, s0 = unit % chunks * kSlotsPerUnit, s1 = std::min(slots, s0 + kSlotsPerUnit);
    const uint16_t* src = layer + (b * S + s0) * KH;
    float* dst = out + (b * S + s0) * KH;
    const int64_t n = (s1 - s0) * KH;
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) store8(dst + e, load8(src + e));
    for (; e < n; ++e) dst[e] = load1(src + e);
  });
  return out;
}

// layer (int32 scalar), q [B, T, N, H] float32, k and v [L, B, S, K, H], q_positions [B, T] and
// kv_lengths [B] int32 → o [B, T, N, H] float32.
template <ffi::DataType DT, typename C>
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 4> q,
                            ffi::Buffer<DT, 5> k_cache, ffi::Buffer<DT, 5> v_cache,
                            ffi::Buffer<ffi::S32, 2> q_positions, ffi::Buffer<ffi::S32, 1> kv_lengths,
                            ffi::ResultBuffer<ffi::F32, 4> o, float scale, int64_t window, float softcap) {
  const auto kd = k_cache.dimensions(), vd = v_cache.dimensions(), qd = q.dimensions();
  const int64_t L = kd[0], B = kd[1], S = kd[2], K = kd[3], H = kd[4], T = qd[1];
  const int64_t layer = *layer_index.typed_data();
  if (!std::equal(kd.begin(), kd.end(), vd.begin()) || qd[0] != B || qd[3] != H || qd[2] % K != 0 ||
      q_positions.dimensions()[0] != B || q_positions.dimensions()[1] != T || kv_lengths.dimensions()[0] != B) {
    return ffi::Error::InvalidArgument("cpu_kernels prefill_attention: shapes of q, keys, values and lengths do not match");
  }
  if (layer < 0 || layer >= L) {
    return ffi::Error::InvalidArgument("cpu_kernels prefill_attention: layer index outside the cache");
  }
  const Dims d{B, T, S, K, qd[2] / K, H};
  const size_t layer_size = static_cast<size_t>(B * S * K * H);
  const C* k_layer = reinterpret_cast<const C*>(k_cache.untyped_data()) + layer * layer_size;
  const C* v_layer = reinterpret_cast<const C*>(v_cache.untyped_data()) + layer * layer_size;
  const int32_t* lengths = kv_lengths.typed_data();
  int64_t slots = 0;  // slots any query can see
  for (int64_t b = 0; b < B; ++b) slots = std::max<int64_t>(slots, std::min<int64_t>(S, lengths[b]));
  thread_local std::vector<float> k_buffer, v_buffer;  // the caller's; units read them through k32, v32
  const float* k32 = as_f32_layer(pool, k_layer, B, S, slots, K * H, k_buffer);
  const float* v32 = as_f32_layer(pool, v_layer, B, S, slots, K * H, v_buffer);
  const bool round_p = rounds_to_bf16(v_layer);
  // Units: (block of 16 query rows, row of the batch, kv head), the last blocks first: with causal
  // masks they see the most keys, and taking them first leaves the short ones to even out the end.
  const int64_t blocks = (T * d.G + kRows - 1) / kRows;
  parallel_for(pool, blocks * B * K, [&](int64_t unit) {
    const int64_t block = blocks - 1 - unit / (B * K), b = unit % (B * K) / K, kh = unit % K;
    attend_unit(q.typed_data(), k32, v32, q_positions.typed_data(), lengths[b], o->typed_data(), d, b, kh,
                block * kRows, scale, window, softcap, round_p);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PrefillAttentionF32, (PrefillAttention<ffi::F32, float>), (attention_binding<ffi::F32, 4, 2>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PrefillAttentionBF16, (PrefillAttention<ffi::BF16, uint16_t>), (attention_binding<ffi::BF16, 4, 2>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PrefillAttentionBits, (PrefillAttention<ffi::U16, uint16_t>), (attention_binding<ffi::U16, 4, 2>()));
