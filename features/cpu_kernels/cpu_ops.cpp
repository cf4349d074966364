// The model's norms and rotary embedding for the CPU, compiled: one call where PyTorch makes a dozen.
//
// What this is
//   rms_norm_{f32,bf16,f64}(x, weight, rows, dim, row_stride, eps, out)
//       out[t] = weight * (x[t] / sqrt(mean(x[t]^2) + eps)), in float32 as Hugging Face does;
//   rope_{f32,bf16,f64}(x, cos, sin, rows, heads, head_dim, row_stride, out)
//       HF's "rotate half" RoPE: for the pair (i, i + D/2) of every head of token t,
//       out = (x1 cos - x2 sin, x2 cos + x1 sin) with cos, sin [T, D/2];
//   silu_mul_{f32,bf16,f64}(gate, up, rows, dim, gate_stride, up_stride, out)
//       SwiGLU's silu(gate) * up, every element by one code path (batch invariance).
//   level0_naive/cpu_ops.py (CpuOps) and invariant_ops.py (InvariantOps) build this file
//   (native.py) and call it through ctypes.
//
//   Why: at the batch sizes a CPU runs (1 to 128 tokens of a 256-wide model) an RMSNorm is
//   a few hundred nanoseconds of arithmetic and PyTorch spends 6 aten calls on it (cast,
//   square, mean, add, rsqrt, two multiplies), a RoPE 10 (chunk, four multiplies, a sub, an
//   add, a cat, a cast) for q and again for k: about 200 calls per forward of the built-in
//   model, at a few microseconds each. Here each is one call.
//
// Exactness
//   RoPE rounds exactly as PyTorch's elementwise ops do (each product and sum once, in the
//   tensor's dtype: bfloat16 rounds after every op, as torch's bfloat16 kernels do; the
//   build's -ffp-contract=off keeps a * b - c two roundings), so rope_* equals
//   model.apply_rope bit for bit, float64 included. RMSNorm's sum of squares is added in a
//   fixed order of its own (8 lanes, then a fixed tree), not PyTorch's, so it differs from
//   the torch formula in the last bits; that order depends only on the row, never on how
//   many rows there are (batch invariance). CpuOps keeps the torch formula for float64 (HF
//   normalises in float32 even there, and the equivalence tests match it exactly); the
//   batch-invariant ops use rms_norm_f64. SiLU uses its own exp (exp_f32, within 2 ulp of
//   libm's): a libm call would not vectorise, and PyTorch's own SiLU is not one code path.
//
// What this is not: the matmuls (PyTorch's, through oneDNN/MKL, are faster than anything
// this short; invariant_ops.cpp holds the fixed-order one), threaded, or fused across
// layers (vLLM's fused_add_rms_norm also folds in the residual add: one op, not worth the
// model's readability here).
//
// Reference: vLLM's csrc/layernorm_kernels.cu and pos_encoding_kernels.cu (the GPU twins);
// Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); Su et al., "RoFormer" (2021).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"  // bf16, widen, narrow: the one copy the kernels share
// What one elementwise op of PyTorch leaves in a tensor of dtype T: the value rounded to T
// (nothing to do for float and double, whose arithmetic already rounds to them).
template <typename T, typename A> static inline A rounded(A x) { return widen(narrow<T, A>(x)); }

template <typename T>
static void rms_norm(const T* x, const T* weight, int64_t rows, int64_t dim, int64_t row_stride, double eps_d, T* out) {
  using W = decltype(widen(T{}));  // what one op of the tensor's dtype computes in: float, or double
  constexpr int N = 8;             // lanes of the sum of squares: lane l adds i = l, l + 8, ... in order
  const float eps = float(eps_d);
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * row_stride;
    T* o = out + t * dim;
    float part[N] = {};
    int64_t i = 0;
    for (; i + N <= dim; i += N)
#pragma omp simd
      for (int l = 0; l < N; ++l) part[l] += float(widen(xr[i + l])) * float(widen(xr[i + l]));
    for (int l = 0; i < dim; ++i, ++l) part[l] += float(widen(xr[i])) * float(widen(xr[i]));
    for (int w = N / 2; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) part[l] += part[l + w];
    const float inv = 1.0f / std::sqrt(part[0] / float(dim) + eps);  // torch.rsqrt(mean + eps), in float32
    // HF: weight * (x32 * inv).to(dtype): the normalised value is rounded to the dtype, then scaled in it
#pragma omp simd
    for (int64_t j = 0; j < dim; ++j)
      o[j] = narrow<T, W>(W(widen(weight[j])) * W(rounded<T, float>(float(widen(xr[j])) * inv)));
  }
}

// e^x for float32 to about 2 ulp with no libm call, so `#pragma omp simd` vectorises it and the
// vector lanes and the scalar tail compute the same bits (Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by a degree-7 polynomial, then the exponent bits of 2^n).
static inline float exp_f32(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);  // e^88.3 is still finite in float32
  const float t = x * 1.44269504088896341f;                 // x / ln 2
  const int32_t n = int32_t(t < 0.0f ? t - 0.5f : t + 0.5f);  // rounded (std::floor would not vectorise)
  const float r = (x - float(n) * 0.693359375f) + float(n) * 2.12194440e-4f;  // ln 2 in two parts (Cody and Waite)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const int32_t bits = (n + 127) << 23;  // 2^n as a float's exponent
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

// SwiGLU's middle: silu(gate) * up = gate / (1 + e^-gate) * up, each element computed the same
// way wherever it sits in the tensor. (PyTorch's CPU loop computes a tensor's last few elements
// with a scalar SiLU and the rest with a vector one, and the two round differently: one reason
// a row's result can depend on how many rows there are.)
template <typename T>
static void silu_mul(const T* gate, const T* up, int64_t rows, int64_t dim, int64_t g_stride, int64_t u_stride, T* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const T *g = gate + t * g_stride, *u = up + t * u_stride;
    T* o = out + t * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      const float x = widen(g[i]);
      o[i] = narrow<T, float>(rounded<T, float>(x / (1.0f + exp_f32(-x))) * widen(u[i]));
    }
  }
}
template <>
void silu_mul<double>(const double* g, const double* u, int64_t rows, int64_t dim, int64_t gs, int64_t us, double* o) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < dim; ++i) o[t * dim + i] = g[t * gs + i] / (1.0 + std::exp(-g[t * gs + i])) * u[t * us + i];
}

template <typename T>
static void rope(const T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t head_dim,
                 int64_t row_stride, T* out) {  // x rows `row_stride` apart (a slice of q|k|v); out contiguous
  const int64_t h = head_dim / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const T *c = cos + t * h, *s = sin + t * h;
    for (int64_t j = 0; j < heads; ++j) {
      const T* a = x + t * row_stride + j * head_dim;  // x1 = a[0:h], x2 = a[h:2h]
      T* o = out + (t * heads + j) * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) {
        const auto x1 = widen(a[i]), x2 = widen(a[i + h]), ci = widen(c[i]), si = widen(s[i]);
        using A = std::remove_const_t<decltype(x1)>;  // float, or double for float64
        o[i] = narrow<T, A>(rounded<T, A>(x1 * ci) - rounded<T, A>(x2 * si));
        o[i + h] = narrow<T, A>(rounded<T, A>(x2 * ci) + rounded<T, A>(x1 * si));
      }
    }
  }
}

#define ENTRIES(S, T)                                                                                        \
  extern "C" void rms_norm_##S(const void* x, const void* w, int64_t rows, int64_t dim, int64_t stride, double eps, \
                               void* out) {                                                                         \
    rms_norm<T>(static_cast<const T*>(x), static_cast<const T*>(w), rows, dim, stride, eps, static_cast<T*>(out));  \
  }                                                                                                                 \
  extern "C" void rope_##S(const void* x, const void* c, const void* s, int64_t rows, int64_t heads, int64_t d,     \
                           int64_t stride, void* out) {                                                             \
    rope<T>(static_cast<const T*>(x), static_cast<const T*>(c), static_cast<const T*>(s), rows, heads, d, stride,   \
            static_cast<T*>(out));                                                                                  \
  }                                                                                                                 \
  extern "C" void silu_mul_##S(const void* g, const void* u, int64_t rows, int64_t dim, int64_t gs, int64_t us,     \
                               void* out) {                                                                         \
    silu_mul<T>(static_cast<const T*>(g), static_cast<const T*>(u), rows, dim, gs, us, static_cast<T*>(out));       \
  }
ENTRIES(f32, float)
ENTRIES(bf16, bf16)
ENTRIES(f64, double)
