// Decode attention on CPU, as an XLA FFI custom call: one query per row against one layer of the
// stacked KV cache [L, B, S, K, H], read where it lies.
//
// In XLA the decode step first slices the layer out of the cache and then, for its dot products,
// transposes the keys and values to [B, K, S, H]: two copies of the layer's cache per layer and step, a
// large share of a decode step at large batch. Here each (row, kv head) reads its keys and values once,
// in the cache's own layout, for all G query heads that share them.
//
// Semantics are llm_jax.backends.base.xla_attention's for one query at position p per row: key slot s
// is visible iff s <= p, s < kv_lengths[b] and (no window or p - s < window); scores q·k · scale, then
// softcap · tanh(score / softcap) when a softcap is given; softmax over the visible slots (a row with
// none gives zeros); probabilities rounded to the values' dtype; o = Σ p_s · v_s, in float32.
//
// The cache is float32, or bfloat16 (also as its bits, uint16: the decode loop carries it so). q is
// float32 [B, N, H] with N = K · G, query head n = k · G + g.
//
// Two handlers: DecodeAttention reads the caches; DecodeAttentionAppend (what decode runs) first writes
// the step's keys and values at each row's slot, into caches that are also its results, aliased to its
// operands (XLA updates them in place), then attends the same way.
//
// Scores are taken eight slots at a time per query head (eight accumulators, summed together), the
// softmax runs on eight scores at a time with a vector exp, and p · v loads each value once for up to
// four query heads sharing it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention_tiles.h"
#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

// o[0:H] += Σ_{j < n} p[j] · v_j[0:H].
template <typename C>
void pv(const float* p, const C* v, int64_t stride, int64_t n, int64_t H, float* o) {
  int64_t h = 0;
  for (; h + 64 <= H; h += 64) pv_run<8>(p, v + h, stride, n, o + h);
  switch ((H - h) / 8) {
    case 7: pv_run<7>(p, v + h, stride, n, o + h); break;
    case 6: pv_run<6>(p, v + h, stride, n, o + h); break;
    case 5: pv_run<5>(p, v + h, stride, n, o + h); break;
    case 4: pv_run<4>(p, v + h, stride, n, o + h); break;
    case 3: pv_run<3>(p, v + h, stride, n, o + h); break;
    case 2: pv_run<2>(p, v + h, stride, n, o + h); break;
    case 1: pv_run<1>(p, v + h, stride, n, o + h); break;
    default: break;
  }
  for (h += (H - h) / 8 * 8; h < H; ++h) {
    float acc = o[h];
    for (int64_t j = 0; j < n; ++j) acc += p[j] * load1(v + j * stride + h);
    o[h] = acc;
  }
}

template <int MR>
void pv_heads(const float* p, int64_t ldp, const float* v, int64_t stride, int64_t n, int64_t H, float* o) {
  pv_columns<MR>(p, ldp, 1, v, stride, n, o, H, H);
}

// o_i[0:H] += Σ_{j < n} p_i[j] · v_j[0:H] for `heads` query heads sharing the values: one at a time with
// eight accumulators across H, else up to four at a time (values read once per four heads, not per head,
// which at long contexts is most of the time p · v takes).
void pv_shared(const float* p, int64_t ldp, int64_t heads, const float* v, int64_t stride, int64_t n, int64_t H,
               float* o) {
  if (heads == 1) return pv(p, v, stride, n, H, o);
  for (int64_t i = 0; i < heads; i += 4) {
    const float* pi = p + i * ldp;
    float* oi = o + i * H;
    switch (std::min<int64_t>(4, heads - i)) {
      case 4: pv_heads<4>(pi, ldp, v, stride, n, H, oi); break;
      case 3: pv_heads<3>(pi, ldp, v, stride, n, H, oi); break;
      case 2: pv_heads<2>(pi, ldp, v, stride, n, H, oi); break;
      default: pv(pi, v, stride, n, H, oi); break;
    }
  }
}

struct Shape {
  int64_t B, S, K, G, H;
};

constexpr int64_t kPvBlock = 64;  // slots per p·v pass (bfloat16 values are widened a block at a time)
constexpr int64_t kChunkedMinSlots = 256;  // from this many slots on, few rows split their slots among threads

// A thread's rows are read as one stream — a row's keys, its values, the next row's keys, its values —
// and its lines are asked for a fixed distance ahead of where the unit reads (`to`, called from
// score_slots and pv_slots as they go): at large batch every row's cache comes from memory, the
// hardware's prefetchers stop at each 4 KiB page (a group of eight slots crosses two or three), and
// without it a row's arithmetic and its reads take turns. (Asking for the next row's keys and values
// while the current row runs stops working for long rows: beyond a few hundred KiB they would evict the
// row being read from L2.) Few rows with long contexts (attend_chunked) ask for each unit's keys, then
// its values, the same way. Where prefetcht1 fills L2 and not L1 (kPrefetchT1FillsL2: CPUs with
// AVX-512) the stream is asked for into L2, further ahead: a stream into L2 can run further ahead than
// L1's few misses in flight allow. Elsewhere (a prefetch fills L1 whatever the hint) a shorter distance,
// the best of those tried, into every level.
constexpr int64_t kAheadBytes = kPrefetchT1FillsL2 ? 24 * 1024 : 8 * 1024;
constexpr int kAheadLocality = kPrefetchT1FillsL2 ? 2 : 3;  // prefetcht1, else prefetcht0

struct RowPrefetch {
  struct Segment {
    const char* p = nullptr;
    int64_t bytes = 0;
  };
  Segment segments[4];  // keys and values of this row, then of the next
  int count = 0, current = 0;
  int64_t offset = 0;  // into segments[current]: the next line to ask for
  int64_t issued = 0;  // bytes of the stream asked for
  int64_t origin = 0;  // where the stream starts in what `to` is told (a unit that starts part way)

  void add(const void* p, int64_t bytes) {
    if (bytes > 0) segments[count++] = Segment{static_cast<const char*>(p), bytes};
  }
  // Asks for the stream's lines up to kAheadBytes past `consumed` (the bytes the unit has read of it).
  void to(int64_t consumed) {
    while (issued < consumed - origin + kAheadBytes && current < count) {
      __builtin_prefetch(segments[current].p + offset, 0, kAheadLocality);
      issued += 64;
      if ((offset += 64) >= segments[current].bytes) offset = 0, ++current;
    }
  }
  // Passes over the stream's first `bytes`, asked for already (by the unit before).
  void skip(int64_t bytes) {
    while (bytes > 0 && current < count) {
      const int64_t n = std::min(bytes, segments[current].bytes - offset);
      bytes -= n, issued += n;
      if ((offset += n) >= segments[current].bytes) offset = 0, ++current;
    }
  }
};

// One row's visible slots [lo, lo + n) seen by the query heads of kv heads [kh0, kh1), and where their
// queries, keys, values, outputs and scores ([heads, n_pad], rows `ld` apart: n_pad and 16 more, so that
// the rows do not all fall in one set of the L1 cache when n_pad is a multiple of 1024) lie.
template <typename C>
struct Span {
  const float* q;  // [heads, H]
  const C* k;      // slot lo, head kh0; slots `slot` apart
  const C* v;
  float* scores;
  int64_t n, n_pad, ld, heads, G, H, slot;
  RowPrefetch* ahead = nullptr;  // the stream of this unit's and the next unit's lines, or none
  // Tells `ahead` how far the unit has read: slots [0, j) and `done` / `of` of the next m of its keys
  // (part 0) or values (part 1).
  void read_to(int part, int64_t j, int64_t m, int64_t done, int64_t of) const {
    if (ahead == nullptr) return;
    const int64_t slot_bytes = slot * static_cast<int64_t>(sizeof(C));
    ahead->to(slot_bytes * (part * n + j) + slot_bytes * m * done / of);
  }
};

template <typename C>
Span<C> span_of(const float* q, const C* k_cache, const C* v_cache, const Shape& d, int64_t b, int64_t kh0, int64_t kh1,
                int64_t lo, int64_t n) {
  const int64_t N = d.K * d.G, offset = ((b * d.S + lo) * d.K + kh0) * d.H;
  const int64_t n_pad = (n + 7) / 8 * 8;
  return Span<C>{q + (b * N + kh0 * d.G) * d.H, k_cache + offset, v_cache + offset, nullptr, n, n_pad, n_pad + 16,
                 (kh1 - kh0) * d.G, d.G, d.H, d.K * d.H};
}

// Scores of slots [j0, j1) (j0 a multiple of 8), eight slots at a time per query head; slots from n to
// n_pad score -inf. Where query heads share kv heads (G > 1), bfloat16 keys are widened once per slot for
// all the heads reading them; with one query head per kv head they are widened as they are read (a
// separate widening pass would cost as much as the scores).
template <typename C>
void score_slots(const Span<C>& sp, int64_t j0, int64_t j1, float scale, float softcap) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t width = sp.heads / sp.G * sp.H;  // the span's kv heads, side by side in a slot
  thread_local std::vector<float> scratch;
  for (int64_t j = j0; j < j1; j += 8) {
    const int nk = static_cast<int>(std::min<int64_t>(8, sp.n - j));
    auto store = [&](int64_t i, f32x8 x) {
      x *= splat(scale);
      if (softcap > 0.f) {
        for (int e = 0; e < nk; ++e) x[e] = softcap * std::tanh(x[e] / softcap);
      }
      for (int e = nk; e < 8; ++e) x[e] = neg_inf;
      store8(sp.scores + i * sp.ld + j, x);
    };
    const C* k = sp.k + j * sp.slot;
    if (sp.G == 1) {
      for (int64_t i = 0; i < sp.heads; ++i) {
        store(i, dots8(sp.q + i * sp.H, k + i * sp.H, sp.slot, sp.H, nk));
        sp.read_to(0, j, nk, i + 1, sp.heads);
      }
      continue;
    }
    int64_t ld;
    const float* wide = as_f32_rows(k, sp.slot, nk, width, scratch, &ld);
    for (int64_t i = 0; i < sp.heads; ++i) {  // query head i reads kv head kh0 + i / G
      store(i, dots8(sp.q + i * sp.H, wide + (i / sp.G) * sp.H, ld, sp.H, nk));
      sp.read_to(0, j, nk, i + 1, sp.heads);
    }
  }
}

// The largest of 8-aligned scores [j0, j1).
inline float max_of(const float* sc, int64_t j0, int64_t j1) {
  f32x8 top = splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = j0; j < j1; j += 8) {
    const f32x8 x = load8(sc + j);
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int e = 1; e < 8; ++e) m = std::max(m, top[e]);
  return m;
}

// sc[j] = e^(sc[j] - m) for 8-aligned [j0, j1) (0 for -inf); returns their sum.
inline float exp_of(float* sc, int64_t j0, int64_t j1, float m) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  f32x8 total = splat(0.f);
  for (int64_t j = j0; j < j1; j += 8) {
    const f32x8 x = load8(sc + j);
    const f32x8 e = x == splat(neg_inf) ? splat(0.f) : exp8(x - splat(m));
    total += e;
    store8(sc + j, e);
  }
  return hsum(total);
}

// sc[j] /= denom for 8-aligned [j0, j1), rounded to bfloat16 when the values are.
template <typename C>
void normalize(float* sc, int64_t j0, int64_t j1, float denom, const C* values) {
  const f32x8 d = splat(denom);
  for (int64_t j = j0; j < j1; j += 8) {
    const f32x8 p = load8(sc + j) / d;
    store8(sc + j, rounds_to_bf16(values) ? round_to_bf16(p) : p);
  }
}

// out[i, 0:H] += Σ_{j in [j0, j1)} p_i[j] · v_j for each query head i of the span: with one query head per
// kv head straight from the cache (bfloat16 widened as it is read), else kPvBlock slots at a time, bfloat16
// values widened once per block for the G heads sharing them.
template <typename C>
void pv_slots(const Span<C>& sp, int64_t j0, int64_t j1, float* out) {
  if (sp.G == 1) {  // eight slots at a time, so that the next unit's lines are asked for as it runs
    for (int64_t j = j0; j < j1; j += 8) {
      const int64_t m = std::min<int64_t>(8, j1 - j);
      for (int64_t i = 0; i < sp.heads; ++i) {
        pv(sp.scores + i * sp.ld + j, sp.v + j * sp.slot + i * sp.H, sp.slot, m, sp.H, out + i * sp.H);
        sp.read_to(1, j, m, i + 1, sp.heads);
      }
    }
    return;
  }
  const int64_t width = sp.heads / sp.G * sp.H;
  thread_local std::vector<float> scratch;
  for (int64_t j = j0; j < j1; j += kPvBlock) {
    const int64_t m = std::min(kPvBlock, j1 - j);
    int64_t ld;
    const float* v = as_f32_rows(sp.v + j * sp.slot, sp.slot, m, width, scratch, &ld);
    for (int64_t i = 0; i < sp.heads; i += sp.G) {  // the G query heads of one kv head
      pv_shared(sp.scores + i * sp.ld + j, sp.ld, sp.G, v + (i / sp.G) * sp.H, ld, m, sp.H, out + i * sp.H);
      sp.read_to(1, j, m, i / sp.G + 1, sp.heads / sp.G);
    }
  }
}

// Slots [lo, hi) visible to row b's query at `position` (hi <= lo: none).
inline void visible(int64_t position, int64_t length, int64_t S, int64_t window, int64_t* lo, int64_t* hi) {
  *hi = std::min<int64_t>(std::min(length, position + 1), S);
  *lo = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// Row b, kv heads kh0:kh1: for each, the G query heads sharing it, over the slots they see. A slot's
// heads lie side by side in the cache ([S, K, H] per row), so the unit walks the slots and takes all its
// heads at each, reading the row's cache as contiguous runs (one head at a time reads a short run per
// slot, and waits on memory for each).
template <typename C>
void attend_unit(const float* q, const C* k_cache, const C* v_cache, float* o, const Shape& d, int64_t b,
                 int64_t kh0, int64_t kh1, int64_t position, int64_t length, float scale, int64_t window,
                 float softcap, RowPrefetch* ahead = nullptr) {
  int64_t lo, hi;
  visible(position, length, d.S, window, &lo, &hi);
  Span<C> sp = span_of(q, k_cache, v_cache, d, b, kh0, kh1, lo, std::max<int64_t>(hi - lo, 0));
  sp.ahead = ahead;
  float* out = o + (b * d.K * d.G + kh0 * d.G) * d.H;
  std::fill(out, out + sp.heads * d.H, 0.f);
  if (sp.n == 0) return;  // no visible key: zeros
  // One buffer per thread, kept between calls: no allocation per layer and step.
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(sp.heads * sp.ld));
  sp.scores = scores.data();
  score_slots(sp, 0, sp.n_pad, scale, softcap);
  for (int64_t i = 0; i < sp.heads; ++i) {
    float* sc = sp.scores + i * sp.ld;
    normalize(sc, 0, sp.n_pad, exp_of(sc, 0, sp.n_pad, max_of(sc, 0, sp.n_pad)), sp.v);
  }
  pv_slots(sp, 0, sp.n, out);
}

// Few rows and many slots: each row's slots in `chunks` runs of all its heads, so that every thread has
// work even when the rows have fewer kv heads than there are threads (one kv head and a long context
// would otherwise run on one thread) and reads whole slots, one contiguous stream. The softmax then spans
// chunks: scores and each chunk's maximum
// first; the row's maximum, exponentials and each chunk's sum next; the row's sum, probabilities and each
// chunk's share of o last, added up at the end — three passes over the units.
template <typename C>
void attend_chunked(ffi::ThreadPool& pool, const float* q, const C* k_cache, const C* v_cache, float* o,
                    const Shape& d, const int32_t* positions, const int32_t* lengths, int64_t chunks, float scale,
                    int64_t window, float softcap) {
  const int64_t B = d.B, N = d.K * d.G, H = d.H;
  std::vector<Span<C>> rows;
  std::vector<int64_t> chunk_slots(B);  // slots per chunk, a multiple of 8
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t lo, hi;
    visible(positions[b], lengths[b], d.S, window, &lo, &hi);
    rows.push_back(span_of(q, k_cache, v_cache, d, b, 0, d.K, lo, std::max<int64_t>(hi - lo, 0)));
    chunk_slots[b] = std::max<int64_t>(8, (rows[b].n_pad / chunks + 7) / 8 * 8);
    total += N * rows[b].ld;
  }
  // The caller's buffers, kept between calls (no allocation per layer and step). The lambdas below must
  // reach them through these references: a thread_local named in a lambda is the running thread's own.
  thread_local std::vector<float> scores_buf, chunk_max_buf, chunk_sum_buf, partial_buf;
  std::vector<float>& scores = scores_buf;
  std::vector<float>& chunk_max = chunk_max_buf;
  std::vector<float>& chunk_sum = chunk_sum_buf;
  std::vector<float>& partial = partial_buf;
  scores.resize(total);
  chunk_max.resize(B * chunks * N);
  chunk_sum.assign(B * chunks * N, 0.f);
  partial.assign(B * chunks * N * H, 0.f);
  for (int64_t b = 0, offset = 0; b < B; offset += N * rows[b].ld, ++b) rows[b].scores = scores.data() + offset;
  auto chunk_range = [&](int64_t unit, int64_t* b, int64_t* c, int64_t* j0, int64_t* j1) {
    *b = unit / chunks, *c = unit % chunks;
    *j0 = std::min(rows[*b].n_pad, *c * chunk_slots[*b]);
    *j1 = std::min(rows[*b].n_pad, *j0 + chunk_slots[*b]);
    return *j1 > *j0;
  };
  // A unit's keys (its values below) asked for ahead as it reads them: one contiguous run.
  const int64_t slot_bytes = d.K * H * static_cast<int64_t>(sizeof(C));
  auto stream = [&](int part, int64_t b, int64_t j0, int64_t j1, RowPrefetch* ahead) {
    const int64_t n = std::min(j1, rows[b].n) - j0;
    ahead->add((part == 0 ? rows[b].k : rows[b].v) + j0 * rows[b].slot, n * slot_bytes);
    ahead->origin = slot_bytes * (part * rows[b].n + j0);
    Span<C> sp = rows[b];
    sp.ahead = ahead;
    return sp;
  };
  parallel_for(pool, B * chunks, [&](int64_t unit) {
    int64_t b, c, j0, j1;
    if (!chunk_range(unit, &b, &c, &j0, &j1)) return;
    RowPrefetch ahead;
    score_slots(stream(0, b, j0, j1, &ahead), j0, j1, scale, softcap);
    for (int64_t i = 0; i < N; ++i) chunk_max[(b * chunks + c) * N + i] = max_of(rows[b].scores + i * rows[b].ld, j0, j1);
  });
  auto row_max = [&](int64_t b, int64_t i) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c * chunk_slots[b] < rows[b].n_pad; ++c) m = std::max(m, chunk_max[(b * chunks + c) * N + i]);
    return m;
  };
  parallel_for(pool, B * chunks, [&](int64_t unit) {
    int64_t b, c, j0, j1;
    if (!chunk_range(unit, &b, &c, &j0, &j1)) return;
    for (int64_t i = 0; i < N; ++i) {
      chunk_sum[(b * chunks + c) * N + i] = exp_of(rows[b].scores + i * rows[b].ld, j0, j1, row_max(b, i));
    }
  });
  parallel_for(pool, B * chunks, [&](int64_t unit) {
    int64_t b, c, j0, j1;
    if (!chunk_range(unit, &b, &c, &j0, &j1)) return;
    for (int64_t i = 0; i < N; ++i) {
      float sum = 0.f;
      for (int64_t cc = 0; cc < chunks; ++cc) sum += chunk_sum[(b * chunks + cc) * N + i];
      normalize(rows[b].scores + i * rows[b].ld, j0, j1, sum, rows[b].v);
    }
    RowPrefetch ahead;
    pv_slots(stream(1, b, j0, j1, &ahead), j0, std::min(j1, rows[b].n), partial.data() + (b * chunks + c) * N * H);
  });
  for (int64_t b = 0; b < B; ++b) {
    float* out = o + b * N * H;
    std::fill(out, out + N * H, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = partial.data() + (b * chunks + c) * N * H;
      for (int64_t e = 0; e < N * H; ++e) out[e] += p[e];
    }
  }
}

// A decode step's keys and values to write before attending: row b's k_new[b], v_new[b] [K, H] at slot
// slots[b] of the layer (none where it lies outside [0, S): a finished row).
template <typename C>
struct Append {
  C* k_layer = nullptr;  // the layer's caches [B, S, K, H], written
  C* v_layer = nullptr;
  const C* k_new = nullptr;  // [B, K, H]
  const C* v_new = nullptr;
  const int32_t* slots = nullptr;

  // Row b's kv heads [kh0, kh1): each unit writes what it is about to read, while the lines are its own.
  void write(const Shape& d, int64_t b, int64_t kh0, int64_t kh1) const {
    if (k_layer == nullptr || slots[b] < 0 || slots[b] >= d.S) return;
    const int64_t from = (b * d.K + kh0) * d.H, to = ((b * d.S + slots[b]) * d.K + kh0) * d.H, n = (kh1 - kh0) * d.H;
    std::copy_n(k_new + from, n, k_layer + to);
    std::copy_n(v_new + from, n, v_layer + to);
  }
};

// Every row's attention over one layer of the caches (k_layer, v_layer: [B, S, K, H]): few rows with many
// slots in chunks of slots, else units of a row's kv heads.
template <typename C>
void attend_rows(ffi::ThreadPool& pool, const float* q, const C* k_layer, const C* v_layer, float* o, const Shape& d,
                 const int32_t* positions, const int32_t* lengths, float scale, int64_t window, float softcap,
                 const Append<C>& append = {}) {
  const int64_t B = d.B, K = d.K;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t most = 0;  // slots the longest row sees
  for (int64_t b = 0; b < B; ++b) {
    int64_t lo, hi;
    visible(positions[b], lengths[b], d.S, window, &lo, &hi);
    most = std::max(most, hi - lo);
  }
  if (B < 2 * threads && most >= kChunkedMinSlots) {
    for (int64_t b = 0; b < B; ++b) append.write(d, b, 0, K);
    attend_chunked(pool, q, k_layer, v_layer, o, d, positions, lengths, (2 * threads + B - 1) / B, scale, window,
                   softcap);
    return;
  }
  // Units: a row's kv heads in `parts` contiguous groups, as few as still give every thread two units
  // (one group at batch 32; four at batch 1 on 2 threads).
  const int64_t parts = std::clamp<int64_t>((2 * threads + B - 1) / B, 1, K);
  if (parts > 1) {
    parallel_for(pool, B * parts, [&](int64_t unit) {
      const int64_t b = unit / parts, kh0 = unit % parts * K / parts, kh1 = (unit % parts + 1) * K / parts;
      append.write(d, b, kh0, kh1);
      attend_unit(q, k_layer, v_layer, o, d, b, kh0, kh1, positions[b], lengths[b], scale, window, softcap);
    });
    return;
  }
  // Whole rows, each thread a contiguous range of them, read as one stream (RowPrefetch).
  const int64_t slot_bytes = K * d.H * static_cast<int64_t>(sizeof(C));
  parallel_for_ranges(pool, B, [&](int64_t b, int64_t next) {
    // What this thread asked for of the row it was to read next: layer, row, bytes; kept between units.
    thread_local const C* asked_layer = nullptr;
    thread_local int64_t asked_row = -1, asked_bytes = 0;
    RowPrefetch ahead;
    int64_t own = 0;  // row b's bytes in the stream
    for (int64_t r : {b, next}) {
      if (r < 0) continue;
      int64_t lo, hi;
      visible(positions[r], lengths[r], d.S, window, &lo, &hi);
      const int64_t offset = (r * d.S + lo) * K * d.H, bytes = std::max<int64_t>(hi - lo, 0) * slot_bytes;
      ahead.add(k_layer + offset, bytes);
      ahead.add(v_layer + offset, bytes);
      if (r == b) own = 2 * bytes;
    }
    if (asked_layer == k_layer && asked_row == b) ahead.skip(asked_bytes);
    append.write(d, b, 0, K);
    attend_unit(q, k_layer, v_layer, o, d, b, 0, K, positions[b], lengths[b], scale, window, softcap, &ahead);
    asked_layer = k_layer, asked_row = next, asked_bytes = std::max<int64_t>(0, ahead.issued - own);
  });
}

// The checks both handlers make — q [B, N, H], caches [L, B, S, K, H] alike, positions and lengths [B], the
// layer within the stack — and, when they pass, the layer index and the shape *d.
template <ffi::DataType T>
ffi::Error check_shapes(const char* name, const ffi::Buffer<ffi::S32, 0>& layer_index,
                        const ffi::Buffer<ffi::F32, 3>& q, const ffi::Buffer<T, 5>& k_cache,
                        const ffi::Buffer<T, 5>& v_cache, const ffi::Buffer<ffi::S32, 1>& q_positions,
                        const ffi::Buffer<ffi::S32, 1>& kv_lengths, int64_t* layer, Shape* d) {
  const auto kd = k_cache.dimensions(), vd = v_cache.dimensions();
  const auto qd = q.dimensions();
  const int64_t B = kd[1], S = kd[2], K = kd[3], H = kd[4];
  if (!std::equal(kd.begin(), kd.end(), vd.begin()) || qd[0] != B || qd[2] != H || qd[1] % K != 0 ||
      q_positions.dimensions()[0] != B || kv_lengths.dimensions()[0] != B) {
    return ffi::Error::InvalidArgument(std::string("cpu_kernels ") + name +
                                       ": shapes of q, caches and lengths do not match");
  }
  *layer = *layer_index.typed_data();
  if (*layer < 0 || *layer >= kd[0]) {
    return ffi::Error::InvalidArgument(std::string("cpu_kernels ") + name + ": layer index outside the cache");
  }
  *d = Shape{B, S, K, qd[1] / K, H};
  return ffi::Error::Success();
}

// layer (int32 scalar), q [B, N, H] float32, k and v caches [L, B, S, K, H], q_positions [B] and
// kv_lengths [B] int32 → o [B, N, H] float32.
template <ffi::DataType T, typename C>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 3> q,
                           ffi::Buffer<T, 5> k_cache, ffi::Buffer<T, 5> v_cache,
                           ffi::Buffer<ffi::S32, 1> q_positions, ffi::Buffer<ffi::S32, 1> kv_lengths,
                           ffi::ResultBuffer<ffi::F32, 3> o, float scale, int64_t window, float softcap) {
  int64_t layer;
  Shape d;
  const ffi::Error checked =
      check_shapes("decode_attention", layer_index, q, k_cache, v_cache, q_positions, kv_lengths, &layer, &d);
  if (checked.failure()) return checked;
  const size_t layer_size = static_cast<size_t>(d.B * d.S * d.K * d.H);
  attend_rows(pool, q.typed_data(), reinterpret_cast<const C*>(k_cache.untyped_data()) + layer * layer_size,
              reinterpret_cast<const C*>(v_cache.untyped_data()) + layer * layer_size, o->typed_data(), d,
              q_positions.typed_data(), kv_lengths.typed_data(), scale, window, softcap);
  return ffi::Error::Success();
}

// Decode attention that first writes the step's keys and values into the caches: row b's k_new[b] and
// v_new[b] [K, H] go to slot slots[b] of the layer (none where the slot lies outside [0, S): a finished
// row), then every row attends as above. The caches are results aliased to the cache operands, so XLA
// updates them in place; in XLA the two writes are eight small ops per layer and step (index
// concatenations, bounds checks, select-updates or scatters), a noticeable share of a small model's step.
template <ffi::DataType T, typename C>
ffi::Error DecodeAttentionAppend(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index,
                                 ffi::Buffer<ffi::F32, 3> q, ffi::Buffer<T, 3> k_new, ffi::Buffer<T, 3> v_new,
                                 ffi::Buffer<T, 5> k_cache, ffi::Buffer<T, 5> v_cache, ffi::Buffer<ffi::S32, 1> slots,
                                 ffi::Buffer<ffi::S32, 1> q_positions, ffi::Buffer<ffi::S32, 1> kv_lengths,
                                 ffi::ResultBuffer<ffi::F32, 3> o, ffi::ResultBuffer<T, 5> k_out,
                                 ffi::ResultBuffer<T, 5> v_out, float scale, int64_t window, float softcap) {
  int64_t layer;
  Shape d;
  const ffi::Error checked = check_shapes("decode_attention_append", layer_index, q, k_cache, v_cache, q_positions,
                                          kv_lengths, &layer, &d);
  if (checked.failure()) return checked;
  const int64_t B = d.B, K = d.K, H = d.H;
  const auto nd = k_new.dimensions(), vnd = v_new.dimensions();
  if (nd.size() != 3 || nd[0] != B || nd[1] != K || nd[2] != H || !std::equal(nd.begin(), nd.end(), vnd.begin()) ||
      slots.dimensions()[0] != B) {
    return ffi::Error::InvalidArgument(
        "cpu_kernels decode_attention_append: new keys and values must be [B, K, H] and slots [B]");
  }
  const size_t layer_size = static_cast<size_t>(B * d.S * K * H), cache_size = layer_size * k_cache.dimensions()[0];
  C* k_cache_out = reinterpret_cast<C*>(k_out->untyped_data());
  C* v_cache_out = reinterpret_cast<C*>(v_out->untyped_data());
  // XLA hands the operands' own buffers back as results (they are aliased); were they not, the results
  // start as copies.
  if (k_cache_out != k_cache.untyped_data()) {
    std::copy_n(reinterpret_cast<const C*>(k_cache.untyped_data()), cache_size, k_cache_out);
  }
  if (v_cache_out != v_cache.untyped_data()) {
    std::copy_n(reinterpret_cast<const C*>(v_cache.untyped_data()), cache_size, v_cache_out);
  }
  Append<C> append;
  append.k_layer = k_cache_out + layer * layer_size;
  append.v_layer = v_cache_out + layer * layer_size;
  append.k_new = reinterpret_cast<const C*>(k_new.untyped_data());
  append.v_new = reinterpret_cast<const C*>(v_new.untyped_data());
  append.slots = slots.typed_data();
  attend_rows<C>(pool, q.typed_data(), append.k_layer, append.v_layer, o->typed_data(), d, q_positions.typed_data(),
                 kv_lengths.typed_data(), scale, window, softcap, append);
  return ffi::Error::Success();
}

template <ffi::DataType T>
auto append_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()
      .template Arg<ffi::Buffer<ffi::F32, 3>>()
      .template Arg<ffi::Buffer<T, 3>>()
      .template Arg<ffi::Buffer<T, 3>>()
      .template Arg<ffi::Buffer<T, 5>>()
      .template Arg<ffi::Buffer<T, 5>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::F32, 3>>()
      .template Ret<ffi::Buffer<T, 5>>()
      .template Ret<ffi::Buffer<T, 5>>()
      .template Attr<float>("scale")
      .template Attr<int64_t>("window")
      .template Attr<float>("softcap");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionF32, (DecodeAttention<ffi::F32, float>), (attention_binding<ffi::F32, 3, 1>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionBF16, (DecodeAttention<ffi::BF16, uint16_t>), (attention_binding<ffi::BF16, 3, 1>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionBits, (DecodeAttention<ffi::U16, uint16_t>), (attention_binding<ffi::U16, 3, 1>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionAppendF32, (DecodeAttentionAppend<ffi::F32, float>), append_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionAppendBF16, (DecodeAttentionAppend<ffi::BF16, uint16_t>), append_binding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionAppendBits, (DecodeAttentionAppend<ffi::U16, uint16_t>), append_binding<ffi::U16>());
