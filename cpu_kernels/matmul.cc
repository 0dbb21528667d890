// Matrix products for LLM inference on CPU, as XLA FFI custom calls: y_i[R, N_i] = x[R, K] · W_i, for one
// or several weight matrices W_i sharing the input; each W_i may be one layer of a stack
// [L, ...] of every layer's weights, read in place.
//
// Decode reads every weight once per step and does two flops with each, so its speed is the speed of
// streaming the weights from memory. XLA:CPU's matrix products fall short there in two ways this file
// fixes: bfloat16 weights have no kernel (XLA converts the whole matrix to float32 in memory first,
// every step), a matrix-vector product does not reach the bandwidth of both cores, and inside a loop
// over stacked layers XLA copies each layer's weights out of the stack before its product (a dynamic
// slice is never a view there); here the layer index is an operand and the stack is read in place.
//
// W comes in the two layouts the model has: [K, N] ("kn": every projection, in × out) and [N, K] ("nk":
// a tied embedding table [V, D] used as the LM head). Either may be float32 or bfloat16; x and y are
// float32 and sums are accumulated in float32.
//
//   kn: y[r, :] += x[r, k] · W[k, :] for each row k of W — W streams row by row, contiguously, while a
//       tile of y (sized for the L1 cache) is updated in place. Work units are (column tile, slice of
//       rows of W); slices beyond the first accumulate into scratch partial sums, added at the end.
//   nk: y[r, n] = ⟨W[n, :], x[r, :]⟩ — each row of W streams once, against up to four rows of x at a
//       time (x stays in L1). Work units are ranges of n.
//
// That is for few rows (decode at small batch). From kTiledMinRows rows on (batched decode, prefill)
// the products are bound by arithmetic instead, and both layouts run the register tiles of the section
// "many rows" below: over packed panels of W, or for nk with up to 32 rows, with W's rows as they lie
// against x transposed (section "nk, up to 32 rows").
//
// Units are shared out through an atomic counter among the caller and tasks on XLA's intra-op thread
// pool; the caller works too and then waits only for units already taken, so a task that starts late
// (or never) cannot stall the call.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define LLM_JAX_HAS_AMX 1
#else
#define LLM_JAX_HAS_AMX 0
#endif

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

// ---- kn: W [K, N] ---------------------------------------------------------------------------------

constexpr int64_t kPrefetchRows = 4;
// Rows of W taken together: y is loaded and stored once per four rows instead of once per row, which
// leaves the core's load/store ports to the weights.
constexpr int64_t kRowBlock = 4;
// One row of x (decode): a column tile spans whole rows of W when they are at most kFullRowBytes long,
// so that a unit of work (a slice of rows) is one contiguous stretch of memory, which streams faster
// than many short runs; longer rows are cut into tiles of kTileBytes.
constexpr int64_t kFullRowBytes = 16384;
constexpr int64_t kTileBytes = 4096;

// y[r, n0:n1] += Σ_{k in [k0, k1)} x[r, k] · W[k, n0:n1]; y rows are ldy apart.
template <typename W>
void kn_unit(const float* x, const W* w, float* y, int64_t R, int64_t K, int64_t N, int64_t ldy, int64_t n0,
             int64_t n1, int64_t k0, int64_t k1) {
  const int64_t n_vec = n0 + (n1 - n0) / 16 * 16;
  int64_t k = k0;
  for (; k + kRowBlock <= k1; k += kRowBlock) {
    const W* row[kRowBlock];
    for (int j = 0; j < kRowBlock; ++j) row[j] = w + (k + j) * N;
    // The tile's part of each row is a short contiguous run: the hardware prefetcher has no time to
    // find it, so ask for the rows ahead.
    const bool prefetch = k + kRowBlock + kPrefetchRows <= k1;
    for (int64_t n = n0; n < n_vec; n += 16) {
      if (prefetch) {
        for (int j = 0; j < kRowBlock; ++j) __builtin_prefetch(row[j] + kPrefetchRows * N + n, 0, 0);
      }
      f32x8 a[kRowBlock], b[kRowBlock];
      for (int j = 0; j < kRowBlock; ++j) a[j] = load8(row[j] + n), b[j] = load8(row[j] + n + 8);
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + r * K + k;
        float* yr = y + r * ldy + n;
        f32x8 lo = load8(yr), hi = load8(yr + 8);
        for (int j = 0; j < kRowBlock; ++j) {
          const f32x8 xv = splat(xr[j]);
          lo += xv * a[j];
          hi += xv * b[j];
        }
        store8(yr, lo);
        store8(yr + 8, hi);
      }
    }
    for (int64_t n = n_vec; n < n1; ++n) {
      for (int64_t r = 0; r < R; ++r) {
        float acc = y[r * ldy + n];
        for (int j = 0; j < kRowBlock; ++j) acc += x[r * K + k + j] * load1(row[j] + n);
        y[r * ldy + n] = acc;
      }
    }
  }
  for (; k < k1; ++k) {
    const W* row = w + k * N;
    for (int64_t n = n0; n < n_vec; n += 16) {
      const f32x8 a = load8(row + n), b = load8(row + n + 8);
      for (int64_t r = 0; r < R; ++r) {
        const f32x8 xv = splat(x[r * K + k]);
        float* yr = y + r * ldy + n;
        store8(yr, load8(yr) + xv * a);
        store8(yr + 8, load8(yr + 8) + xv * b);
      }
    }
    for (int64_t n = n_vec; n < n1; ++n) {
      const float wv = load1(row + n);
      for (int64_t r = 0; r < R; ++r) y[r * ldy + n] += x[r * K + k] * wv;
    }
  }
}

// One product per matrix in ws (all [K, N_i]), sharing x: every matrix's units go through one
// parallel_for, so projections of the same input (q, k, v; gate, up) cost one fork-join.
template <typename W>
void kn_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws, const std::vector<float*>& ys,
               const std::vector<int64_t>& ns, int64_t R, int64_t K) {
  // Several rows (prefill): a column tile of y for all R rows takes 4 KiB of L1, leaving room for the
  // rows of W streaming through. (The tiling also decides how K is split among threads, and so the
  // order of float32 sums, which can flip a near-tied greedy token: a wider tile per row changes the
  // tokens of models that are tested against transformers' for no gain.)
  const int64_t widest = *std::max_element(ns.begin(), ns.end());
  const int64_t tile = R > 1 ? std::max<int64_t>(16, (1024 / R) / 16 * 16)
                       : widest * static_cast<int64_t>(sizeof(W)) <= kFullRowBytes
                           ? std::max<int64_t>(widest, 1)
                           : kTileBytes / static_cast<int64_t>(sizeof(W));
  const size_t M = ws.size();
  std::vector<int64_t> first_tile(M + 1, 0);
  for (size_t i = 0; i < M; ++i) first_tile[i + 1] = first_tile[i] + (ns[i] + tile - 1) / tile;
  const int64_t tiles = first_tile[M];
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Few tiles (narrow outputs): also split the rows of W, so every thread has work.
  const int64_t slices = std::min<int64_t>(K, std::max<int64_t>(1, (2 * threads + tiles - 1) / tiles));
  const int64_t slice = (K + slices - 1) / slices;
  std::vector<std::vector<float>> partial(M);
  for (size_t i = 0; i < M; ++i) {
    partial[i].assign(static_cast<size_t>((slices - 1) * R * ns[i]), 0.f);
    std::fill(ys[i], ys[i] + R * ns[i], 0.f);
  }
  parallel_for(pool, tiles * slices, [&](int64_t unit) {
    const int64_t t = unit % tiles, s = unit / tiles;
    const size_t i = std::upper_bound(first_tile.begin(), first_tile.end(), t) - first_tile.begin() - 1;
    const int64_t N = ns[i], n0 = (t - first_tile[i]) * tile;
    float* out = s == 0 ? ys[i] : partial[i].data() + (s - 1) * R * N;
    kn_unit(x, ws[i], out, R, K, N, N, n0, std::min(N, n0 + tile), s * slice, std::min(K, (s + 1) * slice));
  });
  for (size_t i = 0; i < M; ++i) {
    for (int64_t s = 1; s < slices; ++s) {
      const float* p = partial[i].data() + (s - 1) * R * ns[i];
      for (int64_t j = 0; j < R * ns[i]; ++j) ys[i][j] += p[j];
    }
  }
}

// ---- nk: W [N, K] ---------------------------------------------------------------------------------

// y[r0:r0+RB, n] = ⟨W[n, :], x[r, :]⟩ for RB <= 4 rows of x.
template <typename W, int RB>
void nk_rows(const float* x, const W* wn, float* y, int64_t K, int64_t N, int64_t r0, int64_t n) {
  f32x8 acc[RB][2] = {};
  const int64_t k_vec = K / 16 * 16;
  for (int64_t k = 0; k < k_vec; k += 16) {
    const f32x8 a = load8(wn + k), b = load8(wn + k + 8);
    for (int r = 0; r < RB; ++r) {
      const float* xr = x + (r0 + r) * K + k;
      acc[r][0] += load8(xr) * a;
      acc[r][1] += load8(xr + 8) * b;
    }
  }
  for (int r = 0; r < RB; ++r) {
    float s = hsum(acc[r][0] + acc[r][1]);
    for (int64_t k = k_vec; k < K; ++k) s += x[(r0 + r) * K + k] * load1(wn + k);
    y[(r0 + r) * N + n] = s;
  }
}

// Rows of W up to this long are asked for kNkAheadBytes ahead of the row being read: with short rows
// (a small model's tied LM head) the hardware prefetcher alone leaves a core waiting. Longer rows are
// left to the hardware, which streams them faster without the extra requests.
constexpr int64_t kNkShortRowBytes = 2048;
constexpr int64_t kNkAheadBytes = 2304;

template <typename W>
void nk_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws, const std::vector<float*>& ys,
               const std::vector<int64_t>& ns, int64_t R, int64_t K) {
  constexpr int64_t kRowsPerUnit = 64;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(W));
  const bool prefetch = row_bytes <= kNkShortRowBytes;
  const size_t M = ws.size();
  std::vector<int64_t> first_unit(M + 1, 0);
  for (size_t i = 0; i < M; ++i) first_unit[i + 1] = first_unit[i] + (ns[i] + kRowsPerUnit - 1) / kRowsPerUnit;
  parallel_for(pool, first_unit[M], [&](int64_t unit) {
    const size_t i = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
    const int64_t N = ns[i], n0 = (unit - first_unit[i]) * kRowsPerUnit;
    const char* end = reinterpret_cast<const char*>(ws[i] + N * K);
    for (int64_t n = n0; n < std::min(N, n0 + kRowsPerUnit); ++n) {
      const W* wn = ws[i] + n * K;
      if (prefetch) {  // one row's worth of lines, kNkAheadBytes on
        const char* ahead = reinterpret_cast<const char*>(wn) + kNkAheadBytes;
        for (int64_t b = 0; b < row_bytes && ahead + b < end; b += 64) __builtin_prefetch(ahead + b, 0, 3);
      }
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) nk_rows<W, 4>(x, wn, ys[i], K, N, r, n);
      switch (R - r) {
        case 3: nk_rows<W, 3>(x, wn, ys[i], K, N, r, n); break;
        case 2: nk_rows<W, 2>(x, wn, ys[i], K, N, r, n); break;
        case 1: nk_rows<W, 1>(x, wn, ys[i], K, N, r, n); break;
        default: break;
      }
    }
  });
}

// ---- many rows: packed panels and register tiles -----------------------------------------------
//
// With many rows (batched decode, prefill) each weight is used R times and the products are bound by
// arithmetic, not memory. Here a tile of y stays in registers while k runs: with 8-wide vectors (16
// registers) up to 6 rows × one panel of 16 columns (per k: 2 loads of W, up to 6 broadcasts of x, 12
// multiply-adds); with AVX-512 (32 registers of 16 floats) up to 12 rows × two panels (per k: 2 loads,
// 12 broadcasts, 24 multiply-adds, each twice as wide): the more multiply-adds per load, the nearer the
// tile runs to the core's peak. x is packed k-major once per call, so a tile's broadcasts come from one
// pointer (12 rows of x as they lie need more pointers than there are registers). W is first packed, a
// block at a time, into panels of 16 columns [kc, 16] (nk: 8 × 8 transposes; bfloat16 widened once
// here, not once per tile), which stay in L2 while every tile of rows of x passes over them. The next
// block of W is prefetched a few cache lines per tile, so memory and arithmetic overlap: without it a
// core waits for each block it packs.

#if defined(__AVX512F__)
constexpr int kMR = 12;            // rows of x and y per tile
constexpr int kTilePanels = 2;     // panels per tile: 24 registers of sums (of 32)
// Rows per tile on W's stored panels (panel_tiled): tiles of 8 rows × 2 panels run nearer a core's
// multiply-add peak than tiles of 10–12, and on panels that need no packing that wins over reading each
// panel fewer times.
constexpr int kPanelMR = 8;
#else
constexpr int kMR = 6;
constexpr int kTilePanels = 1;     // 12 registers of sums (of 16)
constexpr int kPanelMR = kMR;
#endif
constexpr int64_t kPanel = 16;     // columns of a panel: one 16-wide vector or two 8-wide
constexpr int64_t kKC = 512;       // rows of K per block: a panel is at most 32 KiB
constexpr int64_t kBlockBytes = 192 * 1024;  // a unit's packed panels, in L2
// From this many rows of x on, products use the tiles; fewer rows stream (below it streaming is faster,
// from it the tiles are, more so the more rows).
constexpr int64_t kTiledMinRows = 8;

// fn(std::integral_constant<int, m>{}) for m = mr, a tile's rows known only at run time (1 to kMax): the
// register tiles are templates on their rows, so that their sums stay in registers (and not inlined
// here: where GCC inlines them it spills sums of bfloat16's dot products to the stack every step).
template <int kMax, typename Fn>
void with_rows(int64_t mr, const Fn& fn) {
  if constexpr (kMax <= 1) {
    fn(std::integral_constant<int, 1>{});
  } else if (mr >= kMax) {
    fn(std::integral_constant<int, kMax>{});
  } else {
    with_rows<kMax - 1>(mr, fn);
  }
}

// `lines` of a Prefetcher's lines asked for over the `steps` steps of a tile's loop over k, evenly. With
// one tile of rows (8 float32 rows on stored panels, 8–12 packed or on bfloat16's dot products) the tile
// over two panels reads two lines of W a step, and the next block it asks for holds as many: several a
// step then, into L2 only (each is read once, by the one tile), as one a step would have only half the
// block arrive in time. Where there are fewer lines than steps (several tiles share the asking), one
// every few steps, into every level of cache.
class PrefetchOverK {
 public:
  PrefetchOverK(Prefetcher& pf, int64_t lines, int64_t steps)
      : pf_(pf),
        every_(lines > 0 ? std::max<int64_t>(1, steps / lines) : steps + 1),
        per_(lines > steps ? (lines + steps - 1) / steps : 1) {}
  void at(int64_t step) {
    if (step != next_) return;
    next_ += every_;
    if (per_ > 1) {
      pf_.some<2>(per_);
    } else {
      pf_.one();
    }
  }

 private:
  Prefetcher& pf_;
  int64_t every_, per_, next_ = 0;
};

// y[0:MR, 0:16 NP] (+= when `add`) x[0:MR, 0:kc] · [P_0 … P_NP-1][0:kc, 0:16], NP packed panels ps values
// apart (float32, or bfloat16 widened as it is read), x packed k-major (xp[k · MR + r], pack_rows) so that
// every broadcast comes from one pointer (12 rows of x, each its own pointer, need more registers than
// the core has); y rows ldy apart. Asks `pf` for `lines` lines on the way, spread over k; with kAhead > 0
// each of its own panels' streams, a line at a time, kAhead bytes ahead of where it reads instead. `stream`:
// y written with non-temporal stores (AVX-512; y and ldy 64-byte aligned; the caller fences).
template <int MR, int NP, typename P, int64_t kAhead = 0>
__attribute__((noinline)) void tile(const float* xp, int64_t kc, const P* p, int64_t ps, float* y, int64_t ldy, bool add, Prefetcher& pf,
          int64_t lines, bool stream = false) {
  constexpr int V = kPanel / kLanes, NV = NP * V;  // vectors per row of a panel, of the tile
  fvec acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = add ? loadv(y + r * ldy + c * kLanes) : fvec{};
  }
  PrefetchOverK ahead(pf, lines, kc);
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (kAhead > 0) {  // every row of k, though a line may hold two: a branch here spills the sums
      for (int j = 0; j < NP; ++j) {  // it may lie past W: a prefetch cannot fault
        __builtin_prefetch(reinterpret_cast<const char*>(p + j * ps + k * kPanel) + kAhead, 0, 0);
      }
    } else {
      ahead.at(k);
    }
    fvec b[NV];
    for (int j = 0; j < NP; ++j) {
      for (int c = 0; c < V; ++c) b[j * V + c] = loadv(p + j * ps + k * kPanel + c * kLanes);
    }
    for (int r = 0; r < MR; ++r) {
      const float a = xp[k * MR + r];
      for (int c = 0; c < NV; ++c) acc[r][c] += a * b[c];
    }
  }
#if defined(__AVX512F__)
  if (stream) {
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < NV; ++c) _mm512_stream_ps(y + r * ldy + c * kLanes, (__m512)acc[r][c]);
    }
    return;
  }
#endif
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) storev(y + r * ldy + c * kLanes, acc[r][c]);
  }
}

template <int NP, typename P, int64_t kAhead = 0>
void tile_rows(int64_t mr, const float* xp, int64_t kc, const P* p, int64_t ps, float* y, int64_t ldy, bool add,
               Prefetcher& pf, int64_t lines, bool stream = false) {
  with_rows<kMR>(mr, [&](auto MR) { tile<MR, NP, P, kAhead>(xp, kc, p, ps, y, ldy, add, pf, lines, stream); });
}

// mr rows of y over n whole panels (ps values apart; their columns side by side in y): kTilePanels
// panels per tile, where the registers hold that many.
template <typename P>
void tile_panels(int64_t mr, const float* xp, int64_t kc, const P* p, int64_t ps, int64_t n, float* y, int64_t ldy,
                 bool add, Prefetcher& pf, int64_t lines, bool stream = false) {
  int64_t q = 0;
  for (; q + kTilePanels <= n; q += kTilePanels) {
    tile_rows<kTilePanels>(mr, xp, kc, p + q * ps, ps, y + q * kPanel, ldy, add, pf, kTilePanels * lines, stream);
  }
  for (; q < n; ++q) tile_rows<1>(mr, xp, kc, p + q * ps, ps, y + q * kPanel, ldy, add, pf, lines, stream);
}

// dst[k, 0:8] (rows ldd apart) = W[0:8, k] for k < 8: an 8 × 8 block of W [N, K] (rows K apart)
// transposed.
template <typename W>
void transpose8(const W* w, int64_t K, float* dst, int64_t ldd = kPanel) {
  f32x8 r[8], t[8], s[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(w + i * K);
  for (int i = 0; i < 4; ++i) {  // pairs of rows interleaved
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {  // quadruples of rows; columns j and j + 4 in the two halves
    const f32x8 *a = t + 4 * i, *b = t + 4 * i + 2;
    s[4 * i] = __builtin_shufflevector(a[0], b[0], 0, 1, 8, 9, 4, 5, 12, 13);
    s[4 * i + 1] = __builtin_shufflevector(a[0], b[0], 2, 3, 10, 11, 6, 7, 14, 15);
    s[4 * i + 2] = __builtin_shufflevector(a[1], b[1], 0, 1, 8, 9, 4, 5, 12, 13);
    s[4 * i + 3] = __builtin_shufflevector(a[1], b[1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {
    store8(dst + i * ldd, __builtin_shufflevector(s[i], s[i + 4], 0, 1, 2, 3, 8, 9, 10, 11));
    store8(dst + (i + 4) * ldd, __builtin_shufflevector(s[i], s[i + 4], 4, 5, 6, 7, 12, 13, 14, 15));
  }
}

// xp[k · MR + r] = x[r · ldx + k] for r < MR, k < kc: a tile's rows of x as `tile` reads them, written
// in order (MR a constant, so the copy is unrolled); tiles of 8 rows (all of them at 32 rows on stored
// panels) by 8 × 8 transposes, faster than a value at a time.
template <int MR>
void pack_rows(const float* x, int64_t ldx, int64_t kc, float* xp) {
  int64_t k = 0;
  if constexpr (MR == 8) {
    for (; k + 8 <= kc; k += 8) transpose8(x + k, ldx, xp + k * MR, MR);
  }
  for (; k < kc; ++k) {
    for (int r = 0; r < MR; ++r) xp[k * MR + r] = x[r * ldx + k];
  }
}

inline void pack_rows(const float* x, int64_t ldx, int64_t mr, int64_t kc, float* xp) {
  with_rows<kMR>(mr, [&](auto MR) { pack_rows<MR>(x, ldx, kc, xp); });
}

// R rows cut into `tiles` tiles of even size (32 rows, kMR 6: 5 + 5 + 6 + 5 + 5 + 6): tile t's first row
// and row count.
inline void tile_span(int64_t R, int64_t tiles, int64_t t, int64_t* r0, int64_t* mr) {
  *r0 = R * t / tiles;
  *mr = R * (t + 1) / tiles - *r0;
}

// x [R, K] packed once per call for every tile of every block of kc_max rows of K: block k0, tile at r0
// (of mr rows) at k0 · R + r0 · kc, as pack_rows lays it out. Large x (prefill) is packed by all threads:
// on one it would be a serial step of each product.
constexpr int64_t kParallelPackValues = 1 << 16;

inline void pack_tiles(ffi::ThreadPool& pool, const float* x, int64_t R, int64_t K, int64_t kc_max, int64_t tiles,
                       std::vector<float>& xp) {
  xp.resize(static_cast<size_t>(R * K));
  const int64_t blocks = (K + kc_max - 1) / kc_max;
  float* out = xp.data();
  auto pack = [&](int64_t unit) {
    const int64_t k0 = unit / tiles * kc_max, kc = std::min(kc_max, K - k0);
    int64_t r0, mr;
    tile_span(R, tiles, unit % tiles, &r0, &mr);
    pack_rows(x + r0 * K + k0, K, mr, kc, out + k0 * R + r0 * kc);
  };
  if (R * K >= kParallelPackValues) {
    parallel_for(pool, blocks * tiles, pack);
  } else {
    for (int64_t unit = 0; unit < blocks * tiles; ++unit) pack(unit);
  }
}

// P[k, j] = W[n0 + j, k0 + k] (nk) or W[k0 + k, n0 + j] (kn) as float32, for k < kc and j < cols <= 16;
// zero for j >= cols.
template <bool kTransposed, typename W>
void pack(const W* w, int64_t K, int64_t N, int64_t k0, int64_t kc, int64_t n0, int64_t cols, float* p) {
  if (kTransposed && cols == kPanel) {
    const int64_t k_vec = kc / 8 * 8;
    for (int64_t half = 0; half < 2; ++half) {
      const W* rows = w + (n0 + 8 * half) * K + k0;
      for (int64_t k = 0; k < k_vec; k += 8) transpose8(rows + k, K, p + k * kPanel + 8 * half);
      for (int64_t k = k_vec; k < kc; ++k) {
        for (int j = 0; j < 8; ++j) p[k * kPanel + 8 * half + j] = load1(rows + j * K + k);
      }
    }
  } else if (!kTransposed && cols == kPanel) {
    for (int64_t k = 0; k < kc; ++k) {
      const W* row = w + (k0 + k) * N + n0;
      store8(p + k * kPanel, load8(row));
      store8(p + k * kPanel + 8, load8(row + 8));
    }
  } else {
    for (int64_t k = 0; k < kc; ++k) {
      for (int64_t j = 0; j < kPanel; ++j) {
        p[k * kPanel + j] = j >= cols       ? 0.f
                            : kTransposed ? load1(w + (n0 + j) * K + k0 + k)
                                          : load1(w + (k0 + k) * N + n0 + j);
      }
    }
  }
}

// The lines of W that columns [n0, n1) of y and rows [k0, k1) of K read.
template <bool kTransposed, typename W>
Prefetcher block_of(const W* w, int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t k0, int64_t k1) {
  const int64_t size = sizeof(W);
  Prefetcher pf;
  pf.p = reinterpret_cast<const char*>(kTransposed ? w + n0 * K + k0 : w + k0 * N + n0);
  pf.stride = (kTransposed ? K : N) * size;
  pf.run = (kTransposed ? k1 - k0 : n1 - n0) * size;
  pf.left = (kTransposed ? n1 - n0 : k1 - k0) * ((pf.run + 63) / 64);
  return pf;
}

// y[:, n0:n1] = x · W's columns n0:n1 of y, kc rows of K at a time: the block's panels are packed, then
// every tile of rows runs over every panel while the next block — this unit's next rows of K, else
// `next` (the first block of the unit this thread runs next) — is prefetched.
template <bool kTransposed, typename W>
void tiled_unit(const float* xp, const W* w, float* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1,
                Prefetcher next) {
  const int64_t panels = (n1 - n0 + kPanel - 1) / kPanel, kc_max = std::min(K, kKC);
  thread_local std::vector<float> packed, tail;
  packed.resize(panels * kc_max * kPanel);
  tail.resize(kMR * kPanel);  // a panel narrower than 16 columns (the last) computes into this
  const int64_t tiles = (R + kMR - 1) / kMR;
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, K - k0);
    for (int64_t q = 0; q < panels; ++q) {
      const int64_t n = n0 + q * kPanel;
      pack<kTransposed>(w, K, N, k0, kc, n, std::min(kPanel, n1 - n), packed.data() + q * kc * kPanel);
    }
    Prefetcher pf = k0 + kc < K ? block_of<kTransposed>(w, K, N, n0, n1, k0 + kc, std::min(K, k0 + kc + kc_max))
                                : next;
    const int64_t lines_per_tile = (pf.left + tiles * panels - 1) / (tiles * panels);
    for (int64_t t = 0; t < tiles; ++t) {
      int64_t r0, mr;
      tile_span(R, tiles, t, &r0, &mr);
      const int64_t whole = (n1 - n0) / kPanel;  // the last panel may be narrower: it computes into `tail`
      float* out = y + r0 * N + n0;
      tile_panels(mr, xp + k0 * R + r0 * kc, kc, packed.data(), kc * kPanel, whole, out, N, k0 > 0, pf, lines_per_tile);
      if (whole < panels) {
        const int64_t n = n0 + whole * kPanel, cols = n1 - n;
        if (k0 > 0) {
          for (int64_t r = 0; r < mr; ++r) std::copy_n(y + (r0 + r) * N + n, cols, tail.data() + r * kPanel);
        }
        tile_rows<1>(mr, xp + k0 * R + r0 * kc, kc, packed.data() + whole * kc * kPanel, 0, tail.data(), kPanel, k0 > 0,
                     pf, lines_per_tile);
        for (int64_t r = 0; r < mr; ++r) std::copy_n(tail.data() + r * kPanel, cols, y + (r0 + r) * N + n);
      }
    }
  }
}

// Runs unit(i, q0, q1, next) over the work units of the tiled products y_i = x · W_i (W_i in panels of
// 16 columns, packed or stored so; ns[i] columns): runs of panels [q0, q1) of one y_i, up to 8 (a block
// of them at most kBlockBytes), at least four per thread where there are enough panels. The panels of all
// the y_i, one after another, are cut into a multiple of the threads' number of nearly equal runs (and
// where a run crosses from one y_i to the next), so that each thread's share of the units holds as many
// panels as the others' (units of a fixed size leave one thread with more: 18 panels in units of two give
// one thread ten and the other eight). `next` is the unit this thread most likely runs next, {j, v0, v1}
// (j = -1: none), for its first block to be prefetched.
struct NextUnit {
  int64_t j = -1, v0 = 0, v1 = 0;
};

template <typename Fn>
void for_panel_units(ffi::ThreadPool& pool, const std::vector<int64_t>& ns, int64_t K, const Fn& unit) {
  const size_t M = ns.size();
  std::vector<int64_t> first_panel(M + 1, 0);  // of y_i, in the panels of all
  for (size_t i = 0; i < M; ++i) first_panel[i + 1] = first_panel[i] + (ns[i] + kPanel - 1) / kPanel;
  const int64_t panels = first_panel[M];
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t fit = kBlockBytes / (kPanel * std::min(K, kKC) * static_cast<int64_t>(sizeof(float)));
  const int64_t widest = std::clamp<int64_t>(fit, 1, 8);
  const int64_t runs = std::min(panels, threads * std::max<int64_t>(4, (panels + threads * widest - 1) /
                                                                         (threads * widest)));
  // The caller's list, kept between calls (no allocation per product); the tasks reach it through `units`.
  thread_local std::vector<NextUnit> units_buffer;
  std::vector<NextUnit>& units = units_buffer;
  units.clear();
  for (int64_t r = 0; r < runs; ++r) {
    for (int64_t p = r * panels / runs, end = (r + 1) * panels / runs; p < end;) {
      const int64_t i = std::upper_bound(first_panel.begin(), first_panel.end(), p) - first_panel.begin() - 1;
      const int64_t stop = std::min(end, first_panel[i + 1]);
      units.push_back(NextUnit{i, p - first_panel[i], stop - first_panel[i]});
      p = stop;
    }
  }
  parallel_for_ranges(pool, static_cast<int64_t>(units.size()), [&](int64_t u, int64_t next_u) {
    const NextUnit& here = units[u];
    unit(static_cast<size_t>(here.j), here.v0, here.v1, next_u >= 0 ? units[next_u] : NextUnit{});
  });
}

// y_i = x · W_i for R >= kTiledMinRows, on panels packed a block at a time.
template <bool kTransposed, typename W>
void tiled_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws,
                  const std::vector<float*>& ys, const std::vector<int64_t>& ns, int64_t R, int64_t K) {
  auto columns = [&](size_t i, int64_t q) { return std::min(ns[i], q * kPanel); };
  std::vector<float> xp;
  pack_tiles(pool, x, R, K, std::min(K, kKC), (R + kMR - 1) / kMR, xp);
  for_panel_units(pool, ns, K, [&](size_t i, int64_t q0, int64_t q1, NextUnit n) {
    Prefetcher next;
    if (n.j >= 0) {
      const size_t j = static_cast<size_t>(n.j);
      next = block_of<kTransposed>(ws[j], K, ns[j], columns(j, n.v0), columns(j, n.v1), 0, std::min(K, kKC));
    }
    tiled_unit<kTransposed>(xp.data(), ws[i], ys[i], R, K, ns[i], columns(i, q0), columns(i, q1), next);
  });
}

// ---- nk, up to 32 rows: W's rows broadcast against x^T -------------------------------------------
//
// The tied LM head at batch 8–32 (a small model's [32000, 288]): packing W into panels costs 8 × 8
// transposes and a pass over W that waits on memory. Instead y^T[N, R] = W · x^T: a tile takes 6 rows of
// W as they lie (the broadcast side; they stream from memory, asked for two tiles ahead) against x^T,
// packed once per call into panels of 16 rows of x [kc, 16] (rows beyond R are zeros), and writes y^T
// into a per-unit buffer that goes to y a row of y at a time. Past kBroadcastMaxRows rows the packed
// panels are as fast or faster.

constexpr int64_t kBroadcastMaxRows = 32;

template <typename W>
void broadcast_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws,
                      const std::vector<float*>& ys, const std::vector<int64_t>& ns, int64_t R, int64_t K) {
  constexpr int64_t kTilesPerUnit = 8, kAhead = 2;
  const int64_t Rp = (R + kPanel - 1) / kPanel * kPanel, panels = Rp / kPanel, kc_max = std::min(K, kKC);
  const int64_t blocks = (K + kc_max - 1) / kc_max;
  thread_local std::vector<float> xt_buffer;  // the caller's; the tasks below read it through `xt`
  xt_buffer.assign(Rp * K, 0.f);
  float* const xt = xt_buffer.data();  // k-block at k0 * Rp: its panels [kc, 16], one after another
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, K - k0);
    for (int64_t r = 0; r < R; ++r) {
      float* p = xt + k0 * Rp + r / kPanel * kc * kPanel + r % kPanel;
      for (int64_t k = 0; k < kc; ++k) p[k * kPanel] = x[r * K + k0 + k];
    }
  }
  const size_t M = ws.size();
  std::vector<int64_t> tiles(M), first_unit(M + 1, 0);
  for (size_t i = 0; i < M; ++i) {
    tiles[i] = (ns[i] + kMR - 1) / kMR;
    first_unit[i + 1] = first_unit[i] + (tiles[i] + kTilesPerUnit - 1) / kTilesPerUnit;
  }
  parallel_for_ranges(pool, first_unit[M], [&](int64_t unit, int64_t next_unit) {
    const size_t i = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
    const W* w = ws[i];
    const int64_t N = ns[i], t0 = (unit - first_unit[i]) * kTilesPerUnit, t1 = std::min(tiles[i], t0 + kTilesPerUnit);
    // the next unit's first tile, when it is the same matrix's
    const bool next_here = next_unit >= 0 && next_unit < first_unit[i + 1];
    const int64_t t_next = next_here ? (next_unit - first_unit[i]) * kTilesPerUnit : tiles[i];
    thread_local std::vector<float> yt, wide, wp;
    yt.resize(kTilesPerUnit * kMR * Rp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kMR, mr = std::min<int64_t>(kMR, N - n0);
      const int64_t ahead = t + kAhead < t1 ? t + kAhead : t_next + (t + kAhead - t1);
      Prefetcher pf;
      if (ahead < tiles[i]) {
        const int64_t m0 = ahead * kMR;
        pf.p = reinterpret_cast<const char*>(w + m0 * K);
        pf.run = pf.stride = std::min<int64_t>(kMR, N - m0) * K * static_cast<int64_t>(sizeof(W));
        pf.left = (pf.run + 63) / 64;
      }
      const int64_t lines = (pf.left + panels * blocks - 1) / (panels * blocks);
      int64_t ld;
      const float* wr = as_f32_rows(w + n0 * K, K, mr, K, wide, &ld);
      float* out = yt.data() + (n0 - t0 * kMR) * Rp;
      for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, K - k0);
        wp.resize(mr * kc);
        pack_rows(wr + k0, ld, mr, kc, wp.data());
        tile_panels(mr, wp.data(), kc, xt + k0 * Rp, kc * kPanel, panels, out, Rp, k0 > 0, pf, lines);
      }
    }
    const int64_t n_begin = t0 * kMR, n_end = std::min(N, t1 * kMR);
    for (int64_t r = 0; r < R; ++r) {
      float* yr = ys[i] + r * N;
      for (int64_t n = n_begin; n < n_end; ++n) yr[n] = yt[(n - n_begin) * Rp + r];
    }
  });
}

// ---- panels: W stored as [N / 16, K, 16] -------------------------------------------------------
//
// The layout the products above pack W into, kept in memory (llm_jax/backends/cpu/forms.py stores the
// layers' projections so for the CPU kernels): panel q holds columns 16q ... 16q + 15 of W [K, N], row after
// row, one contiguous run of K · 16 values. Many rows then run the register tiles on W as it lies, with
// no packing (which took a third of a batch-32 layer's time on one core: copying and waiting for
// memory); one row streams a few panels at a time, each a long contiguous run, with the 16 sums of a
// panel in registers instead of a tile of y loaded and stored every few rows of W.

// y[0, 0:16] of each of G panels = x[0, 0:kc] · the panel's first kc rows; panels `ps` values apart, their
// outputs `ys` values apart.
//
// Where prefetcht1 fills L2 and not L1 (kPrefetchT1FillsL2) each panel's stream is also asked for
// kGemvAheadBytes ahead, into L2: the hardware's prefetchers stop at each 4 KiB page, and asking across
// it keeps the stream near memory speed (into every level of cache, the requests crowd L1 and it slows).
// Past a matrix's end the stream asks for up to kGemvAheadBytes it never reads: a prefetch cannot fault.
constexpr int64_t kGemvAheadBytes = kPrefetchT1FillsL2 ? 1024 : 0;

template <int G, typename W>
void panel_gemv(const float* x, const W* p, int64_t ps, int64_t kc, float* y, int64_t ys) {
  constexpr int V = kPanel / kLanes;
  constexpr int64_t kPerLine = std::max<int64_t>(1, 64 / (kPanel * sizeof(W)));  // rows of k a line holds
  fvec acc[G][V] = {};
  for (int64_t k = 0; k < kc; ++k) {
    const float xk = x[k];
    if (kGemvAheadBytes > 0 && k % kPerLine == 0) {  // the address as an integer: it may lie past W
      for (int g = 0; g < G; ++g) {
        __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p + g * ps + k * kPanel) +
                                                         kGemvAheadBytes),
                           0, 2);
      }
    }
    for (int g = 0; g < G; ++g) {
      const W* row = p + g * ps + k * kPanel;
      for (int c = 0; c < V; ++c) acc[g][c] += xk * loadv(row + c * kLanes);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < V; ++c) storev(y + g * ys + c * kLanes, acc[g][c]);
  }
}

template <typename W>
void panel_gemv_n(int64_t n, const float* x, const W* p, int64_t ps, int64_t kc, float* y, int64_t ys) {
  switch (n) {
    case 4: return panel_gemv<4>(x, p, ps, kc, y, ys);
    case 3: return panel_gemv<3>(x, p, ps, kc, y, ys);
    case 2: return panel_gemv<2>(x, p, ps, kc, y, ys);
    default: return panel_gemv<1>(x, p, ps, kc, y, ys);
  }
}

// One row against panels of up to kLongStreamPanelBytes (decode at batch 1), when every thread has panels
// enough: each thread's share of a matrix is cut into quarters, and unit r takes panel r of each quarter,
// so that the four streams a unit reads at once run on into the next unit's panels, where units of four
// adjacent panels start four new streams every four panels, each only as long as a panel: long streams
// keep the read nearer memory speed. Longer panels are long streams as they are, and read no faster
// this way.
constexpr int64_t kLongStreamPanelBytes = 48 * 1024;

struct GemvUnit {
  int64_t matrix, first, stride, count;  // panels first + j · stride for j < count
};

template <typename W>
void panel_gemv_streams(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws,
                        const std::vector<float*>& ys, const std::vector<int64_t>& ns, int64_t K, int64_t workers) {
  thread_local std::vector<GemvUnit> units_buffer;  // the caller's; the tasks reach it through `units`
  std::vector<GemvUnit>& units = units_buffer;
  units.clear();
  for (size_t i = 0; i < ws.size(); ++i) {
    const int64_t panels = ns[i] / kPanel;
    for (int64_t w = 0; w < workers; ++w) {
      const int64_t a = w * panels / workers, n = (w + 1) * panels / workers - a, per = (n + 3) / 4;
      for (int64_t r = 0; r < per; ++r) {
        int64_t count = 0;
        while (count < 4 && count * per + r < n) ++count;
        units.push_back(GemvUnit{static_cast<int64_t>(i), a + r, per, count});
      }
    }
  }
  parallel_for_ranges(pool, static_cast<int64_t>(units.size()), [&](int64_t u, int64_t) {
    const GemvUnit& unit = units[u];
    panel_gemv_n(unit.count, x, ws[unit.matrix] + unit.first * K * kPanel, unit.stride * K * kPanel, K,
                 ys[unit.matrix] + unit.first * kPanel, unit.stride * kPanel);
  });
}

// The lines of panels [q0, q1) (K · 16 values apart) that rows [k0, k1) of K read.
template <typename W>
Prefetcher panel_block(const W* w, int64_t K, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  const int64_t size = sizeof(W);
  Prefetcher pf;
  pf.p = reinterpret_cast<const char*>(w + (q0 * K + k0) * kPanel);
  pf.stride = K * kPanel * size;
  pf.run = (k1 - k0) * kPanel * size;
  pf.left = (q1 - q0) * ((pf.run + 63) / 64);
  return pf;
}

// Fewer than kTiledMinRows rows: one row on short panels as long streams (above); else units of
// kGemvPanels adjacent panels (and, when there are fewer units than twice the threads, slices of K summed
// at the end).
constexpr int64_t kGemvPanels = 4;

// The slices of K panel_rows cuts its products into, for `groups` units of panels on `threads` threads (a
// row's sums are the slices' sums added in order: panel_row_product computes them so too).
inline int64_t gemv_slices(int64_t groups, int64_t K, int64_t threads) {
  threads = std::max<int64_t>(threads, 1);
  return std::min<int64_t>(K, std::max<int64_t>(1, (2 * threads + groups - 1) / groups));
}

// Panels per tile for a tile of `mr` rows below kTiledMinRows: a tile's sums are that many chains of
// dependent multiply-adds, and with fewer chains than the core's multiply-add latency times its
// throughput (5 × 2 on Zen 2) the core waits on each (two rows on one panel of two 8-wide vectors: four
// chains, 40% of the peak). More panels per tile make more chains and more streams from memory at once,
// as far as the sums and one row of each panel's vectors fit in the registers (16 with AVX2, 32 with
// AVX-512, one kept for the broadcast of x), up to a unit's four. With AVX2, float32 panels take all 16:
// the multiply-adds read the broadcast from memory, and three rows run on two panels instead of one (35
// against 29 GB/s on Zen 2, 768 × 4096); bfloat16 widens each panel row into registers first.
template <typename W>
int64_t few_rows_panels(int64_t mr) {
  constexpr int64_t V = kPanel / kLanes, registers = kLanes == 16 ? 31 : sizeof(W) == 4 ? 16 : 15;
  return std::clamp<int64_t>(registers / (V * (mr + 1)), 1, kGemvPanels);
}

// How far ahead of its reads a float32 few-rows tile asks for each of its panels' streams, a line at a
// time and past the caches (prefetchnta), where the weights come from memory at every call: the hardware's
// prefetchers stop at each 4 KiB page, and a tile that does a few rows' multiply-adds per line leaves the
// core waiting at each page without it. Measured on Zen 2 (110M's products, weights from memory, both
// cores): 2 rows 26 → 37 GB/s, 3 rows 25 → 34 (two panels a tile, above), 5 rows 24 → 28, 7 rows
// 18.5 → 19.5, against asking for the unit's next panels spread over the tile's steps; 256 B and 1 KiB
// ahead, or into the caches, did no better. With weights that stay in the caches the same tiles run a
// third slower at 5 rows (what they read is not kept), so only calls whose stacks (every layer of the
// call's matrices) are larger than most last-level caches take them: kStreamedBytes, which 110M's
// q/k/v, gate/up and down stacks pass and 15M's do not (a CPU whose cache holds a model that passes loses
// that reuse). bfloat16 does not take them: its tiles spill sums with the requests, and ran no faster
// where they did not.
template <typename W>
constexpr int64_t kFewRowsAhead = sizeof(W) == 4 ? 512 : 0;
constexpr int64_t kStreamedBytes = int64_t{32} << 20;

// fn(std::integral_constant<int, n>{}) for n = 1 ... kGemvPanels panels known only at run time.
template <typename Fn>
void with_panels(int64_t n, const Fn& fn) {
  switch (n) {
    case 4: return fn(std::integral_constant<int, 4>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    default: return fn(std::integral_constant<int, 1>{});
  }
}

template <typename W>
void panel_rows(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws, const std::vector<float*>& ys,
                const std::vector<int64_t>& ns, int64_t R, int64_t K, bool streamed) {
  const size_t M = ws.size();
  std::vector<int64_t> first_unit(M + 1, 0);
  for (size_t i = 0; i < M; ++i) first_unit[i + 1] = first_unit[i] + (ns[i] / kPanel + kGemvPanels - 1) / kGemvPanels;
  const int64_t groups = first_unit[M], threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t slices = gemv_slices(groups, K, threads);
  const int64_t slice = (K + slices - 1) / slices;
  if (R == 1 && slices == 1 && K * kPanel * static_cast<int64_t>(sizeof(W)) <= kLongStreamPanelBytes) {
    return panel_gemv_streams(pool, x, ws, ys, ns, K, threads);
  }
  std::vector<std::vector<float>> partial(M);
  for (size_t i = 0; i < M; ++i) partial[i].assign(static_cast<size_t>((slices - 1) * R * ns[i]), 0.f);
  parallel_for(pool, groups * slices, [&](int64_t unit) {
    const int64_t g = unit % groups, s = unit / groups;
    const size_t i = std::upper_bound(first_unit.begin(), first_unit.end(), g) - first_unit.begin() - 1;
    const int64_t N = ns[i], q0 = (g - first_unit[i]) * kGemvPanels, q1 = std::min(N / kPanel, q0 + kGemvPanels);
    const int64_t k0 = s * slice, kc = std::min(K, k0 + slice) - k0;
    float* out = s == 0 ? ys[i] : partial[i].data() + (s - 1) * R * N;
    const W* p = ws[i] + k0 * kPanel;
    if (kc <= 0) {
      for (int64_t r = 0; r < R; ++r) std::fill(out + r * N + q0 * kPanel, out + r * N + q1 * kPanel, 0.f);
    } else if (R == 1) {
      int64_t q = q0;
      for (; q + 4 <= q1; q += 4) panel_gemv<4>(x + k0, p + q * K * kPanel, K * kPanel, kc, out + q * kPanel, kPanel);
      for (; q < q1; ++q) panel_gemv<1>(x + k0, p + q * K * kPanel, K * kPanel, kc, out + q * kPanel, kPanel);
    } else {
      // A few panels at a time, read once for every tile of rows, while the next ones are asked for (on the
      // hardware's prefetchers alone each panel's stream stalls at every 4 KiB page), or with weights that
      // stream from memory each tile asking for its own panels ahead (kFewRowsAhead).
      thread_local std::vector<float> xp;
      xp.resize(R * kc);
      for (int64_t r0 = 0; r0 < R; r0 += kMR) {
        pack_rows(x + r0 * K + k0, K, std::min<int64_t>(kMR, R - r0), kc, xp.data() + r0 * kc);
      }
      const int64_t np = few_rows_panels<W>(std::min<int64_t>(kMR, R));
      const bool ahead = streamed && kFewRowsAhead<W> > 0;
      for (int64_t q = q0; q < q1;) {
        const int64_t n = std::min(np, q1 - q);
        Prefetcher next = !ahead && q + n < q1 ? panel_block(ws[i], K, q + n, std::min(q1, q + 2 * n), k0, k0 + kc)
                                               : Prefetcher{};
        const int64_t lines = next.left;
        for (int64_t r0 = 0; r0 < R; r0 += kMR) {
          with_panels(n, [&](auto NP) {
            const int64_t mr = std::min<int64_t>(kMR, R - r0);
            const float* xr = xp.data() + r0 * kc;
            const W* pq = p + q * K * kPanel;
            float* y = out + r0 * N + q * kPanel;
            if (ahead) {
              tile_rows<NP, W, kFewRowsAhead<W>>(mr, xr, kc, pq, K * kPanel, y, N, false, next, lines);
            } else {
              tile_rows<NP>(mr, xr, kc, pq, K * kPanel, y, N, false, next, lines);
            }
          });
        }
        q += n;
      }
    }
  });
  for (size_t i = 0; i < M; ++i) {
    for (int64_t s = 1; s < slices; ++s) {
      const float* part = partial[i].data() + (s - 1) * R * ns[i];
      for (int64_t j = 0; j < R * ns[i]; ++j) ys[i][j] += part[j];
    }
  }
}

// Outputs of few rows and many columns — the LM head's logits at batch 16 to 32, megabytes — are written
// past the caches (non-temporal stores, 64-byte aligned, AVX-512): sampling reads them once, and written
// through the caches every line is first read from memory while the weights stream in. Not from
// kStreamMaxRows rows on, nor for the large outputs of prefill, which the next op reads at once (from the
// caches, where they were written).
constexpr int64_t kStreamMaxRows = 32;
constexpr int64_t kStreamMinBytes = 2 << 20;

// Which y_i [R, N_i] are written past the caches: few rows, many columns, every row 64-byte aligned, and
// AVX-512's stores (where there are none, every y_i is written through the caches).
inline std::vector<char> streamed(const std::vector<float*>& ys, const std::vector<int64_t>& ns, int64_t R) {
  std::vector<char> stream(ys.size());
  for (size_t i = 0; i < ys.size(); ++i) {
    stream[i] = kLanes == 16 && R <= kStreamMaxRows && R * ns[i] * static_cast<int64_t>(sizeof(float)) >= kStreamMinBytes &&
                ns[i] % kPanel == 0 && reinterpret_cast<uintptr_t>(ys[i]) % 64 == 0;
  }
  return stream;
}

// kTiledMinRows rows or more: tiled_unit's blocks and tiles, on the panels as they lie.
template <typename W>
void panel_tiled(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws, const std::vector<float*>& ys,
                 const std::vector<int64_t>& ns, int64_t R, int64_t K) {
  const int64_t kc_max = std::min(K, kKC), tiles = (R + kPanelMR - 1) / kPanelMR;
  // x packed: for decode's few rows the caller's buffer, kept between calls (no allocation and zeroing
  // per product, a noticeable share of a short one), for prefill's many a buffer of this call's own (one
  // kept per thread would hold the largest prompt's forever). The tasks reach it through `xp`.
  constexpr int64_t kKeptPackValues = 1 << 18;
  thread_local std::vector<float> kept;
  std::vector<float> own;
  std::vector<float>& xp = R * K <= kKeptPackValues ? kept : own;
  pack_tiles(pool, x, R, K, kc_max, tiles, xp);
  const std::vector<char> stream = streamed(ys, ns, R);
  for_panel_units(pool, ns, K, [&](size_t i, int64_t q0, int64_t q1, NextUnit n) {
    const Prefetcher next = n.j >= 0 ? panel_block(ws[n.j], K, n.v0, n.v1, 0, kc_max) : Prefetcher{};
    const W* w = ws[i];
    const int64_t N = ns[i];
    for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
      const int64_t kc = std::min(kc_max, K - k0);
      Prefetcher pf = k0 + kc < K ? panel_block(w, K, q0, q1, k0 + kc, std::min(K, k0 + kc + kc_max)) : next;
      const int64_t lines = (pf.left + tiles * (q1 - q0) - 1) / (tiles * (q1 - q0));
      for (int64_t t = 0; t < tiles; ++t) {
        int64_t r0, mr;
        tile_span(R, tiles, t, &r0, &mr);
        tile_panels(mr, xp.data() + k0 * R + r0 * kc, kc, w + (q0 * K + k0) * kPanel, K * kPanel, q1 - q0,
                    ys[i] + r0 * N + q0 * kPanel, N, k0 > 0, pf, lines, stream[i] && k0 + kc >= K);
      }
    }
    if (stream[i]) _mm_sfence();
  });
}

// ---- bfloat16 in pairs of rows -----------------------------------------------------------------
//
// The CPU's bfloat16 products (AMX's tiles, AVX-512's vdpbf16ps) multiply pairs of adjacent k at once:
// each 32-bit lane holds two bfloat16 values, x[2k], x[2k + 1] on one side and W[2k, j], W[2k + 1, j] on
// the other, and adds both products to a float32 sum. A panel is rearranged for them, per unit of work,
// into pairs of its rows.

#if defined(__AVX2__)
// dst[k / 2, j, k % 2] = p[k, j] for rows [0, K) of a panel [.., 16] of bfloat16; an odd K's last pair
// is completed with zeros.
inline void to_pairs(const uint16_t* p, int64_t K, uint16_t* dst) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 2) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * kPanel));
    const __m256i b = k + 1 < K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (k + 1) * kPanel)) : zero;
    const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);  // within 128-bit halves
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k * kPanel), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k * kPanel + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}
#endif

// x[r, k] rounded to bfloat16, as its bits.
inline uint16_t bf16_bits(float v) {
  v = round_to_bf16(v);
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// ---- AMX: bfloat16 panels on the tile unit -------------------------------------------------------
//
// Where the CPU has AMX (Intel Xeon since Sapphire Rapids) and Linux grants its tile state, bfloat16
// products with many rows run on it: one instruction multiplies a tile of 16 rows × 32 values of x by
// 32 × 16 of W, adding into 16 × 16 float32 sums. x is already rounded to bfloat16 (as for every
// bfloat16 product here), so each product of two bfloat16 values is exact in float32 and only the sums
// differ from the multiply-adds above: AMX adds each pair of k in the other order and flushes subnormal
// numbers to zero (float32 sums agree within their rounding). W's panels are rearranged, per unit of
// work, into the pairs of rows the tile unit reads (rows 2k and 2k + 1 of a panel interleaved); x is
// copied once per call as bfloat16 (by all threads when large), padded with zero rows to a multiple of
// 32. Tiles: 0–3 the sums of 2 × 2 blocks of 16 × 16, 4 and 5 two blocks of 16 rows of x, 6 and 7 two
// panels. A call's `amx` option off, these products run on the dot products or the float32 tiles.

#if LLM_JAX_HAS_AMX
constexpr int64_t kAmxRows = 32;  // rows of y per block: two tiles

// Whether this process can use the tile unit: Linux grants its state on request, once per process.
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows × 64 bytes, for this thread (the configuration is per thread).
inline void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// c[0:32, 0:16 (32 with b1)] = xb[0:32, 0:K] · panels b0 (and b1) in pairs; rows of c ldc apart. Asks
// `pf` for `per_step` lines each step of 32 values of K.
inline void amx_block(const uint16_t* xb, int64_t K, const uint16_t* b0, const uint16_t* b1, float* c, int64_t ldc,
                      Prefetcher& pf, int64_t per_step) {
  const int64_t ldx = K * static_cast<int64_t>(sizeof(uint16_t)), ld = ldc * static_cast<int64_t>(sizeof(float));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    pf.some(per_step);
    _tile_loadd(4, xb + k, ldx);
    _tile_loadd(5, xb + 16 * K + k, ldx);
    _tile_loadd(6, b0 + k * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (b1 != nullptr) {
      _tile_loadd(7, b1 + k * kPanel, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ld);
  _tile_stored(2, c + 16 * ldc, ld);
  if (b1 != nullptr) {
    _tile_stored(1, c + 16, ld);
    _tile_stored(3, c + 16 * ldc + 16, ld);
  }
}

// out[0:32, 0:cols] = edge[0:32, 0:cols] (rows 2 kPanel apart) written past the caches, cols a multiple
// of kPanel, out's rows ldo apart and 64-byte aligned (AVX-512: amx_matmul streams only there).
inline void stream_rows(const float* edge, int64_t cols, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  for (int64_t r = 0; r < kAmxRows; ++r) {
    for (int64_t c = 0; c < cols; c += kPanel) _mm512_stream_ps(out + r * ldo + c, _mm512_load_ps(edge + r * 2 * kPanel + c));
  }
#endif
}

// Whether the tile unit takes this product: the call allows it, bfloat16 weights, kAmxRows rows or more,
// K a multiple of 32, and Linux grants the tile state.
template <typename W>
bool amx_takes(int64_t R, int64_t K, const PanelOptions& options) {
  return options.amx && sizeof(W) == 2 && R >= kAmxRows && K % 32 == 0 && amx_ready();
}

// y_i = x · W_i on the tile unit (amx_takes), W_i bfloat16 panels; `paired`: panels already in pairs of
// rows (to_pairs's layout: the LM head's screen, llm_jax/backends/cpu/greedy_head.py), read as they lie,
// which saves rearranging them per unit. Each unit asks for the next one's panels a few lines per step
// of its tiles, so reading W overlaps the arithmetic, and large outputs of 32 rows (the logits of a
// batch of 32) are written past the caches: without either the tile unit waits on memory.
template <typename W>
void amx_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws, const std::vector<float*>& ys,
                const std::vector<int64_t>& ns, int64_t R, int64_t K, bool paired = false) {
  const int64_t Rp = (R + kAmxRows - 1) / kAmxRows * kAmxRows;
  thread_local std::vector<uint16_t> xb_buffer;  // the caller's, kept between calls; tasks reach it by `xb`
  std::vector<uint16_t>& xb = xb_buffer;
  xb.assign(static_cast<size_t>(Rp * K), 0);
  uint16_t* const bits16 = xb.data();
  auto convert = [&](int64_t block) {  // rows [32 block, 32 block + 32) of x
    for (int64_t e = block * kAmxRows * K; e < std::min(R, (block + 1) * kAmxRows) * K; ++e) bits16[e] = bf16_bits(x[e]);
  };
  if (R * K >= kParallelPackValues) {
    parallel_for(pool, Rp / kAmxRows, convert);
  } else {
    for (int64_t block = 0; block < Rp / kAmxRows; ++block) convert(block);
  }
  const std::vector<char> stream = streamed(ys, ns, R);
  for_panel_units(pool, ns, K, [&](size_t i, int64_t q0, int64_t q1, NextUnit n) {
    Prefetcher pf = n.j >= 0 ? panel_block(ws[n.j], K, n.v0, n.v1, 0, K) : Prefetcher{};
    const int64_t N = ns[i], panels = q1 - q0;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(ws[i]) + q0 * K * kPanel;
    if (!paired) {
      thread_local std::vector<uint16_t> pairs;
      pairs.resize(static_cast<size_t>(panels * K * kPanel));
      for (int64_t q = 0; q < panels; ++q) to_pairs(w + q * K * kPanel, K, pairs.data() + q * K * kPanel);
      w = pairs.data();
    }
    const int64_t steps = (Rp / kAmxRows) * ((panels + 1) / 2) * (K / 32);
    const int64_t per_step = (pf.left + steps - 1) / steps;
    alignas(64) float edge[kAmxRows * 2 * kPanel];  // a block's sums, for the last block (rows beyond R) or to stream
    amx_configure();
    for (int64_t r0 = 0; r0 < Rp; r0 += kAmxRows) {
      const bool whole = r0 + kAmxRows <= R;
      for (int64_t q = 0; q < panels; q += 2) {
        const uint16_t* b0 = w + q * K * kPanel;
        const uint16_t* b1 = q + 1 < panels ? b0 + K * kPanel : nullptr;
        float* out = ys[i] + r0 * N + (q0 + q) * kPanel;
        if (whole && stream[i]) {
          amx_block(xb.data() + r0 * K, K, b0, b1, edge, 2 * kPanel, pf, per_step);
          stream_rows(edge, b1 != nullptr ? 2 * kPanel : kPanel, out, N);
        } else if (whole) {
          amx_block(xb.data() + r0 * K, K, b0, b1, out, N, pf, per_step);
        } else {
          amx_block(xb.data() + r0 * K, K, b0, b1, edge, 2 * kPanel, pf, per_step);
          const int64_t cols = b1 != nullptr ? 2 * kPanel : kPanel;
          for (int64_t r = 0; r < R - r0; ++r) std::copy_n(edge + r * 2 * kPanel, cols, out + r * N);
        }
      }
    }
    _tile_release();
    if (stream[i]) _mm_sfence();
  });
}

// y[0:16] = the row x [K] (K a multiple of 32) · panel p [K, 16] on the tile unit, each sum as amx_matmul
// computes it: x is row 0 of a block of 32 rows whose others are zeros (a row's sums depend on its own
// values only), the panel rearranged into pairs of rows, the block's sums from zero over all of K.
void amx_row(const float* x, const uint16_t* p, int64_t K, float* y) {
  thread_local std::vector<uint16_t> xb, pairs;
  if (xb.size() != static_cast<size_t>(kAmxRows * K)) xb.assign(static_cast<size_t>(kAmxRows * K), 0);
  for (int64_t k = 0; k < K; ++k) xb[k] = bf16_bits(x[k]);
  pairs.resize(static_cast<size_t>(K * kPanel));
  to_pairs(p, K, pairs.data());
  alignas(64) float sums[kAmxRows * kPanel];
  Prefetcher none;
  amx_configure();
  amx_block(xb.data(), K, pairs.data(), nullptr, sums, kPanel, none, 0);
  _tile_release();
  std::copy_n(sums, kPanel, y);
}
#else
template <typename W>
bool amx_takes(int64_t, int64_t, const PanelOptions&) {
  return false;
}

void amx_row(const float*, const uint16_t*, int64_t, float*) {}

template <typename W>
void amx_matmul(ffi::ThreadPool&, const float*, const std::vector<const W*>&, const std::vector<float*>&,
                const std::vector<int64_t>&, int64_t, int64_t, bool = false) {}
#endif

// ---- AVX-512 bfloat16 dot products ----------------------------------------------------------------
//
// Where the CPU has AVX512_BF16 and AMX does not take the product (AMD's AVX-512 cores; Intel from Cooper
// Lake), bfloat16 products of many rows run the register tiles of "many rows" on vdpbf16ps: one
// instruction multiplies 16 pairs of bfloat16 values of W by a broadcast pair of x and adds both products
// to 16 float32 sums — twice the multiply-adds of a float32 vector instruction. x is already rounded to
// bfloat16 (as for every bfloat16 product here), so each product is exact in float32 and only the sums
// differ from the float32 tiles': the instruction adds the odd k's product first, then the even's, each
// rounded, and flushes subnormal numbers to zero (its results match that order bit for bit). x is packed
// once per call as pairs of bfloat16 (k-pair-major per tile of rows, as pack_rows lays floats out); W's
// panels are rearranged into pairs a block of kKC rows at a time per unit of work. A call's `bf16_dot`
// option off, the float32 tiles run instead.

#if defined(__AVX512F__)
// One register tile of y on the CPU's dot products, which add S adjacent products of k (a "step") into
// each 32-bit lane: y[0:MR, 0:16 NP] (+= when `add`) = x's steps [0:steps] · NP panels of steps
// [steps, 16, S] (ps values apart); xq[q · MR + r] holds row r's step q (S values of x in 32 bits).
// `Dot` names the instruction: bfloat16 pairs on vdpbf16ps (float32 sums), int8 quads on vpdpbusd
// (int32 sums). Not inlined into its callers (with_rows).
template <typename Dot, int MR, int NP>
__attribute__((noinline)) void dot_tile(const uint32_t* xq, int64_t steps, const typename Dot::Weight* p, int64_t ps,
                                        typename Dot::Sum* y, int64_t ldy, bool add, Prefetcher& pf, int64_t lines) {
  typename Dot::Acc acc[MR][NP];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NP; ++j) acc[r][j] = add ? Dot::load(y + r * ldy + j * kPanel) : Dot::zero();
  }
  PrefetchOverK ahead(pf, lines, steps);
  for (int64_t q = 0; q < steps; ++q) {
    ahead.at(q);
    typename Dot::W w[NP];
    for (int j = 0; j < NP; ++j) w[j] = Dot::weights(p + j * ps + q * Dot::kStep * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(xq[q * MR + r]));
      for (int j = 0; j < NP; ++j) acc[r][j] = Dot::dot(acc[r][j], w[j], a);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NP; ++j) Dot::store(y + r * ldy + j * kPanel, acc[r][j]);
  }
}

template <typename Dot, int NP>
void dot_tile_rows(int64_t mr, const uint32_t* xq, int64_t steps, const typename Dot::Weight* p, int64_t ps,
                   typename Dot::Sum* y, int64_t ldy, bool add, Prefetcher& pf, int64_t lines) {
  with_rows<Dot::kRows>(mr, [&](auto MR) { dot_tile<Dot, MR, NP>(xq, steps, p, ps, y, ldy, add, pf, lines); });
}
#endif

#if defined(__AVX512BF16__)
// Whether the build has the bfloat16 dot products (built for the host CPU: whether it has them).
bool bf16_dot_ready() { return true; }

// Pairs of bfloat16 values: 16 lanes of two products each, float32 sums; tiles of up to kMR rows.
struct Bf16Pairs {
  using Weight = uint16_t;
  using Sum = float;
  using Acc = __m512;
  using W = __m512bh;
  static constexpr int64_t kStep = 2;
  static constexpr int kRows = kMR;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc load(const float* y) { return _mm512_loadu_ps(y); }
  static void store(float* y, Acc a) { _mm512_storeu_ps(y, a); }
  static W weights(const uint16_t* p) { return (W)_mm512_loadu_si512(p); }
  static Acc dot(Acc acc, W w, __m512i a) { return _mm512_dpbf16_ps(acc, (__m512bh)a, w); }
};

// Whether the dot products take this product: the call allows them, bfloat16 panels, kTiledMinRows rows
// or more.
template <typename W>
bool bf16_dot_takes(int64_t R, const PanelOptions& options) {
  return options.bf16_dot && sizeof(W) == 2 && R >= kTiledMinRows;
}

// y_i = x · W_i on vdpbf16ps (bf16_dot_takes), W_i bfloat16 panels; `paired`: panels already in pairs of
// rows (to_pairs's layout, K even: the LM head's screen, llm_jax/backends/cpu/greedy_head.py), read as they
// lie. Each unit asks for the next one's panels (or its own next block's) a few lines per tile, so reading
// W overlaps the arithmetic; without, to_pairs (or, in pairs, the tiles) wait on memory for every unit in
// turn.
template <typename W>
void bf16_dot_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws,
                     const std::vector<float*>& ys, const std::vector<int64_t>& ns, int64_t R, int64_t K,
                     bool paired = false) {
  const int64_t kc_max = std::min(K, kKC), tiles = (R + kMR - 1) / kMR, blocks = (K + kc_max - 1) / kc_max;
  // Block b (rows [b kc_max, ...) of K) of tile t (rows [r0, r0 + mr) of x): mr · pairs values from
  // (b kc_max / 2) R + r0 · pairs on.
  const int64_t pairs_max = (kc_max + 1) / 2;
  // The caller's buffer, kept between calls (no allocation per product); the tasks reach it through `xq`.
  thread_local std::vector<uint32_t> xq_buffer;
  std::vector<uint32_t>& xq = xq_buffer;
  xq.resize(static_cast<size_t>(blocks * pairs_max * R));
  auto pack = [&](int64_t unit) {
    const int64_t k0 = unit / tiles * kc_max, kc = std::min(kc_max, K - k0), pairs = (kc + 1) / 2;
    int64_t r0, mr;
    tile_span(R, tiles, unit % tiles, &r0, &mr);
    uint32_t* out = xq.data() + unit / tiles * pairs_max * R + r0 * pairs;
    for (int64_t q = 0; q < pairs; ++q) {
      for (int64_t r = 0; r < mr; ++r) {
        const float* xr = x + (r0 + r) * K + k0 + 2 * q;
        const uint32_t hi = 2 * q + 1 < kc ? bf16_bits(xr[1]) : 0;
        out[q * mr + r] = bf16_bits(xr[0]) | hi << 16;
      }
    }
  };
  if (R * K >= kParallelPackValues) {
    parallel_for(pool, blocks * tiles, pack);
  } else {
    for (int64_t unit = 0; unit < blocks * tiles; ++unit) pack(unit);
  }
  for_panel_units(pool, ns, K, [&](size_t i, int64_t q0, int64_t q1, NextUnit n) {
    const Prefetcher next = n.j >= 0 ? panel_block(ws[n.j], K, n.v0, n.v1, 0, kc_max) : Prefetcher{};
    const int64_t N = ns[i], panels = q1 - q0, calls = tiles * ((panels + 1) / 2);
    const uint16_t* w = reinterpret_cast<const uint16_t*>(ws[i]);
    thread_local std::vector<uint16_t> paired_buffer;
    if (!paired) paired_buffer.resize(static_cast<size_t>(panels * pairs_max * 2 * kPanel));
    float* const y = ys[i] + q0 * kPanel;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = b * kc_max, kc = std::min(kc_max, K - k0), pairs = (kc + 1) / 2;
      const uint16_t* p = w + (q0 * K + k0) * kPanel;  // the unit's first panel, block b
      int64_t ps = K * kPanel;                          // values from one panel to the next
      if (!paired) {
        ps = pairs * 2 * kPanel;
        for (int64_t q = 0; q < panels; ++q) to_pairs(w + ((q0 + q) * K + k0) * kPanel, kc, paired_buffer.data() + q * ps);
        p = paired_buffer.data();
      }
      Prefetcher pf = k0 + kc < K ? panel_block(w, K, q0, q1, k0 + kc, std::min(K, k0 + kc + kc_max)) : next;
      const int64_t lines = (pf.left + calls - 1) / calls;
      for (int64_t t = 0; t < tiles; ++t) {
        int64_t r0, mr;
        tile_span(R, tiles, t, &r0, &mr);
        const uint32_t* xt = xq.data() + b * pairs_max * R + r0 * pairs;
        float* out = y + r0 * N;
        int64_t q = 0;
        for (; q + 2 <= panels; q += 2) {
          dot_tile_rows<Bf16Pairs, 2>(mr, xt, pairs, p + q * ps, ps, out + q * kPanel, N, b > 0, pf, lines);
        }
        if (q < panels) dot_tile_rows<Bf16Pairs, 1>(mr, xt, pairs, p + q * ps, ps, out + q * kPanel, N, b > 0, pf, lines);
      }
    }
  });
}

// y[0:16] = the row x [K] · panel p [K, 16] on vdpbf16ps, each sum as bf16_dot_matmul computes it: x and the
// panel in pairs of k (an odd K's last pair completed with zeros), a tile of one row and one panel, block
// after block of kKC rows of K, each block's sums going on from the last's.
void bf16_dot_row(const float* x, const uint16_t* p, int64_t K, float* y) {
  const int64_t kc_max = std::min(K, kKC), pairs = (K + 1) / 2;
  thread_local std::vector<uint32_t> xq;
  thread_local std::vector<uint16_t> wq;
  xq.resize(static_cast<size_t>(pairs));
  wq.resize(static_cast<size_t>(pairs * 2 * kPanel));
  for (int64_t q = 0; q < pairs; ++q) {
    const uint32_t hi = 2 * q + 1 < K ? bf16_bits(x[2 * q + 1]) : 0;
    xq[q] = bf16_bits(x[2 * q]) | hi << 16;
  }
  to_pairs(p, K, wq.data());
  Prefetcher none;
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {  // kc_max is even (or K itself): blocks hold whole pairs
    const int64_t steps = (std::min(kc_max, K - k0) + 1) / 2;
    dot_tile<Bf16Pairs, 1, 1>(xq.data() + k0 / 2, steps, wq.data() + k0 * kPanel, 0, y, kPanel, k0 > 0, none, 0);
  }
}
#else
bool bf16_dot_ready() { return false; }

template <typename W>
bool bf16_dot_takes(int64_t, const PanelOptions&) {
  return false;
}

void bf16_dot_row(const float*, const uint16_t*, int64_t, float*) {}

template <typename W>
void bf16_dot_matmul(ffi::ThreadPool&, const float*, const std::vector<const W*>&, const std::vector<float*>&,
                     const std::vector<int64_t>&, int64_t, int64_t, bool = false) {}
#endif

// ---- int8 in quads of rows: the LM head's screen on AVX-512 VNNI ------------------------------------
//
// Greedy steps of many rows read the LM head through a screen (llm_jax/backends/cpu/greedy_head.py) whose
// product is bound by arithmetic. AVX-512 VNNI's vpdpbusd multiplies 64 pairs of bytes (unsigned by
// signed) and adds each four to a 32-bit sum: twice the multiply-adds of vdpbf16ps, four times those of a
// float32 multiply-add. So x is quantized too, per row
// (quantize_row: int8 n, step t), and the int8 screen q is stored in quads of rows (rows 4k … 4k + 3 of
// a panel interleaved, [N / 16, K / 4, 16, 4]: one 64-byte line per quad of k). The sums are exact in
// int32 (|n q| ≤ 127 · 127 per product and K < 2^16 here); q is read as q + 128 (its top bit flipped,
// unsigned) and 128 Σ n taken off at the end. y = float(Σ_k n_k q_kj) · t: the caller applies the
// columns' scales, and argmax.cc bounds what quantizing x changed (from the same n and t). The products
// on quads run only where the build has VNNI; whether a call uses them (the `int8_dot` option) is decided
// by its caller, which otherwise runs XLA's product (cpu_kernels.matmuls) or the unscreened head.

// Rows per tile: 8 × 2 panels, 16 registers of sums. GCC keeps fewer of vpdpbusd's sums in registers than
// of vdpbf16ps's (about 18 against 24) and spills the rest to the stack every step: 12 rows would spill.
constexpr int kQuadMR = 8;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Whether the build has AVX-512 VNNI (built for the host CPU: whether it has it).
bool int8_dot_ready() { return true; }

// Quads of int8 values: 16 lanes of four products each, int32 sums; W's bytes read as q + 128 (its top
// bit flipped: vpdpbusd's unsigned operand), x's as they are.
struct Int8Quads {
  using Weight = int8_t;
  using Sum = int32_t;
  using Acc = __m512i;
  using W = __m512i;
  static constexpr int64_t kStep = 4;
  static constexpr int kRows = kQuadMR;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc load(const int32_t* y) { return _mm512_loadu_si512(y); }
  static void store(int32_t* y, Acc a) { _mm512_storeu_si512(y, a); }
  static W weights(const int8_t* p) { return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(-128)); }
  // In place, as the instruction adds (acc += w · a): through the intrinsic GCC copies every sum to
  // another register and back each step, and keeps some on the stack, which slows the product and the
  // fused head. vdpbf16ps's intrinsic compiles without the copies, and stays.
  static Acc dot(Acc acc, W w, __m512i a) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
    return acc;
  }
};

// The sums Σ_k n_k (Q_i[k, j] + 128) (int32) for x [R, K] quantized per row (quantize_row: n, t) and int8
// panels Q_i in quads of rows (K a multiple of 4, below kQuadsMaxK), handed over a unit of columns at a
// time: done(i, c0, width, sums, shift, t), sums [R, width] of columns [c0, c0 + width) of y_i, shift[r]
// = 128 Σ_k n_rk and t[r] the row's step, so that y_i[r, c0 + c] = float(sums[r, c] − shift[r]) · t[r].
// Each unit of panels runs its blocks of kKC rows of K over every tile of rows, summing in a buffer of
// its own; it asks for the next block (or the next unit's first) a few lines per tile, as the bfloat16
// dot products do.
template <typename Done>
void int8_dot_units(ffi::ThreadPool& pool, const float* x, const std::vector<const int8_t*>& ws,
                    const std::vector<int64_t>& ns, int64_t R, int64_t K, const Done& done) {
  const int64_t kc_max = std::min(K, kKC), tiles = (R + kQuadMR - 1) / kQuadMR, blocks = (K + kc_max - 1) / kc_max;
  // Per row: the step t and 128 Σ_k n_k; x's quads, block by block and tile by tile (as bfloat16's pairs).
  thread_local std::vector<int8_t> n_buffer;
  thread_local std::vector<float> t_buffer;
  thread_local std::vector<int32_t> shift_buffer;
  thread_local std::vector<uint32_t> xq_buffer;
  std::vector<int8_t>& n = n_buffer;
  std::vector<float>& t = t_buffer;
  std::vector<int32_t>& shift = shift_buffer;
  std::vector<uint32_t>& xq = xq_buffer;
  n.resize(static_cast<size_t>(R * K)), t.resize(static_cast<size_t>(R)), shift.resize(static_cast<size_t>(R));
  xq.resize(static_cast<size_t>(R * K / 4));
  for (int64_t r = 0; r < R; ++r) {
    t[r] = quantize_row(x + r * K, K, n.data() + r * K);
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += n[r * K + k];
    shift[r] = 128 * sum;
  }
  for (int64_t b = 0; b < blocks; ++b) {  // block b, tile at r0 (mr rows): mr · quads words from (k0 R + r0 kc) / 4
    const int64_t k0 = b * kc_max, kq = std::min(kc_max, K - k0) / 4;
    for (int64_t tt = 0; tt < tiles; ++tt) {
      int64_t r0, mr;
      tile_span(R, tiles, tt, &r0, &mr);
      uint32_t* out = xq.data() + (k0 * R) / 4 + r0 * kq;
      for (int64_t q = 0; q < kq; ++q) {
        for (int64_t r = 0; r < mr; ++r) std::memcpy(out + q * mr + r, n.data() + (r0 + r) * K + k0 + 4 * q, 4);
      }
    }
  }
  for_panel_units(pool, ns, K, [&](size_t i, int64_t q0, int64_t q1, NextUnit nu) {
    const Prefetcher next = nu.j >= 0 ? panel_block(ws[nu.j], K, nu.v0, nu.v1, 0, kc_max) : Prefetcher{};
    const int64_t panels = q1 - q0, calls = tiles * ((panels + 1) / 2), width = panels * kPanel;
    // The unit's int32 sums [R, width], in this thread's buffer (in L1 or L2), until they are done (summed
    // in y's own memory they are no faster, and y written past the caches at the end is slower).
    thread_local std::vector<int32_t> sums_buffer;
    sums_buffer.resize(static_cast<size_t>(R * width));
    int32_t* const sums = sums_buffer.data();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = b * kc_max, kc = std::min(kc_max, K - k0), kq = kc / 4;
      const int8_t* p = ws[i] + (q0 * K + k0) * kPanel;  // the unit's first panel, block b
      const int64_t ps = K * kPanel;
      Prefetcher pf = k0 + kc < K ? panel_block(ws[i], K, q0, q1, k0 + kc, std::min(K, k0 + kc + kc_max)) : next;
      const int64_t lines = (pf.left + calls - 1) / calls;
      for (int64_t tt = 0; tt < tiles; ++tt) {
        int64_t r0, mr;
        tile_span(R, tiles, tt, &r0, &mr);
        const uint32_t* xt = xq.data() + (k0 * R) / 4 + r0 * kq;
        int32_t* out = sums + r0 * width;
        int64_t q = 0;
        for (; q + 2 <= panels; q += 2) {
          dot_tile_rows<Int8Quads, 2>(mr, xt, kq, p + q * ps, ps, out + q * kPanel, width, b > 0, pf, lines);
        }
        if (q < panels) dot_tile_rows<Int8Quads, 1>(mr, xt, kq, p + q * ps, ps, out + q * kPanel, width, b > 0, pf, lines);
      }
    }
    done(i, q0 * kPanel, width, sums, shift.data(), t.data());
  });
}

// y_i = t · (n · Q_i) (float32), the sums above as floats: float(Σ (q + 128) n − 128 Σ n) · t.
void int8_dot_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const int8_t*>& ws,
                     const std::vector<float*>& ys, const std::vector<int64_t>& ns, int64_t R, int64_t K) {
  int8_dot_units(pool, x, ws, ns, R, K,
                 [&](size_t i, int64_t c0, int64_t width, const int32_t* sums, const int32_t* shift, const float* t) {
                   for (int64_t r = 0; r < R; ++r) {
                     float* out = ys[i] + r * ns[i] + c0;
                     for (int64_t c = 0; c < width; c += kPanel) {
                       _mm512_storeu_ps(out + c, quads_floats(sums + r * width + c, shift[r], t[r]));
                     }
                   }
                 });
}
#else
bool int8_dot_ready() { return false; }

template <typename Done>
void int8_dot_units(ffi::ThreadPool&, const float*, const std::vector<const int8_t*>&, const std::vector<int64_t>&,
                    int64_t, int64_t, const Done&) {}

void int8_dot_matmul(ffi::ThreadPool&, const float*, const std::vector<const int8_t*>&, const std::vector<float*>&,
                     const std::vector<int64_t>&, int64_t, int64_t) {}
#endif

// The path of a product on panels of R rows: the tile unit, bfloat16 dot products, register tiles or
// streams, by rows, dtype and the call's options (and, for the tile unit, K). One choice for the product
// and for panel_row_product, which repeats one row's share of it given the same options (a change to what
// a path sums, or in what order, belongs in panel_row too: tests/cpu_kernels/test_greedy_ties.py tells).
enum class PanelPath { kAmx, kBf16Dot, kTiled, kRows };

template <typename W>
PanelPath panel_path(int64_t R, int64_t K, const PanelOptions& options) {
  if (amx_takes<W>(R, K, options)) return PanelPath::kAmx;
  if (bf16_dot_takes<W>(R, options)) return PanelPath::kBf16Dot;
  return R >= kTiledMinRows ? PanelPath::kTiled : PanelPath::kRows;
}

// Every product on panels.
template <typename W>
void panel_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws, const std::vector<float*>& ys,
                  const std::vector<int64_t>& ns, int64_t R, int64_t K, const PanelOptions& options) {
  switch (panel_path<W>(R, K, options)) {
    case PanelPath::kAmx: return amx_matmul(pool, x, ws, ys, ns, R, K);
    case PanelPath::kBf16Dot: return bf16_dot_matmul(pool, x, ws, ys, ns, R, K);
    case PanelPath::kTiled: return panel_tiled(pool, x, ws, ys, ns, R, K);
    case PanelPath::kRows: return panel_rows(pool, x, ws, ys, ns, R, K, options.streamed);
  }
}

// y[0:16] = one row x [K] · panel p [K, 16] of a matrix [K, N] (float32 or bfloat16), each sum with the
// arithmetic panel_matmul uses for that element in a product of R rows on `threads` threads with the same
// options, through the same inner routines on one row and one panel: the tile unit's and the dot
// products' instructions, whose sums run over pairs of k in their own order; a register tile's
// multiply-adds over k in order, from zero and on from block to block of kKC; below kTiledMinRows the
// same over each slice of K (gemv_slices), the slices' sums added in order. Which other rows and columns
// share a tile, a unit or a thread leaves each sum as it is. x as the product reads it: rounded to W's
// dtype.
template <typename W>
void panel_row(const float* x, const W* p, int64_t N, int64_t R, int64_t K, int64_t threads,
               const PanelOptions& options, float* y) {
  if (K == 0) {  // an empty sum, as MatmulPanels gives it
    std::fill(y, y + kPanel, 0.f);
    return;
  }
  Prefetcher none;
  switch (panel_path<W>(R, K, options)) {
    case PanelPath::kAmx: return amx_row(x, reinterpret_cast<const uint16_t*>(p), K, y);
    case PanelPath::kBf16Dot: return bf16_dot_row(x, reinterpret_cast<const uint16_t*>(p), K, y);
    case PanelPath::kTiled: {  // panel_tiled: x packed for a tile of one row is x itself
      const int64_t kc_max = std::min(K, kKC);
      for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        tile<1, 1>(x + k0, std::min(kc_max, K - k0), p + k0 * kPanel, 0, y, kPanel, k0 > 0, none, 0);
      }
      return;
    }
    case PanelPath::kRows: {  // panel_rows (and panel_gemv_streams, its one slice of one row)
      const int64_t groups = (N / kPanel + kGemvPanels - 1) / kGemvPanels;
      const int64_t slices = gemv_slices(groups, K, threads), slice = (K + slices - 1) / slices;
      float part[kPanel];
      for (int64_t s = 0; s < slices; ++s) {
        const int64_t k0 = s * slice, kc = std::min(K, k0 + slice) - k0;
        float* out = s == 0 ? y : part;
        if (kc <= 0) {
          std::fill(out, out + kPanel, 0.f);
        } else if (R == 1) {
          panel_gemv<1>(x + k0, p + k0 * kPanel, 0, kc, out, 0);
        } else {
          tile<1, 1>(x + k0, kc, p + k0 * kPanel, 0, out, kPanel, false, none, 0);
        }
        if (s > 0) {
          for (int64_t j = 0; j < kPanel; ++j) y[j] += part[j];
        }
      }
      return;
    }
  }
}

// ---- FFI handlers ---------------------------------------------------------------------------------

template <ffi::DataType T>
using Matrix = ffi::Buffer<T, 2>;

// A handler's operands: x [R, K], the layer index l (int32 scalar), M weights of one dtype and M float32
// results y_i [R, N_i]. Each weight is read through `Weight` (its buffer type), whose dimensions
// `shape(dims, &L, &N, &k)` reads — false for a shape the layout does not have — and its layer l is used
// where it lies (a decode loop over stacked layers then never copies a layer's weights out of the stack).
template <typename W>
struct Operands {
  std::vector<const W*> ws;
  std::vector<float*> ys;
  std::vector<int64_t> ns;
  int64_t stack_bytes = 0;  // of the weights' whole stacks, every layer
};

template <typename Weight, typename W, typename Shape>
ffi::Error read_operands(const char* name, const char* layout, int64_t R, int64_t K, int64_t layer,
                         ffi::RemainingArgs& weights, ffi::RemainingRets& outs, Shape shape, Operands<W>* ops) {
  const auto error = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string("cpu_kernels matmul") + name + ": " + what);
  };
  if (weights.size() != outs.size() || weights.size() == 0) return error("one result per weight");
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<Weight>(i);
    auto y = outs.get<Matrix<ffi::F32>>(i);
    int64_t L = 0, N = 0, k = 0;
    if (!w.has_value() || !y.has_value() || !shape(w->dimensions(), &L, &N, &k)) {
      return error(std::string("weights must be ") + layout + " of one dtype, results 2-D float32");
    }
    if (k != K || (*y)->dimensions()[0] != R || (*y)->dimensions()[1] != N) {
      return error("shapes of x, w and y do not match");
    }
    if (layer < 0 || layer >= L) return error("layer index outside the stack of weights");
    ops->ws.push_back(reinterpret_cast<const W*>(w->untyped_data()) + layer * N * K);
    ops->ys.push_back((*y)->typed_data());
    ops->ns.push_back(N);
    ops->stack_bytes += L * N * K * static_cast<int64_t>(sizeof(W));
  }
  return ffi::Error::Success();
}

// Weights [K, N_i] (or [N_i, K] when transposed), or stacks [L, K, N_i] (or [L, N_i, K]).
template <bool kTransposed, ffi::DataType T, typename W>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, Matrix<ffi::F32> x,
                  ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const int64_t R = x.dimensions()[0], K = x.dimensions()[1];
  Operands<W> ops;
  auto shape = [](auto wd, int64_t* L, int64_t* N, int64_t* k) {
    if (wd.size() != 2 && wd.size() != 3) return false;
    const bool stacked = wd.size() == 3;
    const int64_t rows = wd[stacked ? 1 : 0], cols = wd[stacked ? 2 : 1];
    *L = stacked ? wd[0] : 1, *N = kTransposed ? rows : cols, *k = kTransposed ? cols : rows;
    return true;
  };
  const ffi::Error read = read_operands<ffi::Buffer<T>>("", "2-D (or 3-D stacks)", R, K, *layer_index.typed_data(),
                                                        weights, outs, shape, &ops);
  if (read.failure()) return read;
  const auto &ws = ops.ws, &ns = ops.ns;
  const auto& ys = ops.ys;
  if (K == 0) {  // an empty sum: zeros
    for (size_t i = 0; i < ys.size(); ++i) std::fill(ys[i], ys[i] + R * ns[i], 0.f);
  } else if (kTransposed && R >= kTiledMinRows && R <= kBroadcastMaxRows) {
    broadcast_matmul(pool, x.typed_data(), ws, ys, ns, R, K);
  } else if (R >= kTiledMinRows) {
    tiled_matmul<kTransposed>(pool, x.typed_data(), ws, ys, ns, R, K);
  } else if (kTransposed) {
    nk_matmul(pool, x.typed_data(), ws, ys, ns, R, K);
  } else {
    kn_matmul(pool, x.typed_data(), ws, ys, ns, R, K);
  }
  return ffi::Error::Success();
}

// Weights in the panel layout: stacks [L, N_i / 16, K, 16]. kPairs: bfloat16 panels each in pairs of rows
// (to_pairs's layout; K even): the LM head's screen (llm_jax/backends/cpu/greedy_head.py), on the tile unit
// where it takes the product, else on the dot products, both reading them as they lie. Attributes `amx`
// and `bf16_dot`: the instruction paths the call may take (PanelOptions).
template <ffi::DataType T, typename W, bool kPairs = false>
ffi::Error MatmulPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, Matrix<ffi::F32> x,
                        ffi::RemainingArgs weights, ffi::RemainingRets outs, bool amx, bool bf16_dot) {
  const int64_t R = x.dimensions()[0], K = x.dimensions()[1];
  PanelOptions options{amx, bf16_dot};
  Operands<W> ops;
  auto shape = [](auto wd, int64_t* L, int64_t* N, int64_t* k) {
    if (wd.size() != 4 || wd[3] != kPanel) return false;
    *L = wd[0], *N = wd[1] * kPanel, *k = wd[2];
    return true;
  };
  const char* name = kPairs ? " (pairs)" : " (panels)";
  const ffi::Error read = read_operands<ffi::Buffer<T>>(name, "[L, N / 16, K, 16] stacks", R, K,
                                                        *layer_index.typed_data(), weights, outs, shape, &ops);
  if (read.failure()) return read;
  options.streamed = ops.stack_bytes >= kStreamedBytes;
  if (kPairs && K % 2 != 0) {
    return ffi::Error::InvalidArgument("cpu_kernels matmul (pairs): K must be even, got " + std::to_string(K));
  }
  if (kPairs && !(bf16_dot && bf16_dot_ready())) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "cpu_kernels matmul (pairs): needs AVX512_BF16 dot products (absent from this build, or the "
                      "call's bf16_dot option off)");
  }
  if (K == 0) {  // an empty sum: zeros
    for (size_t i = 0; i < ops.ys.size(); ++i) std::fill(ops.ys[i], ops.ys[i] + R * ops.ns[i], 0.f);
  } else if constexpr (kPairs) {
    if (amx_takes<W>(R, K, options)) {
      amx_matmul(pool, x.typed_data(), ops.ws, ops.ys, ops.ns, R, K, true);
    } else {
      bf16_dot_matmul(pool, x.typed_data(), ops.ws, ops.ys, ops.ns, R, K, true);
    }
  } else {
    panel_matmul(pool, x.typed_data(), ops.ws, ops.ys, ops.ns, R, K, options);
  }
  return ffi::Error::Success();
}

// int8 panels in quads of rows (the LM head's screen on AVX-512 VNNI): stacks [L, N / 16, K, 16], K a
// multiple of 4 below kQuadsMaxK; y_i = t · (n · Q_i) for x quantized per row (int8_dot_matmul).
ffi::Error MatmulQuads(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, Matrix<ffi::F32> x,
                       ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const int64_t R = x.dimensions()[0], K = x.dimensions()[1];
  Operands<int8_t> ops;
  auto shape = [](auto wd, int64_t* L, int64_t* N, int64_t* k) {
    if (wd.size() != 4 || wd[3] != kPanel) return false;
    *L = wd[0], *N = wd[1] * kPanel, *k = wd[2];
    return true;
  };
  const ffi::Error read = read_operands<ffi::Buffer<ffi::S8>>(" (quads)", "[L, N / 16, K, 16] stacks", R, K,
                                                              *layer_index.typed_data(), weights, outs, shape, &ops);
  if (read.failure()) return read;
  if (K % 4 != 0 || K >= kQuadsMaxK) {
    return ffi::Error::InvalidArgument("cpu_kernels matmul (quads): K must be a multiple of 4 below " +
                                       std::to_string(kQuadsMaxK) + ", got " + std::to_string(K));
  }
  if (!int8_dot_ready()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "cpu_kernels matmul (quads): needs AVX-512 VNNI (absent from "
                                                      "this build)");
  }
  if (K == 0 || R == 0) {
    for (size_t i = 0; i < ops.ys.size(); ++i) std::fill(ops.ys[i], ops.ys[i] + R * ops.ns[i], 0.f);
  } else {
    int8_dot_matmul(pool, x.typed_data(), ops.ws, ops.ys, ops.ns, R, K);
  }
  return ffi::Error::Success();
}

auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()
      .Arg<Matrix<ffi::F32>>()
      .RemainingArgs()
      .RemainingRets();
}

// Products on panels: Binding's, and the call's options.
auto PanelBinding() { return Binding().Attr<bool>("amx").Attr<bool>("bf16_dot"); }

}  // namespace

namespace llm_jax_kernels {

bool quads_ready() { return int8_dot_ready(); }

void quads_units(ffi::ThreadPool& pool, const float* x, const int8_t* w, int64_t N, int64_t R, int64_t K,
                 const QuadsUnitFn& done) {
  int8_dot_units(pool, x, {w}, {N}, R, K,
                 [&](size_t, int64_t c0, int64_t width, const int32_t* sums, const int32_t* shift, const float* t) {
                   done(c0, width, sums, shift, t);
                 });
}

void panel_row_product(const float* x, const float* p, int64_t N, int64_t R, int64_t K, int64_t threads,
                       const PanelOptions& options, float* y) {
  panel_row(x, p, N, R, K, threads, options, y);
}

void panel_row_product(const float* x, const uint16_t* p, int64_t N, int64_t R, int64_t K, int64_t threads,
                       const PanelOptions& options, float* y) {
  panel_row(x, p, N, R, K, threads, options, y);
}

}  // namespace llm_jax_kernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulKnF32, (Matmul<false, ffi::F32, float>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulKnBF16, (Matmul<false, ffi::BF16, uint16_t>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulNkF32, (Matmul<true, ffi::F32, float>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulNkBF16, (Matmul<true, ffi::BF16, uint16_t>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulPanelsF32, (MatmulPanels<ffi::F32, float>), PanelBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulPanelsBF16, (MatmulPanels<ffi::BF16, uint16_t>), PanelBinding());
// int8 panels: only the LM head's screen (llm_jax/backends/cpu/greedy_head.py), whose scales the caller
// applies.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulPanelsI8, (MatmulPanels<ffi::S8, int8_t>), PanelBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulPairsBF16, (MatmulPanels<ffi::BF16, uint16_t, true>), PanelBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulQuadsI8, MatmulQuads, Binding());

// Floats per vector of the products above (build.vector_lanes): what the library was built for.
extern "C" int LlmJaxVectorLanes() { return kLanes; }

// Whether bfloat16 products with many rows can run on AMX tiles in this process: the build has AMX and
// Linux grants its state (build.amx; a call uses them where its `amx` option allows).
extern "C" int LlmJaxAmx() {
#if LLM_JAX_HAS_AMX
  return amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

// Whether bfloat16 products with many rows can run on AVX-512's bfloat16 dot products (build.bf16_dot; a
// call uses them where its `bf16_dot` option allows and AMX does not take the product).
extern "C" int LlmJaxBf16Dot() { return bf16_dot_ready() ? 1 : 0; }

// Whether the LM head's int8 screen in quads of rows can run on AVX-512 VNNI (build.int8_dot; whether a
// call uses it is its caller's `int8_dot` option).
extern "C" int LlmJaxInt8Dot() { return int8_dot_ready() ? 1 : 0; }
