// Decode attention on CPU, as an XLA FFI custom call: one query per row against one layer of the
// stacked KV cache [L, B, S, K, H], read where it lies.
//
// In XLA the decode step first slices the layer out of the cache and then, for its dot products,
// transposes the keys and values to [B, K, S, H]: two copies of the layer's cache per layer and step
// (15M, batch 32: 20 of 51 ms per step). Here each (row, kv head) reads its keys and values once, in
// the cache's own layout, for all G query heads that share them.
//
// Semantics are llm_jax.model.attention.xla_attention's for one query at position p per row: key slot s
// is visible iff s <= p, s < kv_lengths[b] and (no window or p - s < window); scores q·k · scale, then
// softcap · tanh(score / softcap) when a softcap is given; softmax over the visible slots (a row with
// none gives zeros); probabilities rounded to the values' dtype; o = Σ p_s · v_s, in float32.
//
// The cache is float32, or bfloat16 (also as its bits, uint16: the decode loop carries it so). q is
// float32 [B, N, H] with N = K · G, query head n = k · G + g.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

inline float rounded(float p, const float*) { return p; }
inline float rounded(float p, const uint16_t*) { return round_to_bf16(p); }

// ⟨a, b⟩ over H values, a float32, b float32 or bfloat16.
template <typename C>
inline float dot(const float* a, const C* b, int64_t H) {
  f32x8 acc = splat(0.f);
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) acc += load8(a + h) * load8(b + h);
  float s = hsum(acc);
  for (; h < H; ++h) s += a[h] * load1(b + h);
  return s;
}

// out[0:H] += p · v[0:H]
template <typename C>
inline void axpy(float p, const C* v, float* out, int64_t H) {
  const f32x8 pv = splat(p);
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) store8(out + h, load8(out + h) + pv * load8(v + h));
  for (; h < H; ++h) out[h] += p * load1(v + h);
}

struct Shape {
  int64_t B, S, K, G, H;
};

// Row b, kv heads kh0:kh1: for each, the G query heads sharing it, over the slots they see. A slot's
// heads lie side by side in the cache ([S, K, H] per row), so taking them together reads the row's
// cache as one contiguous run (15M, batch 32: one head at a time, a 192-byte run every 1152 bytes,
// spent 13 % of a step waiting on memory).
template <typename C>
void attend_unit(const float* q, const C* k_cache, const C* v_cache, float* o, const Shape& d, int64_t b,
                 int64_t kh0, int64_t kh1, int64_t position, int64_t length, float scale, int64_t window,
                 float softcap) {
  const int64_t S = d.S, K = d.K, G = d.G, H = d.H;
  const int64_t N = K * G, heads = (kh1 - kh0) * G;  // query heads of the unit
  int64_t lo = 0, hi = std::min<int64_t>(std::min(length, position + 1), S);
  if (window > 0) lo = std::max<int64_t>(lo, position - window + 1);
  const float* q_unit = q + (b * N + kh0 * G) * H;  // [heads, H]
  float* out = o + (b * N + kh0 * G) * H;
  std::fill(out, out + heads * H, 0.f);
  if (hi <= lo) return;  // no visible key: zeros
  const int64_t n = hi - lo, slot_stride = K * H;  // between slots s and s + 1 of one row
  const C* k0 = k_cache + (b * S * K + kh0) * H;
  const C* v0 = v_cache + (b * S * K + kh0) * H;
  // One buffer per thread, kept between calls: no allocation per layer and step.
  thread_local std::vector<float> scores;  // [heads, n]
  scores.resize(static_cast<size_t>(heads * n));
  for (int64_t s = lo; s < hi; ++s) {
    for (int64_t i = 0; i < heads; ++i) {  // query head i reads kv head kh0 + i / G
      float score = dot(q_unit + i * H, k0 + s * slot_stride + (i / G) * H, H) * scale;
      if (softcap > 0.f) score = softcap * std::tanh(score / softcap);
      scores[i * n + (s - lo)] = score;
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    float* sc = scores.data() + i * n;
    float top = sc[0];
    for (int64_t j = 1; j < n; ++j) top = std::max(top, sc[j]);
    float total = 0.f;
    for (int64_t j = 0; j < n; ++j) total += (sc[j] = std::exp(sc[j] - top));
    for (int64_t j = 0; j < n; ++j) sc[j] = rounded(sc[j] / total, v0);
  }
  for (int64_t s = lo; s < hi; ++s) {
    for (int64_t i = 0; i < heads; ++i) {
      axpy(scores[i * n + (s - lo)], v0 + s * slot_stride + (i / G) * H, out + i * H, H);
    }
  }
}

// layer (int32 scalar), q [B, N, H] float32, k and v caches [L, B, S, K, H], q_positions [B] and
// kv_lengths [B] int32 → o [B, N, H] float32.
template <ffi::DataType T, typename C>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::S32, 0> layer_index, ffi::Buffer<ffi::F32, 3> q,
                           ffi::Buffer<T, 5> k_cache, ffi::Buffer<T, 5> v_cache,
                           ffi::Buffer<ffi::S32, 1> q_positions, ffi::Buffer<ffi::S32, 1> kv_lengths,
                           ffi::ResultBuffer<ffi::F32, 3> o, float scale, int64_t window, float softcap) {
  const auto kd = k_cache.dimensions(), qd = q.dimensions();
  const int64_t L = kd[0], B = kd[1], S = kd[2], K = kd[3], H = kd[4];
  const int64_t layer = *layer_index.typed_data();
  const auto vd = v_cache.dimensions();
  if (!std::equal(kd.begin(), kd.end(), vd.begin()) || qd[0] != B || qd[2] != H || qd[1] % K != 0 ||
      q_positions.dimensions()[0] != B || kv_lengths.dimensions()[0] != B) {
    return ffi::Error::InvalidArgument("cpu_kernels decode_attention: shapes of q, caches and lengths do not match");
  }
  if (layer < 0 || layer >= L) {
    return ffi::Error::InvalidArgument("cpu_kernels decode_attention: layer index outside the cache");
  }
  const Shape d{B, S, K, qd[1] / K, H};
  const size_t layer_size = static_cast<size_t>(B * S * K * H);
  const C* k_layer = reinterpret_cast<const C*>(k_cache.untyped_data()) + layer * layer_size;
  const C* v_layer = reinterpret_cast<const C*>(v_cache.untyped_data()) + layer * layer_size;
  const int32_t* positions = q_positions.typed_data();
  const int32_t* lengths = kv_lengths.typed_data();
  // Units: a row's kv heads in `parts` contiguous groups, as few as still give every thread two units
  // (one group at batch 32; four at batch 1 on 2 threads).
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t parts = std::clamp<int64_t>((2 * threads + B - 1) / B, 1, K);
  parallel_for(pool, B * parts, [&](int64_t unit) {
    const int64_t b = unit / parts, part = unit % parts;
    attend_unit(q.typed_data(), k_layer, v_layer, o->typed_data(), d, b, part * K / parts, (part + 1) * K / parts,
                positions[b], lengths[b], scale, window, softcap);
  });
  return ffi::Error::Success();
}

template <ffi::DataType T>
auto Binding() {
  using Cache = ffi::Buffer<T, 5>;
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32, 0>>()
      .Arg<ffi::Buffer<ffi::F32, 3>>()
      .template Arg<Cache>()
      .template Arg<Cache>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::F32, 3>>()
      .template Attr<float>("scale")
      .template Attr<int64_t>("window")
      .template Attr<float>("softcap");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionF32, (DecodeAttention<ffi::F32, float>), Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionBF16, (DecodeAttention<ffi::BF16, uint16_t>), Binding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionBits, (DecodeAttention<ffi::U16, uint16_t>), Binding<ffi::U16>());
