// The gated MLP's activation on CPU, as an XLA FFI custom call: out [R, F] = act(g) · u for the fused
// gate/up projection's output y [R, 2F] = [g | u] (llm_jax/backends/cpu/forms.py), all float32.
//
//   silu:       act(g) = g / (1 + e^-g)                                  (SwiGLU: Llama, Mistral, Qwen)
//   gelu_tanh:  act(g) = g / 2 · (1 + tanh(√(2/π) (g + 0.044715 g³)))
//                      = g / (1 + e^-z), z = 2 √(2/π) (g + 0.044715 g³)  (GeGLU: Gemma)
//
// XLA:CPU computes the same op as a loop fusion of one element at a time on one thread, a noticeable
// share of a small model's decode step at large batch. Here a vector of kLanes values at a time
// (exp_lanes: within 2 ulp of e^x), rows shared among the threads when there are many.

#include <cmath>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace llm_jax_kernels;

namespace {

typedef int32_t ivec __attribute__((vector_size(sizeof(fvec))));

constexpr int64_t kValuesPerUnit = 16384;  // outputs per unit of work: fewer run on the caller alone

// √(2/π) · 2, and that times 0.044715: z = g (kZ1 + kZ3 g²).
constexpr float kZ1 = 1.5957691216057308f;
constexpr float kZ3 = kZ1 * 0.044715f;

// The argument of e^- for gelu_tanh (z above), or g itself for silu.
template <bool kGelu, typename V>
inline V exponent(V g) {
  return kGelu ? g * (kZ1 + kZ3 * g * g) : g;
}

// out[j] = g[j] / (1 + e^-s(g[j])) · u[j] for j < F.
template <bool kGelu>
void glu_row(const float* g, const float* u, float* out, int64_t F) {
  int64_t j = 0;
  for (; j + kLanes <= F; j += kLanes) {
    const fvec x = loadv(g + j);
    storev(out + j, x / (1.f + exp_lanes<fvec, ivec>(-exponent<kGelu>(x))) * loadv(u + j));
  }
  for (; j < F; ++j) out[j] = g[j] / (1.f + std::exp(-exponent<kGelu>(g[j]))) * u[j];
}

template <bool kGelu>
ffi::Error Glu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> y, ffi::ResultBuffer<ffi::F32, 2> out) {
  const int64_t R = y.dimensions()[0], E = y.dimensions()[1], F = E / 2;
  if (E % 2 || out->dimensions()[0] != R || out->dimensions()[1] != F) {
    return ffi::Error::InvalidArgument("glu: y [R, 2F] (gate, then up) and out [R, F]");
  }
  const float* in = y.typed_data();
  float* o = out->typed_data();
  const int64_t rows_per_unit = std::max<int64_t>(1, kValuesPerUnit / std::max<int64_t>(F, 1));
  const int64_t units = (R + rows_per_unit - 1) / rows_per_unit;
  auto unit = [&](int64_t t) {
    for (int64_t r = t * rows_per_unit; r < std::min(R, (t + 1) * rows_per_unit); ++r) {
      glu_row<kGelu>(in + r * E, in + r * E + F, o + r * F, F);
    }
  };
  if (units > 1) {
    parallel_for(pool, units, unit);
  } else if (units == 1) {
    unit(0);
  }
  return ffi::Error::Success();
}

auto Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32, 2>>().Ret<ffi::Buffer<ffi::F32, 2>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GluSiluF32, Glu<false>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GluGeluTanhF32, Glu<true>, Binding());
