// Paged attention for the CPU, compiled: the loop nest the Triton kernel runs, in plain C++.
//
// What this is
//   paged_attention_{f32,f64,bf16}(q, k_cache, v_cache, query_start_loc, seq_lens,
//   block_tables, sizes..., scale, out): the contract of level1_paged/attention_ref.py
//   (read its docstring for the metadata) on raw pointers to contiguous tensors. It reads
//   every key and value IN PLACE through the block table: no gather into a contiguous copy,
//   no GQA copies, one call per layer for decodes, chunks and verifications alike.
//   cpu_attention.py compiles it once with the system's C++ compiler and calls it through
//   ctypes; it includes no torch header, so the build takes about a second, not a minute.
//
//   The loop nest, for one (sequence b, KV head h) task:
//
//     for r in query rows of b:                  (one for a decode, k+1 for a verification)
//       n = context_len + r + 1                  keys this row may see (the causal rule)
//       q_g = q[row, h*G + g] for g < G          the G query heads that share KV head h
//       for j, blk in enumerate(block_tables[b]) pass 1: scores, read K through the table
//         for off < bs, t = j * bs + off < n:    key t lives in block blk at offset off
//           s[g][t] = scale * dot(q_g, k_cache[blk, off, h])   for every g
//       p[g][t] = exp(s[g][t] - max_g) / sum_g   pass 2: softmax, in the accumulator type
//       out[row, h*G + g] = sum_t p[g][t] * v_cache[blk, off, h]   pass 3: V, the same walk
//
//   Sharing the G heads' loop means each key and value is loaded once per row, not G
//   times (what GQA is for). The scores of one row fit in a small buffer (n values per
//   head), so the softmax is the exact three-pass one, not the online one the GPU kernel
//   needs to stay in registers: a CPU has the cache for it and the code reads simpler.
//
//   Accumulation is in float for float and bfloat16 inputs, double for double, like the
//   other backends. Each dot product and weighted sum runs in an order fixed at compile
//   time whatever the batch: a row's result depends only on its own query, keys, values.
//
// What this is not
//   Not tiled over query rows (a long prefill re-reads K per row: cpu_attention.py sends
//   long queries to SDPA, which is faster there), not threaded (one task after another:
//   the engine's matmuls own the threads), no float16 (the torch backend takes it), no
//   split-KV, sliding windows, ALiBi, soft-capping or quantised KV, and no intrinsics:
//   `#pragma omp simd` with -O3 lets the compiler vectorise the D-long loops for whatever
//   CPU builds it.
//
// Reference: vLLM's csrc/cpu/attention.cpp (its CPU paged attention, much more tuned),
// Kwon et al. SOSP 2023 section 4.1.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest even
// (what torch's .to(torch.bfloat16) does).
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
template <> inline bf16 narrow<bf16, float>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) return bf16{uint16_t(0x7fc0)};
  u += 0x7fff + ((u >> 16) & 1);
  return bf16{uint16_t(u >> 16)};
}

template <typename T, typename A>
static void attend(const T* q, const T* k_cache, const T* v_cache,  // [T, Hq, D], [N, bs, Hkv, D] x2
                   const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_tables,  // [B+1], [B], [B, W]
                   int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, double scale_d,
                   T* out) {  // [T, Hq, D]
  const int64_t G = Hq / Hkv;  // query heads per KV head
  const A scale = static_cast<A>(scale_d);
  const int64_t slot_stride = Hkv * D;  // from one slot's key for head h to the next slot's
  std::vector<A> qf(G * D), acc(G * D), row_max(G), row_sum(G), scores;  // one row's G heads

  for (int64_t task = 0; task < num_seqs * Hkv; ++task) {
    const int64_t b = task / Hkv, h = task % Hkv;
    const int64_t q_start = query_start_loc[b], query_len = query_start_loc[b + 1] - q_start;
    const int64_t seq_len = seq_lens[b], context_len = seq_len - query_len;
    const int32_t* table = block_tables + b * W;
    scores.resize(G * seq_len);
    for (int64_t r = 0; r < query_len; ++r) {
      const int64_t row = q_start + r, n = context_len + r + 1;  // n keys visible to this row
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = widen(q[(row * Hq + h * G + g) * D + d]);

      // Pass 1: scores against every visible key, read in place, block by block.
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<A>::infinity());
      for (int64_t j = 0, t = 0; t < n; ++j) {
        const T* key = k_cache + (int64_t(table[j]) * bs * Hkv + h) * D;  // block j's first key, head h
        for (int64_t off = 0; off < bs && t < n; ++off, ++t, key += slot_stride) {
          for (int64_t g = 0; g < G; ++g) {
            const A* qg = qf.data() + g * D;
            A dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * widen(key[d]);
            const A s = dot * scale;
            scores[g * seq_len + t] = s;
            row_max[g] = s > row_max[g] ? s : row_max[g];
          }
        }
      }
      // Pass 2: the softmax's numerators and sum.
      std::fill(row_sum.begin(), row_sum.end(), A(0));
      for (int64_t g = 0; g < G; ++g) {
        A* s = scores.data() + g * seq_len;
        for (int64_t t = 0; t < n; ++t) {
          s[t] = std::exp(s[t] - row_max[g]);
          row_sum[g] += s[t];
        }
      }
      // Pass 3: the probability-weighted sum of the values, read in place, the same walk.
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t j = 0, t = 0; t < n; ++j) {
        const T* value = v_cache + (int64_t(table[j]) * bs * Hkv + h) * D;
        for (int64_t off = 0; off < bs && t < n; ++off, ++t, value += slot_stride) {
          for (int64_t g = 0; g < G; ++g) {
            const A p = scores[g * seq_len + t];
            A* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * widen(value[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (row * Hq + h * G + g) * D;
        const A inv = A(1) / row_sum[g];
        for (int64_t d = 0; d < D; ++d) o[d] = narrow<T, A>(acc[g * D + d] * inv);
      }
    }
  }
}

// The three entry points cpu_attention.py calls (C names: no C++ mangling, so ctypes finds them).
#define ENTRY(NAME, T, A)                                                                                    \
  extern "C" void NAME(const void* q, const void* k, const void* v, const int32_t* qsl, const int32_t* lens, \
                       const int32_t* tables, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,      \
                       int64_t W, double scale, void* out) {                                                 \
    attend<T, A>(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), qsl, lens,   \
                 tables, B, Hq, Hkv, D, bs, W, scale, static_cast<T*>(out));                                 \
  }
ENTRY(paged_attention_f32, float, float)
ENTRY(paged_attention_f64, double, double)
ENTRY(paged_attention_bf16, bf16, float)
