// Matrix products for LLM decode on CPU, as XLA FFI custom calls: y_i[R, N_i] = x[R, K] · W_i, few rows R,
// for one or several weight matrices W_i sharing the input; each W_i may be one layer of a stack
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
// Units are shared out through an atomic counter among the caller and tasks on XLA's intra-op thread
// pool; the caller works too and then waits only for units already taken, so a task that starts late
// (or never) cannot stall the call.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

// ---- kn: W [K, N] ---------------------------------------------------------------------------------

constexpr int64_t kPrefetchRows = 4;
// Rows of W taken together: y is loaded and stored once per four rows instead of once per row, which
// leaves the core's load/store ports to the weights (110M's 12 layers of float32 products, one row:
// 26 ms instead of 32).
constexpr int64_t kRowBlock = 4;
// One row of x (decode): a column tile spans 4 KiB of each row of W (1024 float32 or 2048 bfloat16
// columns), the stretch the prefetcher follows before the next row. float32: 1024 columns measured
// best, 2048 and 4096 5-15% slower; bfloat16: 2048 columns 12% faster than 1024 (110M step 23.8 ->
// 21.0 ms), 4096 the same.
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
    // find it, so ask for the rows ahead (measured: 1.4× faster, at 88% of a streaming read).
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
  // order of float32 sums: a 4 KiB-per-row tile here flipped a near-tied greedy token of the random
  // 15M bfloat16 model in prefill — 43% of tokens equal to transformers' instead of 100% — for no
  // measured gain.)
  const int64_t tile =
      R == 1 ? kTileBytes / static_cast<int64_t>(sizeof(W)) : std::max<int64_t>(16, (1024 / R) / 16 * 16);
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

template <typename W>
void nk_matmul(ffi::ThreadPool& pool, const float* x, const std::vector<const W*>& ws, const std::vector<float*>& ys,
               const std::vector<int64_t>& ns, int64_t R, int64_t K) {
  constexpr int64_t kRowsPerUnit = 64;
  const size_t M = ws.size();
  std::vector<int64_t> first_unit(M + 1, 0);
  for (size_t i = 0; i < M; ++i) first_unit[i + 1] = first_unit[i] + (ns[i] + kRowsPerUnit - 1) / kRowsPerUnit;
  parallel_for(pool, first_unit[M], [&](int64_t unit) {
    const size_t i = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
    const int64_t N = ns[i], n0 = (unit - first_unit[i]) * kRowsPerUnit;
    for (int64_t n = n0; n < std::min(N, n0 + kRowsPerUnit); ++n) {
      const W* wn = ws[i] + n * K;
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

// ---- FFI handlers ---------------------------------------------------------------------------------

template <ffi::DataType T>
using Matrix = ffi::Buffer<T, 2>;

// x [R, K]; the layer index l (int32 scalar); then M weight matrices, all of dtype T: each [K, N_i] (or
// [N_i, K] when transposed), or a stack [L, K, N_i] of which layer l is used, read where it lies (a
// decode loop over stacked layers then never copies a layer's weights out of the stack). M results
// y_i [R, N_i].
template <bool kTransposed, ffi::DataType T, typename W>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, Matrix<ffi::F32> x,
                  ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const int64_t R = x.dimensions()[0], K = x.dimensions()[1];
  const int64_t layer = *layer_index.typed_data();
  if (weights.size() != outs.size() || weights.size() == 0) {
    return ffi::Error::InvalidArgument("cpu_kernels matmul: one result per weight matrix");
  }
  std::vector<const W*> ws;
  std::vector<float*> ys;
  std::vector<int64_t> ns;
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::Buffer<T>>(i);
    auto y = outs.get<Matrix<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value() || (w->dimensions().size() != 2 && w->dimensions().size() != 3)) {
      return ffi::Error::InvalidArgument(
          "cpu_kernels matmul: weights must be 2-D (or 3-D stacks) of one dtype, results 2-D float32");
    }
    const auto wd = w->dimensions();
    const bool stacked = wd.size() == 3;
    const int64_t L = stacked ? wd[0] : 1, rows = wd[stacked ? 1 : 0], cols = wd[stacked ? 2 : 1];
    const int64_t N = kTransposed ? rows : cols, w_k = kTransposed ? cols : rows;
    if (w_k != K || (*y)->dimensions()[0] != R || (*y)->dimensions()[1] != N) {
      return ffi::Error::InvalidArgument("cpu_kernels matmul: shapes of x, w and y do not match");
    }
    if (layer < 0 || layer >= L) {
      return ffi::Error::InvalidArgument("cpu_kernels matmul: layer index outside the stack of weights");
    }
    ws.push_back(reinterpret_cast<const W*>(w->untyped_data()) + layer * rows * cols);
    ys.push_back((*y)->typed_data());
    ns.push_back(N);
  }
  if (kTransposed) {
    nk_matmul(pool, x.typed_data(), ws, ys, ns, R, K);
  } else {
    kn_matmul(pool, x.typed_data(), ws, ys, ns, R, K);
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulKnF32, (Matmul<false, ffi::F32, float>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulKnBF16, (Matmul<false, ffi::BF16, uint16_t>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulNkF32, (Matmul<true, ffi::F32, float>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulNkBF16, (Matmul<true, ffi::BF16, uint16_t>), Binding());
