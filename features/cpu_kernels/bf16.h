// bfloat16 as the compiled kernels store it (cpu_ops.cpp, cpu_attention.cpp and
// features/batch_invariance/invariant_ops.cpp include this one copy): the top half of a float32.
// Widening is a shift; narrowing rounds to nearest even, as torch's .to(torch.bfloat16) does,
// and a NaN stays a NaN. `widen` of a float or a double is itself, so a kernel templated on the
// stored type T computes in decltype(widen(T{})): float for float and bfloat16, double for double.
#pragma once

#include <cstdint>
#include <cstring>

struct bf16 {
  uint16_t bits;
};
static inline float widen(float x) { return x; }
static inline double widen(double x) { return x; }
static inline float widen(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <typename T, typename A> static inline T narrow(A x) { return static_cast<T>(x); }
template <> inline bf16 narrow<bf16, float>(float x) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (x != x) return bf16{uint16_t(0x7fc0)};  // NaN
  u += 0x7fff + ((u >> 16) & 1);
  return bf16{uint16_t(u >> 16)};
}
