// A plain streaming read, for measuring memory bandwidth (scripts/benchmarking/machine.py): the sum of n
// float32 values, read once, in order, into four 8-wide accumulators, so the loop waits on memory and
// not on a chain of additions. Not an XLA handler: called through ctypes, one call per thread.
//
// NumPy's reductions read slower than this on some machines, which makes every roofline fraction
// measured against them too flattering (the benchmark takes the fastest reader). A single stream read
// this way was the fastest of the patterns tried (several interleaved streams per thread, or software
// prefetch ahead of the stream, were slower).

#include <cstdint>
#include <cstring>

#include "common.h"

using llm_jax_kernels::f32x8;
using llm_jax_kernels::hsum;
using llm_jax_kernels::load8;

extern "C" float LlmJaxStreamRead(const float* p, int64_t n) {
  f32x8 a{}, b{}, c{}, d{};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a += load8(p + i);
    b += load8(p + i + 8);
    c += load8(p + i + 16);
    d += load8(p + i + 24);
  }
  float sum = hsum(a + b + c + d);
  for (; i < n; ++i) sum += p[i];
  return sum;
}
