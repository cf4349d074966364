// The batch-invariant matmul: every output is one sum over k = 0, 1, ..., K-1, in that order.
//
// What this is
//   pack_{f32,bf16,f64}(w, N, K, packed)         W [N, K] (nn.Linear's layout) -> panels, once per weight
//   linear_{f32,bf16,f64}(x, packed, bias, M, N, K, out)   out [M, N] = x [M, K] @ W^T + bias
//   invariant_ops.py builds this file (native.py) and calls it through ctypes.
//
// The problem it fixes
//   PyTorch's CPU matmul (oneDNN/MKL) picks its algorithm by shape: a matrix-vector kernel
//   for one row, blocked kernels for more, with the reduction over K split and reordered
//   differently for small and large M. So a row's result depends on how many rows came with
//   it (measured: one row alone differs from the same row among 2..8 others in the last bits
//   for every layer of the built-in model; docs/batch_invariance.md).
//
// The loop nest
//   The weight is packed once into panels of NR columns, each [K, NR] contiguous (zero past N):
//
//     for each panel p (columns n0 .. n0 + NR):
//       for each tile of MR rows of x:                 MR x NR outputs in registers
//         acc[MR][NR] = 0
//         for k in 0 .. K-1:                           in order, always
//           acc[i][:] += x[i, k] * panel[k, :]         a broadcast times a vector: an outer product
//         out[rows, n0 .. n0 + NR] = acc (+ bias)
//
//   Each accumulator lane is one output, and it adds its K products one after another in k's
//   order, with one fused multiply-add each where the CPU has one (this file is the one built
//   with -ffp-contract=fast; `acc += x * w` is its only accumulation). Which tile a row lands
//   in, how many rows there are, the vector width: none of them changes the order, only how
//   many outputs advance together. So out[i, :] depends only on x[i, :] and W.
//   (The Thinking Machines kernels fix the same thing on GPUs by refusing split-K and using
//   one tile configuration for every shape.)
//
// What this is not
//   Not the fastest matmul: a sequential chain per output is what makes it invariant, and it
//   leaves out the blocking over K that oneDNN does for cache reuse. Measured on a Xeon with
//   AVX-512, one thread, every weight of the built-in model once per pass (so from L3, as in
//   a forward): 1.2x oneDNN's time for one row, 1.0x for 16, 1.2x for 64
//   (`python -m benchmarks.profile --batch-invariant` shows it inside a decode step). Not
//   threaded. Accumulation is float32 for float32 and bfloat16 (PyTorch's too), float64 for
//   float64; bfloat16 weights are packed as float32 (twice their memory; no AMX).
//
// Reference: He, "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025), and its
// batch_invariant_ops; Goto & van de Geijn, "Anatomy of High-Performance Matrix Multiplication"
// (2008) for the packed panels and the outer-product micro-kernel.

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
constexpr int VBYTES = 64, MR = 6, NV = 4;  // 24 accumulators in the 32 zmm registers
#else
constexpr int VBYTES = 32, MR = 4, NV = 3;  // 12 accumulators in the 16 ymm registers (or 32 NEON halves)
#endif

#include "bf16.h"  // bf16, widen, narrow: the one copy the kernels share

template <typename A> struct Panel {
  typedef A vec __attribute__((vector_size(VBYTES)));
  static constexpr int L = VBYTES / sizeof(A);  // lanes per vector
  static constexpr int NR = NV * L;             // columns per panel
};

template <typename T, typename A>
static void pack(const T* w, int64_t N, int64_t K, A* packed) {  // [N, K] -> [ceil(N / NR), K, NR]
  constexpr int NR = Panel<A>::NR;
  for (int64_t p = 0; p * NR < N; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        packed[(p * K + k) * NR + c] = n < N ? A(widen(w[n * K + k])) : A(0);
      }
}

template <typename A>
static inline typename Panel<A>::vec load(const A* p) {  // one vector from memory, into a register
  typename Panel<A>::vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int R, typename T, typename A>
static inline void tile(const T* x, const A* panel, int64_t K, const T* bias, int64_t ncols, T* out, int64_t ldo) {
  using vec = typename Panel<A>::vec;
  constexpr int L = Panel<A>::L;
  vec acc[R][NV];  // R x NV vectors: R x NR outputs, all in registers (never copied out by address:
                   // that would make the compiler keep them in memory, 3x slower)
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    const A* row = panel + k * NV * L;  // panel[k, :]: NR weights, contiguous
    vec w[NV];
    for (int j = 0; j < NV; ++j) w[j] = load<A>(row + j * L);
    for (int i = 0; i < R; ++i) {
      const vec xb = vec{} + A(widen(x[i * K + k]));  // x[i, k] in every lane
      for (int j = 0; j < NV; ++j) acc[i][j] += xb * w[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t c = 0; c < ncols; ++c) {
      const A sum = acc[i][c / L][c % L];
      out[i * ldo + c] = narrow<T, A>(bias ? sum + A(widen(bias[c])) : sum);
    }
}

template <typename T, typename A>
static void linear(const T* x, const A* packed, const T* bias, int64_t M, int64_t N, int64_t K, T* out) {
  constexpr int NR = Panel<A>::NR;
  for (int64_t n0 = 0; n0 < N; n0 += NR) {
    const A* panel = packed + (n0 / NR) * K * NR;
    const int64_t ncols = N - n0 < NR ? N - n0 : NR;
    const T* b = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile<MR>(x + m * K, panel, K, b, ncols, out + m * N + n0, N);
    for (; m < M; ++m) tile<1>(x + m * K, panel, K, b, ncols, out + m * N + n0, N);  // the same sums, one row
  }
}

#define ENTRY(S, T, A)                                                                                       \
  extern "C" int64_t panel_width_##S() { return Panel<A>::NR; }                                              \
  extern "C" void pack_##S(const void* w, int64_t N, int64_t K, void* packed) {                              \
    pack<T, A>(static_cast<const T*>(w), N, K, static_cast<A*>(packed));                                     \
  }                                                                                                          \
  extern "C" void linear_##S(const void* x, const void* packed, const void* bias, int64_t M, int64_t N,      \
                             int64_t K, void* out) {                                                         \
    linear<T, A>(static_cast<const T*>(x), static_cast<const A*>(packed), static_cast<const T*>(bias), M, N, \
                 K, static_cast<T*>(out));                                                                   \
  }
ENTRY(f32, float, float)
ENTRY(bf16, bf16, float)
ENTRY(f64, double, double)
