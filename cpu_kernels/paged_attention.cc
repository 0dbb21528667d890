// Paged attention on CPU, as XLA FFI custom calls: one serving step's flat, ragged batch of T query tokens
// from many sequences (decode tokens and prefill chunks together) against one layer of a KV cache held in
// pages [L, P, Z, K, H] (P pages of Z tokens), read where the pages lie.
//
// Sequence b owns q rows query_start[b] ... query_start[b] + num_tokens[b] - 1, the last num_tokens[b] of
// its seq_lens[b] tokens: its query i sits at position p = seq_lens[b] - num_tokens[b] + i. Its key
// position s lies at row s % Z of page block_tables[b, s / Z] (a page index outside [0, P) is clamped,
// as XLA's gathers clamp). The query sees keys s <= p, and p - s < window when a window is given; scores
// q·k · scale, then softcap · tanh(score / softcap) when a softcap is given; softmax in float32 over the
// visible keys (a query with none, and every q row no sequence owns, gives zeros); o = Σ p_s · v_s in
// float32. Keys and values are float32 or bfloat16 (also as its bits, uint16), widened exactly, or int8
// with a float32 scale per slot and kv head (scales [L, P, Z, K]: x = q · s, as llm_jax.kv_cache.Int8KV),
// dequantized exactly as they are widened; the probabilities stay float32. q is float32 [T, N, H] with
// N = K · G, query head n = k · G + g.
//
// A unit of work is up to 16 query rows of one sequence — (query, head) pairs sharing a kv head, row
// r = i · G + g, as in prefill_attention.cc — for a group of kv heads, against the keys those rows see,
// page by page: each page's keys, then its values, are read once for all the unit's rows and kv heads (a
// slot's kv heads lie side by side, so a group of them is one contiguous run per slot), bfloat16 widened
// and int8 dequantized into a page-sized scratch (one row, a decode token with one query head per kv head,
// reads it in place, int8's scales applied to its scores and probabilities).
// A decode token is a unit of G rows; a prefill chunk is many units of 16 rows, each seeing its cached
// prefix and its triangle of the chunk. Units of few rows score row by row with vectors along H, their
// scores [rows, keys] softmaxed over each row's visible keys only (as decode_attention.cc); units of many
// rows as register tiles of keys × 16 rows, their scores [keys, 16] softmaxed down the columns, masked (as
// prefill_attention.cc). p · v is common.h's pv_columns on either layout (pv_row for a row read in place).
//
// Two handlers per dtype (int8's take the scales beside the pages): PagedAttention reads the pages;
// PagedAttentionAppend (what a serving step runs) first writes the step's keys and values [T, K, H] (and
// int8's scales [T, K]) at slots[t] = page · Z + row of the layer (nothing for a slot outside [0, P · Z):
// a padding token; where tokens share a slot the later one's row stays), into pages that are also its
// results, aliased to its operands (XLA updates them in place), then attends the same way.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

constexpr int64_t kRows = kTileRows;       // query rows per unit at most: one column of 16 per key in the tiles
constexpr int64_t kRowWiseMax = 8;  // units of up to this many rows score row by row, larger ones as tiles
#if defined(__AVX512F__)
constexpr int kKeys = 8;  // keys per q·k register tile (8 accumulators of 16)
#else
constexpr int kKeys = 6;  // keys per q·k register tile (12 accumulators of 8)
#endif
constexpr int kOutRows = 6;  // query rows per p·v register tile
// Scores a unit holds at most ([kv heads, rows, keys], floats): how many kv heads a unit takes is bounded
// by it, so that its scores stay in L2.
constexpr int64_t kScoreFloats = 1 << 15;

// Scores of m keys (rows `ld_k` apart) for `rows` query rows q_rows[r] [H]: sc[r · ld + j], eight keys at a
// time per row with vectors along H (each key is read from L1 again for each row).
template <typename C>
void score_rows(const float* const* q_rows, int64_t rows, const C* k, int64_t ld_k, int64_t m, int64_t H, float* sc,
                int64_t ld) {
  for (int64_t j = 0; j < m; j += 8) {
    const int nk = static_cast<int>(std::min<int64_t>(8, m - j));
    for (int64_t r = 0; r < rows; ++r) {
      const f32x8 s = dots8(q_rows[r], k + j * ld_k, ld_k, H, nk);
      for (int e = 0; e < nk; ++e) sc[r * ld + j + e] = s[e];
    }
  }
}

// The same for 16 rows packed as qt [H, 16] (zeros past the unit's rows), as register tiles of kKeys keys
// × 16 rows: sc[j · 16 + r], the 16 rows' scores of a key side by side.
void score_tiles(const float* qt, const float* k, int64_t ld_k, int64_t m, int64_t H, float* sc) {
  for (int64_t j = 0; j < m; j += kKeys) {
    qk_tiles(static_cast<int>(std::min<int64_t>(kKeys, m - j)), k + j * ld_k, ld_k, qt, H, sc + j * kRows);
  }
}

// A score after scale and softcap.
inline f32x8 scaled(f32x8 x, float scale, float softcap) {
  x *= splat(scale);
  if (softcap > 0.f) {
    for (int l = 0; l < 8; ++l) x[l] = softcap * std::tanh(x[l] / softcap);
  }
  return x;
}

// A row's scores → its probabilities, in place: [a, e) scaled, soft-capped and softmaxed in float32 eight
// at a time, the rest of [0, n) zero (all of it when a >= e).
void softmax_row(float* s, int64_t n, int64_t a, int64_t e, float scale, float softcap) {
  if (a >= e) {
    std::fill(s, s + n, 0.f);
    return;
  }
  std::fill(s, s + a, 0.f);
  std::fill(s + e, s + n, 0.f);
  const f32x8 neg_inf = splat(-std::numeric_limits<float>::infinity());
  // s[j:j+8] = fn(s[j:j+8]) over [a, e); the last scores through a copy padded with -inf.
  auto each = [&](auto&& fn) {
    int64_t j = a;
    for (; j + 8 <= e; j += 8) store8(s + j, fn(load8(s + j), 8));
    if (j < e) {
      alignas(32) float tail[8];
      store8(tail, neg_inf);
      std::copy(s + j, s + e, tail);
      store8(tail, fn(load8(tail), static_cast<int>(e - j)));
      std::copy(tail, tail + (e - j), s + j);
    }
  };
  f32x8 top = neg_inf;
  each([&](f32x8 x, int live) {
    x = scaled(x, scale, softcap);
    for (int l = live; l < 8; ++l) x[l] = neg_inf[0];
    top = x > top ? x : top;
    return x;
  });
  float m = top[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, top[l]);
  f32x8 total = splat(0.f);
  each([&](f32x8 x, int) {
    const f32x8 p = x == neg_inf ? splat(0.f) : exp8(x - splat(m));
    total += p;
    return p;
  });
  const f32x8 denom = splat(std::max(hsum(total), std::numeric_limits<float>::min()));
  each([&](f32x8 x, int) { return x / denom; });
}

// The scores of 16 rows side by side, sc [n, 16] (rows past the unit's have lo = hi), → their
// probabilities, in place, eight rows at a time down the keys (as prefill_attention.cc): key j counts for
// row r iff lo[r] <= j < hi[r].
void softmax_columns(float* sc, int64_t n, int64_t rows, const int32_t* lo, const int32_t* hi, float scale,
                     float softcap) {
  const f32x8 neg_inf = splat(-std::numeric_limits<float>::infinity());
  for (int c = 0; c < rows; c += 8) {
    i32x8 l8, h8;
    std::memcpy(&l8, lo + c, sizeof l8);
    std::memcpy(&h8, hi + c, sizeof h8);
    f32x8 top = neg_inf;
    for (int64_t j = 0; j < n; ++j) {
      const i32x8 key = splat_i32(static_cast<int32_t>(j));
      const f32x8 x = (key >= l8) & (key < h8) ? scaled(load8(sc + j * kRows + c), scale, softcap) : neg_inf;
      top = x > top ? x : top;
      store8(sc + j * kRows + c, x);
    }
    f32x8 total = splat(0.f);
    for (int64_t j = 0; j < n; ++j) {
      const f32x8 x = load8(sc + j * kRows + c);
      const f32x8 p = x == neg_inf ? splat(0.f) : exp8(x - top);
      total += p;
      store8(sc + j * kRows + c, p);
    }
    const f32x8 denom = total > splat(std::numeric_limits<float>::min()) ? total
                                                                         : splat(std::numeric_limits<float>::min());
    for (int64_t j = 0; j < n; ++j) store8(sc + j * kRows + c, load8(sc + j * kRows + c) / denom);
  }
}

// o[r, 0:H] += Σ_{j < m} p[r · p_row + j · p_key] · v_j for mr <= 6 query rows sharing the values v_j
// (`stride` apart).
__attribute__((noinline)) void pv_rows(int mr, const float* p, int64_t p_row, int64_t p_key, const float* v,
                                       int64_t stride, int64_t m, float* o, int64_t H) {
  switch (mr) {
    case 6: return pv_columns<6>(p, p_row, p_key, v, stride, m, o, H, H);
    case 5: return pv_columns<5>(p, p_row, p_key, v, stride, m, o, H, H);
    case 4: return pv_columns<4>(p, p_row, p_key, v, stride, m, o, H, H);
    case 3: return pv_columns<3>(p, p_row, p_key, v, stride, m, o, H, H);
    case 2: return pv_columns<2>(p, p_row, p_key, v, stride, m, o, H, H);
    default: return pv_columns<1>(p, p_row, p_key, v, stride, m, o, H, H);
  }
}

// o[0:H] += Σ_{j < n} p[j] · v_j[0:H] for one query row, the values (bfloat16) widened as they are read.
template <typename C>
void pv_row(const float* p, const C* v, int64_t stride, int64_t n, int64_t H, float* o) {
  int64_t h = 0;
  for (; h + 64 <= H; h += 64) pv_run<8>(p, v + h, stride, n, o + h);
  if (h + 32 <= H) pv_run<4>(p, v + h, stride, n, o + h), h += 32;
  if (h + 16 <= H) pv_run<2>(p, v + h, stride, n, o + h), h += 16;
  if (h + 8 <= H) pv_run<1>(p, v + h, stride, n, o + h), h += 8;
  for (; h < H; ++h) {
    float acc = o[h];
    for (int64_t j = 0; j < n; ++j) acc += p[j] * load1(v + j * stride + h);
    o[h] = acc;
  }
}

// One layer of the pages as a unit reads them: the values [P, Z, K, H] and, for int8, their scales [P, Z, K].
template <typename C>
struct Pages {
  const C* x = nullptr;
  const float* scale = nullptr;
};

// n slots' runs of `width` = heads · H values from element `offset` of the layer (slots `stride` = K · H
// apart) as float32, as as_f32_rows gives them: float32 in place, bfloat16 widened into `scratch` [n, width].
template <typename C>
const float* rows_f32(const Pages<C>& pages, int64_t offset, int64_t stride, int64_t n, int64_t width, int64_t,
                      std::vector<float>& scratch, int64_t* ld) {
  return as_f32_rows(pages.x + offset, stride, n, width, scratch, ld);
}

// int8: each head's H values times its scale (the scale of slot s, kv head k is scale[s · K + k], so that of
// element `offset` is scale[offset / H]), into `scratch` [n, width]: q · s in float32, as the XLA reference
// dequantizes.
const float* rows_f32(const Pages<int8_t>& pages, int64_t offset, int64_t stride, int64_t n, int64_t width, int64_t H,
                      std::vector<float>& scratch, int64_t* ld) {
  scratch.resize(static_cast<size_t>(n * width));
  const int64_t heads = width / H, K = stride / H;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t kh = 0; kh < heads; ++kh) {
      const int8_t* x = pages.x + offset + j * stride + kh * H;
      const float s = pages.scale[offset / H + j * K + kh];
      float* out = scratch.data() + j * width + kh * H;
      int64_t h = 0;
      for (; h + 8 <= H; h += 8) store8(out + h, load8(x + h) * splat(s));
      for (; h < H; ++h) out[h] = load1(x + h) * s;
    }
  }
  *ld = width;
  return scratch.data();
}

// What every unit of a step reads.
struct Step {
  const float* q;         // [T, N, H]
  float* o;               // [T, N, H]
  const int32_t* tables;  // [B, X]
  int64_t T, P, Z, K, G, H, X;
  float scale, softcap;
  int64_t window;
};

// Rows [first, first + rows) of sequence b's (query, head) rows for kv heads [kh0, kh1): row r of the
// sequence is its query i_lo + r / G (q row t0 + i, at position p0 + i), head g = r % G; `keys` its
// block sees at most, `cost` an estimate of its work.
struct Unit {
  int64_t b, t0, p0, i_lo, first, rows, keys, kh0, kh1, cost;
};

// One unit: scores page by page, the softmax, p · v page by page; then its rows of o. Units of few rows
// hold their scores row by row, [rows, keys] (each row's softmax over its visible keys only); units scored
// as tiles key by key, [keys, 16] (the softmax down the columns, masked).
template <typename C>
void attend_unit(const Step& st, const Pages<C>& k_layer, const Pages<C>& v_layer, const Unit& u) {
  const int64_t G = st.G, H = st.H, K = st.K, Z = st.Z, N = K * G, R = u.rows, heads = u.kh1 - u.kh0;
  const int64_t span = st.X * Z;  // positions the block table can name
  alignas(32) int32_t lo[kRows] = {}, hi[kRows] = {};  // row r's visible keys, of the unit's n from s_lo
  int64_t from[kRows], to[kRows], query[kRows], head[kRows];  // row r sees positions [from, to)
  int64_t s_lo = span, s_hi = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = u.i_lo + (u.first + r) / G, p = u.p0 + i;
    query[r] = u.t0 + i, head[r] = (u.first + r) % G;
    from[r] = st.window > 0 ? std::max<int64_t>(0, p - st.window + 1) : 0, to[r] = std::min(p + 1, span);
    if (to[r] > from[r]) s_lo = std::min(s_lo, from[r]), s_hi = std::max(s_hi, to[r]);
  }
  for (int64_t r = 0; r < R; ++r) {
    if (to[r] > from[r]) lo[r] = static_cast<int32_t>(from[r] - s_lo), hi[r] = static_cast<int32_t>(to[r] - s_lo);
  }
  // The calling thread's buffers, kept between units and calls.
  thread_local std::vector<float> out, scores, qt, k_wide, v_wide;
  out.assign(static_cast<size_t>(heads * R * H), 0.f);
  const int64_t n = s_hi - s_lo;
  if (n > 0) {
    const bool tiles = R > kRowWiseMax;
    // Rows of scores n rounded up to 8 and 16 more apart, so that they do not all fall in one set of L1.
    const int64_t ld = (n + 7) / 8 * 8 + 16;
    const int64_t p_row = tiles ? 1 : ld, p_key = tiles ? kRows : 1, per_head = tiles ? n * kRows : R * ld;
    const int64_t slot = K * H, width = heads * H;
    scores.resize(static_cast<size_t>(heads * per_head));
    auto q_row = [&](int64_t kh, int64_t r) { return st.q + (query[r] * N + (u.kh0 + kh) * G + head[r]) * H; };
    if (tiles) {  // each kv head's rows side by side, [H, 16]
      qt.assign(static_cast<size_t>(heads * H * kRows), 0.f);
      for (int64_t kh = 0; kh < heads; ++kh) {
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = q_row(kh, r);
          for (int64_t h = 0; h < H; ++h) qt[(kh * H + h) * kRows + r] = qr[h];
        }
      }
    }
    // fn(j, m, offset) for each page the unit reads: its keys [j, j + m) of the unit's n, at element
    // `offset` of the layer (the first of them, kv head kh0).
    auto pages = [&](auto&& fn) {
      for (int64_t x = s_lo / Z; x * Z < s_hi; ++x) {
        const int64_t j_a = std::max(s_lo, x * Z), j_b = std::min(s_hi, x * Z + Z);
        const int64_t page = std::clamp<int64_t>(st.tables[u.b * st.X + x], 0, st.P - 1);
        fn(j_a - s_lo, j_b - j_a, ((page * Z + j_a - x * Z) * K + u.kh0) * H);
      }
    };
    // One row of bfloat16 or int8 (a decode token, one query head per kv head) reads it in place, widened
    // as it is read: a separate widening pass would cost as much as the row's arithmetic. int8's scales
    // multiply the row's scores (q · k = s_k · (q · k_q)) and its probabilities (Σ p · v = Σ (p · s_v) · v_q).
    constexpr bool kInt8 = std::is_same<C, int8_t>::value;
    const bool in_place = R == 1 && !std::is_same<C, float>::value;
    // The scales of the m keys from element `offset` for kv head kh of the unit, K apart.
    auto key_scales = [&](const Pages<C>& layer, int64_t offset, int64_t kh) { return layer.scale + offset / H + kh; };
    pages([&](int64_t j, int64_t m, int64_t offset) {
      if (in_place) {
        for (int64_t kh = 0; kh < heads; ++kh) {
          const float* q_rows[1] = {q_row(kh, 0)};
          float* sc = scores.data() + kh * per_head + j;
          score_rows(q_rows, 1, k_layer.x + offset + kh * H, slot, m, H, sc, ld);
          if constexpr (kInt8) {
            const float* s = key_scales(k_layer, offset, kh);
            for (int64_t e = 0; e < m; ++e) sc[e] *= s[e * K];
          }
        }
        return;
      }
      int64_t ld_k;
      const float* k = rows_f32(k_layer, offset, slot, m, width, H, k_wide, &ld_k);
      for (int64_t kh = 0; kh < heads; ++kh) {
        float* sc = scores.data() + kh * per_head + j * p_key;
        if (tiles) {
          score_tiles(qt.data() + kh * H * kRows, k + kh * H, ld_k, m, H, sc);
        } else {
          const float* q_rows[kRows];
          for (int64_t r = 0; r < R; ++r) q_rows[r] = q_row(kh, r);
          score_rows(q_rows, R, k + kh * H, ld_k, m, H, sc, ld);
        }
      }
    });
    for (int64_t kh = 0; kh < heads; ++kh) {
      float* sc = scores.data() + kh * per_head;
      if (tiles) {
        softmax_columns(sc, n, R, lo, hi, st.scale, st.softcap);
      } else {
        for (int64_t r = 0; r < R; ++r) softmax_row(sc + r * ld, n, lo[r], hi[r], st.scale, st.softcap);
      }
    }
    pages([&](int64_t j, int64_t m, int64_t offset) {
      if (in_place) {
        for (int64_t kh = 0; kh < heads; ++kh) {
          const float* p = scores.data() + kh * per_head + j;
          if constexpr (kInt8) {  // p · s_v, in the values' scratch (unused in place)
            const float* s = key_scales(v_layer, offset, kh);
            v_wide.resize(static_cast<size_t>(m));
            for (int64_t e = 0; e < m; ++e) v_wide[e] = p[e] * s[e * K];
            p = v_wide.data();
          }
          pv_row(p, v_layer.x + offset + kh * H, slot, m, H, out.data() + kh * H);
        }
        return;
      }
      int64_t ld_v;
      const float* v = rows_f32(v_layer, offset, slot, m, width, H, v_wide, &ld_v);
      for (int64_t kh = 0; kh < heads; ++kh) {
        const float* p = scores.data() + kh * per_head + j * p_key;
        for (int64_t r0 = 0; r0 < R; r0 += kOutRows) {
          pv_rows(static_cast<int>(std::min<int64_t>(kOutRows, R - r0)), p + r0 * p_row, p_row, p_key, v + kh * H,
                  ld_v, m, out.data() + (kh * R + r0) * H, H);
        }
      }
    });
  }
  for (int64_t kh = 0; kh < heads; ++kh) {
    for (int64_t r = 0; r < R; ++r) {
      std::copy_n(out.data() + (kh * R + r) * H, H, st.o + (query[r] * N + (u.kh0 + kh) * G + head[r]) * H);
    }
  }
}

// The step's keys and values to write before attending: row t of k_new, v_new [T, K, H] at slot slots[t]
// of the layer's pages (none where it lies outside [0, P · Z)); for int8 also row t of their scales [T, K].
template <typename C>
struct Append {
  C* k_layer = nullptr;  // the layer's pages [P, Z, K, H], written
  C* v_layer = nullptr;
  const C* k_new = nullptr;
  const C* v_new = nullptr;
  const int32_t* slots = nullptr;  // [T]
  float* k_scale_layer = nullptr;  // int8: the layer's scales [P, Z, K], written
  float* v_scale_layer = nullptr;
  const float* k_new_scale = nullptr;  // int8: [T, K]
  const float* v_new_scale = nullptr;
};

// Every sequence's attention over one layer of the pages (k_layer, v_layer: [P, Z, K, H]), after the
// append's writes. Units: each sequence's rows in blocks of 16, each block's kv heads in as few groups as
// give every thread two units and keep a unit's scores within kScoreFloats; the costliest first, so that
// the cheap ones even out the end.
template <typename C>
void attend_step(ffi::ThreadPool& pool, const Step& st, const Pages<C>& k_layer, const Pages<C>& v_layer,
                 const int32_t* query_start, const int32_t* num_tokens, const int32_t* seq_lens, int64_t B,
                 const Append<C>& append) {
  const int64_t T = st.T, K = st.K, G = st.G, H = st.H, N = K * G, span = st.X * st.Z, slot = K * H;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (append.k_layer != nullptr && T > 0) {
    // Writers own slots by residue, each in token order: no two write one slot, the later token's row stays.
    const int64_t writers = std::min(threads, T), slots = st.P * st.Z;
    parallel_for(pool, writers, [&](int64_t w) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s = append.slots[t];
        if (s < 0 || s >= slots || s % writers != w) continue;
        std::copy_n(append.k_new + t * slot, slot, append.k_layer + s * slot);
        std::copy_n(append.v_new + t * slot, slot, append.v_layer + s * slot);
        if (append.k_scale_layer != nullptr) {
          std::copy_n(append.k_new_scale + t * K, K, append.k_scale_layer + s * K);
          std::copy_n(append.v_new_scale + t * K, K, append.v_scale_layer + s * K);
        }
      }
    });
  }
  // The caller's buffers, kept between calls; the lambda below reaches them through these references (a
  // thread_local named in a lambda is the running thread's own).
  thread_local std::vector<Unit> blocks_buf, units_buf;
  thread_local std::vector<char> covered_buf;
  std::vector<Unit>& blocks = blocks_buf;
  std::vector<Unit>& units = units_buf;
  std::vector<char>& covered = covered_buf;
  blocks.clear();
  units.clear();
  covered.assign(static_cast<size_t>(T), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = num_tokens[b], t0 = query_start[b];
    if (n <= 0) continue;
    const int64_t i_lo = std::max<int64_t>(0, -t0), i_hi = std::min<int64_t>(n, T - t0);  // q rows within [0, T)
    if (i_hi <= i_lo) continue;
    std::fill(covered.begin() + (t0 + i_lo), covered.begin() + (t0 + i_hi), 1);
    const int64_t p0 = seq_lens[b] - n, rows = (i_hi - i_lo) * G;
    for (int64_t first = 0; first < rows; first += kRows) {
      Unit u{b, t0, p0, i_lo, first, std::min(kRows, rows - first), 0, 0, K, 0};
      // Its first query sees the lowest key, its last query the highest.
      const int64_t p_first = p0 + i_lo + first / G, p_last = p0 + i_lo + (first + u.rows - 1) / G;
      const int64_t l = st.window > 0 ? std::max<int64_t>(0, p_first - st.window + 1) : 0;
      u.keys = std::max<int64_t>(0, std::min(p_last + 1, span) - l);
      blocks.push_back(u);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    if (!covered[t]) std::fill(st.o + t * N * H, st.o + (t + 1) * N * H, 0.f);
  }
  if (blocks.empty()) return;
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const int64_t parts_min = std::clamp<int64_t>((2 * threads + nb - 1) / nb, 1, K);
  for (const Unit& block : blocks) {
    // Scores per kv head: [keys, 16] as tiles, else [rows, ld].
    const int64_t scores = std::max<int64_t>(
        1, block.rows > kRowWiseMax ? kRows * block.keys : block.rows * (block.keys + 24));
    const int64_t group = std::max<int64_t>(1, std::min((K + parts_min - 1) / parts_min, kScoreFloats / scores));
    const int64_t parts = (K + group - 1) / group;
    // Rows scored as tiles cost all 16 columns.
    const int64_t per_head = block.keys * (block.rows > kRowWiseMax ? kRows : block.rows) + 1;
    for (int64_t part = 0; part < parts; ++part) {
      Unit u = block;
      u.kh0 = part * K / parts, u.kh1 = (part + 1) * K / parts;
      u.cost = per_head * (u.kh1 - u.kh0);
      units.push_back(u);
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  parallel_for(pool, static_cast<int64_t>(units.size()),
               [&](int64_t i) { attend_unit(st, k_layer, v_layer, units[i]); });
}

// The checks both handlers make — q [T, N, H], pages [L, P, Z, K, H] alike, block tables [B, X], the
// sequences' arrays [B], the layer within the stack — and, when they pass, the layer index, the number
// of sequences and the step's shape in *st.
template <ffi::DataType DT>
ffi::Error check_shapes(const char* name, const ffi::Buffer<ffi::S32, 0>& layer_index, const ffi::Buffer<ffi::F32, 3>& q,
                        const ffi::Buffer<DT, 5>& k_pages, const ffi::Buffer<DT, 5>& v_pages,
                        const ffi::Buffer<ffi::S32, 2>& tables, const ffi::Buffer<ffi::S32, 1>& query_start,
                        const ffi::Buffer<ffi::S32, 1>& num_tokens, const ffi::Buffer<ffi::S32, 1>& seq_lens,
                        int64_t* layer, int64_t* B, Step* st) {
  const auto kd = k_pages.dimensions(), vd = v_pages.dimensions(), qd = q.dimensions(), td = tables.dimensions();
  const int64_t P = kd[1], Z = kd[2], K = kd[3], H = kd[4];
  *B = td[0];
  if (!std::equal(kd.begin(), kd.end(), vd.begin()) || K < 1 || qd[2] != H || qd[1] % K != 0 ||
      query_start.dimensions()[0] != *B || num_tokens.dimensions()[0] != *B || seq_lens.dimensions()[0] != *B) {
    return ffi::Error::InvalidArgument(std::string("cpu_kernels ") + name +
                                       ": shapes of q, pages, block tables and sequences do not match");
  }
  *layer = *layer_index.typed_data();
  if (*layer < 0 || *layer >= kd[0]) {
    return ffi::Error::InvalidArgument(std::string("cpu_kernels ") + name + ": layer index outside the cache");
  }
  *st = Step{q.typed_data(), nullptr, tables.typed_data(), qd[0], P, Z, K, qd[1] / K, H, td[1], 0.f, 0.f, 0};
  return ffi::Error::Success();
}

// The checks of int8 pages' scales: [L, P, Z, K] float32 for pages `kd` [L, P, Z, K, H], k's and v's alike.
template <typename Dims>
ffi::Error check_scales(const char* name, const Dims& kd, const ffi::Buffer<ffi::F32, 4>& k_scales,
                        const ffi::Buffer<ffi::F32, 4>& v_scales) {
  const auto ks = k_scales.dimensions(), vs = v_scales.dimensions();
  if (!std::equal(ks.begin(), ks.end(), kd.begin()) || !std::equal(vs.begin(), vs.end(), kd.begin())) {
    return ffi::Error::InvalidArgument(std::string("cpu_kernels ") + name +
                                       ": scales must be [L, P, Z, K] like the int8 pages [L, P, Z, K, H]");
  }
  return ffi::Error::Success();
}

// The checks of the append's new rows: k_new and v_new [T, K, H], slots [T].
template <typename Dims>
ffi::Error check_new(const Step& st, const Dims& nd, const Dims& vnd, int64_t num_slots) {
  if (nd[0] != st.T || nd[1] != st.K || nd[2] != st.H || !std::equal(nd.begin(), nd.end(), vnd.begin()) ||
      num_slots != st.T) {
    return ffi::Error::InvalidArgument(
        "cpu_kernels paged_attention_append: new keys and values must be [T, K, H] and slots [T]");
  }
  return ffi::Error::Success();
}

// Layer `layer` of pages [L, P, Z, K, H] (and, for int8, of their scales [L, P, Z, K]).
template <typename C>
Pages<C> layer_pages(const void* pages, const float* scales, const Step& st, int64_t layer) {
  const int64_t slots = st.P * st.Z * st.K;
  return Pages<C>{reinterpret_cast<const C*>(pages) + layer * slots * st.H,
                  scales == nullptr ? nullptr : scales + layer * slots};
}

// A result aliased to its operand: XLA hands the operand's own buffer back (were it not, it starts as a
// copy), to be updated in place.
template <typename T>
T* updated(void* result, const void* operand, int64_t size) {
  T* out = reinterpret_cast<T*>(result);
  if (out != operand) std::copy_n(reinterpret_cast<const T*>(operand), size, out);
  return out;
}

// layer (int32 scalar), q [T, N, H] float32, k and v pages [L, P, Z, K, H], block_tables [B, X],
// query_start, num_tokens, seq_lens [B] int32 → o [T, N, H] float32.
template <ffi::DataType DT, typename C>
ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 3> q,
                          ffi::Buffer<DT, 5> k_pages, ffi::Buffer<DT, 5> v_pages, ffi::Buffer<ffi::S32, 2> tables,
                          ffi::Buffer<ffi::S32, 1> query_start, ffi::Buffer<ffi::S32, 1> num_tokens,
                          ffi::Buffer<ffi::S32, 1> seq_lens, ffi::ResultBuffer<ffi::F32, 3> o, float scale,
                          int64_t window, float softcap) {
  int64_t layer, B;
  Step st;
  const ffi::Error checked = check_shapes("paged_attention", layer_index, q, k_pages, v_pages, tables, query_start,
                                          num_tokens, seq_lens, &layer, &B, &st);
  if (checked.failure()) return checked;
  st.o = o->typed_data(), st.scale = scale, st.softcap = softcap, st.window = window;
  attend_step(pool, st, layer_pages<C>(k_pages.untyped_data(), nullptr, st, layer),
              layer_pages<C>(v_pages.untyped_data(), nullptr, st, layer), query_start.typed_data(),
              num_tokens.typed_data(), seq_lens.typed_data(), B, Append<C>{});
  return ffi::Error::Success();
}

// The same over int8 pages with their scales k_scales, v_scales [L, P, Z, K] float32.
ffi::Error PagedAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 3> q,
                            ffi::Buffer<ffi::S8, 5> k_pages, ffi::Buffer<ffi::S8, 5> v_pages,
                            ffi::Buffer<ffi::F32, 4> k_scales, ffi::Buffer<ffi::F32, 4> v_scales,
                            ffi::Buffer<ffi::S32, 2> tables, ffi::Buffer<ffi::S32, 1> query_start,
                            ffi::Buffer<ffi::S32, 1> num_tokens, ffi::Buffer<ffi::S32, 1> seq_lens,
                            ffi::ResultBuffer<ffi::F32, 3> o, float scale, int64_t window, float softcap) {
  int64_t layer, B;
  Step st;
  ffi::Error checked = check_shapes("paged_attention", layer_index, q, k_pages, v_pages, tables, query_start,
                                    num_tokens, seq_lens, &layer, &B, &st);
  if (checked.failure()) return checked;
  checked = check_scales("paged_attention", k_pages.dimensions(), k_scales, v_scales);
  if (checked.failure()) return checked;
  st.o = o->typed_data(), st.scale = scale, st.softcap = softcap, st.window = window;
  attend_step(pool, st, layer_pages<int8_t>(k_pages.untyped_data(), k_scales.typed_data(), st, layer),
              layer_pages<int8_t>(v_pages.untyped_data(), v_scales.typed_data(), st, layer),
              query_start.typed_data(), num_tokens.typed_data(), seq_lens.typed_data(), B, Append<int8_t>{});
  return ffi::Error::Success();
}

// Paged attention that first writes the step's keys and values: row t of k_new and v_new [T, K, H] at slot
// slots[t] of the layer (none outside [0, P · Z)), then attends as above. The pages are results aliased to
// the page operands, so XLA updates them in place.
template <ffi::DataType DT, typename C>
ffi::Error PagedAttentionAppend(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index,
                                ffi::Buffer<ffi::F32, 3> q, ffi::Buffer<DT, 3> k_new, ffi::Buffer<DT, 3> v_new,
                                ffi::Buffer<DT, 5> k_pages, ffi::Buffer<DT, 5> v_pages, ffi::Buffer<ffi::S32, 1> slots,
                                ffi::Buffer<ffi::S32, 2> tables, ffi::Buffer<ffi::S32, 1> query_start,
                                ffi::Buffer<ffi::S32, 1> num_tokens, ffi::Buffer<ffi::S32, 1> seq_lens,
                                ffi::ResultBuffer<ffi::F32, 3> o, ffi::ResultBuffer<DT, 5> k_out,
                                ffi::ResultBuffer<DT, 5> v_out, float scale, int64_t window, float softcap) {
  int64_t layer, B;
  Step st;
  ffi::Error checked = check_shapes("paged_attention_append", layer_index, q, k_pages, v_pages, tables,
                                    query_start, num_tokens, seq_lens, &layer, &B, &st);
  if (checked.failure()) return checked;
  checked = check_new(st, k_new.dimensions(), v_new.dimensions(), slots.dimensions()[0]);
  if (checked.failure()) return checked;
  st.o = o->typed_data(), st.scale = scale, st.softcap = softcap, st.window = window;
  const int64_t layer_size = st.P * st.Z * st.K * st.H, cache_size = layer_size * k_pages.dimensions()[0];
  Append<C> append;
  append.k_layer = updated<C>(k_out->untyped_data(), k_pages.untyped_data(), cache_size) + layer * layer_size;
  append.v_layer = updated<C>(v_out->untyped_data(), v_pages.untyped_data(), cache_size) + layer * layer_size;
  append.k_new = reinterpret_cast<const C*>(k_new.untyped_data());
  append.v_new = reinterpret_cast<const C*>(v_new.untyped_data());
  append.slots = slots.typed_data();
  attend_step<C>(pool, st, Pages<C>{append.k_layer}, Pages<C>{append.v_layer}, query_start.typed_data(),
                 num_tokens.typed_data(), seq_lens.typed_data(), B, append);
  return ffi::Error::Success();
}

// The same over int8 pages: k_new, v_new [T, K, H] int8 with their scales [T, K] float32 (the quantized
// keys and values), written with them into the pages and their scales [L, P, Z, K], all four results
// aliased to their operands.
ffi::Error PagedAttentionAppendInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index,
                                  ffi::Buffer<ffi::F32, 3> q, ffi::Buffer<ffi::S8, 3> k_new,
                                  ffi::Buffer<ffi::S8, 3> v_new, ffi::Buffer<ffi::F32, 2> k_new_scale,
                                  ffi::Buffer<ffi::F32, 2> v_new_scale, ffi::Buffer<ffi::S8, 5> k_pages,
                                  ffi::Buffer<ffi::S8, 5> v_pages, ffi::Buffer<ffi::F32, 4> k_scales,
                                  ffi::Buffer<ffi::F32, 4> v_scales, ffi::Buffer<ffi::S32, 1> slots,
                                  ffi::Buffer<ffi::S32, 2> tables, ffi::Buffer<ffi::S32, 1> query_start,
                                  ffi::Buffer<ffi::S32, 1> num_tokens, ffi::Buffer<ffi::S32, 1> seq_lens,
                                  ffi::ResultBuffer<ffi::F32, 3> o, ffi::ResultBuffer<ffi::S8, 5> k_out,
                                  ffi::ResultBuffer<ffi::S8, 5> v_out, ffi::ResultBuffer<ffi::F32, 4> k_scales_out,
                                  ffi::ResultBuffer<ffi::F32, 4> v_scales_out, float scale, int64_t window,
                                  float softcap) {
  int64_t layer, B;
  Step st;
  ffi::Error checked = check_shapes("paged_attention_append", layer_index, q, k_pages, v_pages, tables,
                                    query_start, num_tokens, seq_lens, &layer, &B, &st);
  if (checked.failure()) return checked;
  checked = check_scales("paged_attention_append", k_pages.dimensions(), k_scales, v_scales);
  if (checked.failure()) return checked;
  checked = check_new(st, k_new.dimensions(), v_new.dimensions(), slots.dimensions()[0]);
  if (checked.failure()) return checked;
  const auto ksd = k_new_scale.dimensions(), vsd = v_new_scale.dimensions();
  if (ksd[0] != st.T || ksd[1] != st.K || vsd[0] != st.T || vsd[1] != st.K) {
    return ffi::Error::InvalidArgument("cpu_kernels paged_attention_append: new scales must be [T, K]");
  }
  st.o = o->typed_data(), st.scale = scale, st.softcap = softcap, st.window = window;
  const int64_t L = k_pages.dimensions()[0], layer_slots = st.P * st.Z * st.K, layer_size = layer_slots * st.H;
  Append<int8_t> append;
  append.k_layer = updated<int8_t>(k_out->untyped_data(), k_pages.untyped_data(), L * layer_size) + layer * layer_size;
  append.v_layer = updated<int8_t>(v_out->untyped_data(), v_pages.untyped_data(), L * layer_size) + layer * layer_size;
  append.k_scale_layer =
      updated<float>(k_scales_out->untyped_data(), k_scales.untyped_data(), L * layer_slots) + layer * layer_slots;
  append.v_scale_layer =
      updated<float>(v_scales_out->untyped_data(), v_scales.untyped_data(), L * layer_slots) + layer * layer_slots;
  append.k_new = k_new.typed_data(), append.v_new = v_new.typed_data();
  append.k_new_scale = k_new_scale.typed_data(), append.v_new_scale = v_new_scale.typed_data();
  append.slots = slots.typed_data();
  attend_step<int8_t>(pool, st, Pages<int8_t>{append.k_layer, append.k_scale_layer},
                      Pages<int8_t>{append.v_layer, append.v_scale_layer}, query_start.typed_data(),
                      num_tokens.typed_data(), seq_lens.typed_data(), B, append);
  return ffi::Error::Success();
}

template <ffi::DataType DT>
auto paged_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()           // layer
      .template Arg<ffi::Buffer<ffi::F32, 3>>()  // q [T, N, H]
      .template Arg<ffi::Buffer<DT, 5>>()        // k pages [L, P, Z, K, H]
      .template Arg<ffi::Buffer<DT, 5>>()        // v pages
      .template Arg<ffi::Buffer<ffi::S32, 2>>()  // block tables [B, X]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()  // query_start [B]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()  // num_tokens [B]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()  // seq_lens [B]
      .template Ret<ffi::Buffer<ffi::F32, 3>>()  // o [T, N, H]
      .template Attr<float>("scale")
      .template Attr<int64_t>("window")
      .template Attr<float>("softcap");
}

auto paged_i8_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()  // layer
      .Arg<ffi::Buffer<ffi::F32, 3>>()  // q [T, N, H]
      .Arg<ffi::Buffer<ffi::S8, 5>>()   // k pages [L, P, Z, K, H]
      .Arg<ffi::Buffer<ffi::S8, 5>>()   // v pages
      .Arg<ffi::Buffer<ffi::F32, 4>>()  // k scales [L, P, Z, K]
      .Arg<ffi::Buffer<ffi::F32, 4>>()  // v scales
      .Arg<ffi::Buffer<ffi::S32, 2>>()  // block tables [B, X]
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // query_start [B]
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // num_tokens [B]
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // seq_lens [B]
      .Ret<ffi::Buffer<ffi::F32, 3>>()  // o [T, N, H]
      .Attr<float>("scale")
      .Attr<int64_t>("window")
      .Attr<float>("softcap");
}

template <ffi::DataType DT>
auto paged_append_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()           // layer
      .template Arg<ffi::Buffer<ffi::F32, 3>>()  // q [T, N, H]
      .template Arg<ffi::Buffer<DT, 3>>()        // k_new [T, K, H]
      .template Arg<ffi::Buffer<DT, 3>>()        // v_new
      .template Arg<ffi::Buffer<DT, 5>>()        // k pages [L, P, Z, K, H], aliased to k_out
      .template Arg<ffi::Buffer<DT, 5>>()        // v pages, aliased to v_out
      .template Arg<ffi::Buffer<ffi::S32, 1>>()  // slots [T]
      .template Arg<ffi::Buffer<ffi::S32, 2>>()  // block tables [B, X]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()  // query_start [B]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()  // num_tokens [B]
      .template Arg<ffi::Buffer<ffi::S32, 1>>()  // seq_lens [B]
      .template Ret<ffi::Buffer<ffi::F32, 3>>()  // o [T, N, H]
      .template Ret<ffi::Buffer<DT, 5>>()        // k pages
      .template Ret<ffi::Buffer<DT, 5>>()        // v pages
      .template Attr<float>("scale")
      .template Attr<int64_t>("window")
      .template Attr<float>("softcap");
}

auto paged_append_i8_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()  // layer
      .Arg<ffi::Buffer<ffi::F32, 3>>()  // q [T, N, H]
      .Arg<ffi::Buffer<ffi::S8, 3>>()   // k_new [T, K, H]
      .Arg<ffi::Buffer<ffi::S8, 3>>()   // v_new
      .Arg<ffi::Buffer<ffi::F32, 2>>()  // k_new's scales [T, K]
      .Arg<ffi::Buffer<ffi::F32, 2>>()  // v_new's scales
      .Arg<ffi::Buffer<ffi::S8, 5>>()   // k pages [L, P, Z, K, H], aliased to k_out
      .Arg<ffi::Buffer<ffi::S8, 5>>()   // v pages, aliased to v_out
      .Arg<ffi::Buffer<ffi::F32, 4>>()  // k scales [L, P, Z, K], aliased to k_scales_out
      .Arg<ffi::Buffer<ffi::F32, 4>>()  // v scales, aliased to v_scales_out
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // slots [T]
      .Arg<ffi::Buffer<ffi::S32, 2>>()  // block tables [B, X]
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // query_start [B]
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // num_tokens [B]
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // seq_lens [B]
      .Ret<ffi::Buffer<ffi::F32, 3>>()  // o [T, N, H]
      .Ret<ffi::Buffer<ffi::S8, 5>>()   // k pages
      .Ret<ffi::Buffer<ffi::S8, 5>>()   // v pages
      .Ret<ffi::Buffer<ffi::F32, 4>>()  // k scales
      .Ret<ffi::Buffer<ffi::F32, 4>>()  // v scales
      .Attr<float>("scale")
      .Attr<int64_t>("window")
      .Attr<float>("softcap");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionF32, (PagedAttention<ffi::F32, float>), paged_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionBF16, (PagedAttention<ffi::BF16, uint16_t>), paged_binding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionBits, (PagedAttention<ffi::U16, uint16_t>), paged_binding<ffi::U16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionI8, PagedAttentionInt8, paged_i8_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionAppendF32, (PagedAttentionAppend<ffi::F32, float>),
                              paged_append_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionAppendBF16, (PagedAttentionAppend<ffi::BF16, uint16_t>),
                              paged_append_binding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionAppendBits, (PagedAttentionAppend<ffi::U16, uint16_t>),
                              paged_append_binding<ffi::U16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionAppendI8, PagedAttentionAppendInt8, paged_append_i8_binding());
