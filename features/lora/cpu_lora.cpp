// Multi-LoRA's delta on a CPU, compiled: Punica's BGMV as one call per projection.
//
// What this is
//   lora_delta_{f32,bf16,f64}(x, x_stride, A, B, scale, idx, rows, slots, width, n_in, n_out, y, y_stride)
//       y[t] += scale[s] * B[s]^T (A[s] x[t])   for every row t whose slot s = idx[t] is >= 0
//   with the slots' weights where they lie (features/lora/slots.py keeps them so):
//       x [rows, n_in] (rows x_stride apart)   A [slots, width, n_in]   B [slots, width, n_out]
//       scale [slots]   idx [rows] (int64, -1: the base model alone)   y [rows, n_out] (y_stride apart)
//   Each slot's rows are taken together, a few at a time, so a slot's A and B are read from
//   the cache once for those rows; each row meets its own slot's `width` ranks and no other's.
//   features/lora/cpu_ops.py builds this file (features/cpu_kernels/native.py) and calls it.
//
//   Why: PyTorch has no call for "every row its own small matrix". The stacked delta
//   (punica.py) multiplies every row by every slot's ranks and masks the others: S times the
//   arithmetic, which at 8 slots of rank 8 on a 256-wide model is a third of the base
//   model's own. The segmented one multiplies only what each row needs, but spends its time
//   gathering rows and scattering results. Here the multiplications are the ones a row needs
//   and nothing is copied: what Punica's GPU kernel does, with a CPU's loops.
//
// Exactness: each dot product of the shrink and each output of the expand is summed in an
//   order of its own (the compiler's vector lanes, with fused multiply-adds), so the delta
//   agrees with PyTorch's matmuls to rounding, not bit for bit (tests/test_lora.py: equal to
//   the loop path within float tolerance, and the same greedy tokens as PEFT in float64).
//   bfloat16 computes in float and rounds once, when the delta joins y.
//
// What this is not: threaded (one core, as the benchmarks run), tiled for a GPU's shared
// memory (triton_ops.py is the GPU's), or S-LoRA's sharded split (its shrink and expand
// need a message between them: the stacked path does that).
//
// Reference: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), BGMV; vLLM's
// csrc/punica (the CUDA kernels it used before its Triton ones).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16.h"  // bf16, widen, narrow

constexpr int64_t K = 64;  // outputs at a time in the expand

// y_j[k0 + k] += sum_r u[j, r] b[r, k] for the k < kn (kn = KN when KN > 0: a compile-time count) of four rows
// (a null y_j: no row there); b = B[s] at column k0, rows n_out apart; u [4, width]
template <typename T, int64_t KN>
static inline void expand(const T* b, int64_t n_out, int64_t width, int64_t kn_rt, const decltype(widen(T{}))* u,
                          T* const ys[4], int64_t k0) {
  using W = decltype(widen(T{}));
  const int64_t kn = KN > 0 ? KN : kn_rt;
  W o0[K] = {}, o1[K] = {}, o2[K] = {}, o3[K] = {};
  for (int64_t r = 0; r < width; ++r) {
    const T* br = b + r * n_out;
    const W c0 = u[r], c1 = u[width + r], c2 = u[2 * width + r], c3 = u[3 * width + r];
#pragma omp simd
    for (int64_t k = 0; k < kn; ++k) {
      const W bk = widen(br[k]);
      o0[k] += c0 * bk, o1[k] += c1 * bk, o2[k] += c2 * bk, o3[k] += c3 * bk;
    }
  }
  const W* os[4] = {o0, o1, o2, o3};
  for (int j = 0; j < 4; ++j) {  // y += delta, rounded once to y's type
    if (!ys[j]) continue;
    T* yr = ys[j] + k0;
    const W* o = os[j];
#pragma omp simd
    for (int64_t k = 0; k < kn; ++k) yr[k] = narrow<T, W>(widen(yr[k]) + o[k]);
  }
}

template <typename T>
static void lora_delta(const T* x, int64_t x_stride, const T* A, const T* B, const T* scale, const int64_t* idx,
                       int64_t rows, int64_t slots, int64_t width, int64_t n_in, int64_t n_out, T* y,
                       int64_t y_stride) {
  using W = decltype(widen(T{}));  // float for float and bfloat16, double for double
  std::vector<int64_t> mine;       // this slot's rows
  mine.reserve(rows);
  std::vector<W> u(4 * width);  // four rows' shrink [4, width], already scaled
  for (int64_t s = 0; s < slots; ++s) {
    mine.clear();
    for (int64_t t = 0; t < rows; ++t)
      if (idx[t] == s) mine.push_back(t);
    if (mine.empty()) continue;
    const T* As = A + s * width * n_in;   // [width, n_in]
    const T* Bs = B + s * width * n_out;  // [width, n_out]
    const W sc = widen(scale[s]);
    // four of the slot's rows at a time, so that each of A's and B's values loaded serves four rows
    // (and the four sums are independent: the core overlaps them); a last group of fewer repeats its
    // first row in the empty places and keeps only its own
    for (size_t i0 = 0; i0 < mine.size(); i0 += 4) {
      const int64_t n = std::min<int64_t>(4, int64_t(mine.size() - i0));
      const T* x0 = x + mine[i0] * x_stride;
      const T* x1 = n > 1 ? x + mine[i0 + 1] * x_stride : x0;
      const T* x2 = n > 2 ? x + mine[i0 + 2] * x_stride : x0;
      const T* x3 = n > 3 ? x + mine[i0 + 3] * x_stride : x0;
      // shrink: u[j, r] = scale * (A[s, r] . x_j)
      for (int64_t r = 0; r < width; ++r) {
        const T* a = As + r * n_in;
        W d0 = 0, d1 = 0, d2 = 0, d3 = 0;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
        for (int64_t k = 0; k < n_in; ++k) {
          const W ak = widen(a[k]);
          d0 += ak * widen(x0[k]);
          d1 += ak * widen(x1[k]);
          d2 += ak * widen(x2[k]);
          d3 += ak * widen(x3[k]);
        }
        u[r] = d0 * sc, u[width + r] = d1 * sc, u[2 * width + r] = d2 * sc, u[3 * width + r] = d3 * sc;
      }
      // expand and add: y_j[k] += sum_r u[j, r] B[s, r, k], K outputs at a time (a whole chunk's count is a
      // constant, so the compiler keeps the four rows' sums in vector registers while it walks the ranks)
      T* ys[4] = {y + mine[i0] * y_stride, n > 1 ? y + mine[i0 + 1] * y_stride : nullptr,
                  n > 2 ? y + mine[i0 + 2] * y_stride : nullptr, n > 3 ? y + mine[i0 + 3] * y_stride : nullptr};
      int64_t k0 = 0;
      for (; k0 + K <= n_out; k0 += K) expand<T, K>(Bs + k0, n_out, width, K, u.data(), ys, k0);
      if (k0 < n_out) expand<T, 0>(Bs + k0, n_out, width, n_out - k0, u.data(), ys, k0);
    }
  }
}

#define LORA_ENTRY(NAME, T)                                                                                   \
  extern "C" void NAME(const void* x, int64_t x_stride, const void* A, const void* B, const void* scale,      \
                       const void* idx, int64_t rows, int64_t slots, int64_t width, int64_t n_in,            \
                       int64_t n_out, void* y, int64_t y_stride) {                                            \
    lora_delta<T>(static_cast<const T*>(x), x_stride, static_cast<const T*>(A), static_cast<const T*>(B),   \
                  static_cast<const T*>(scale), static_cast<const int64_t*>(idx), rows, slots, width, n_in,  \
                  n_out, static_cast<T*>(y), y_stride);                                                       \
  }

LORA_ENTRY(lora_delta_f32, float)
LORA_ENTRY(lora_delta_bf16, bf16)
LORA_ENTRY(lora_delta_f64, double)
