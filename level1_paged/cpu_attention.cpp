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
//   The loop nest, for one sequence b (sequences run one after another):
//
//     rows = (query row r, query head h) pairs   1 x Hq for a decode, (k+1) x Hq for a verification
//     for j, blk in enumerate(block_tables[b]):  pass 1: K, in place, block by block
//       for off < bs, t = j * bs + off < seq_len:   key t: the slot k_cache[blk, off] = [Hkv, D]
//         for each row (r, h) that sees key t       (t <= context_len + r: the causal rule)
//           s[r, h][t] = scale * dot(q[r, h], slot[h / G])    G query heads share a KV head
//     p[r, h][t] = exp(s - max) / sum            pass 2: the exact softmax, in the accumulator type
//     out[r, h] = sum_t p[r, h][t] * v_cache[blk, off][h / G]   pass 3: V, the same walk
//
//   A block is bs slots of [Hkv, D] in a row, so each pass reads it front to back, once, for
//   every head and every query row: the G heads that share a KV head, and the k+1 rows of a
//   verification, share each load. (Walking one KV head at a time instead read every other
//   256 bytes of a block and was 2-3x slower once the cache no longer fit in L2.) The scores
//   of one sequence fit in a small buffer, so the softmax is the exact three-pass one, not
//   the online one the GPU kernel needs to stay in registers.
//
//   Accumulation is in float for float and bfloat16 inputs, double for double, like the
//   other backends. Each dot product and weighted sum runs in an order fixed at compile
//   time whatever the batch: a row's result depends only on its own query, keys, values.
//
// What this is not
//   Not a matrix-matrix kernel: each (row, key) pair is one dot product, so a long query
//   loses to SDPA's blocked matmuls (cpu_attention.py sends queries over LONG_QUERY tokens
//   there), not threaded (one task after another:
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

// dot(q, k) over D values: 32 partial sums (four vector registers of 8 floats on AVX2) break the
// chain of dependent adds one accumulator would make, then one fixed tree adds them up. The
// order depends only on D, never on the batch.
template <typename T, typename A>
static inline A dot(const A* q, const T* k, int64_t D) {
  constexpr int W = 32;
  A part[W] = {};
  int64_t d = 0;
  for (; d + W <= D; d += W)
#pragma omp simd
    for (int i = 0; i < W; ++i) part[i] += q[d + i] * widen(k[d + i]);
  for (int i = 0; d < D; ++d, ++i) part[i] += q[d] * widen(k[d]);  // the tail, when D % 32 != 0
  for (int w = W / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) part[i] += part[i + w];
  return part[0];
}

template <typename T, typename A>
static void attend(const T* q, const T* k_cache, const T* v_cache,  // [T, Hq, D], [N, bs, Hkv, D] x2
                   const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_tables,  // [B+1], [B], [B, W]
                   int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, double scale_d,
                   T* out) {  // [T, Hq, D]
  const int64_t G = Hq / Hkv;  // query heads per KV head: query head h reads KV head h / G
  const A scale = static_cast<A>(scale_d);
  const int64_t slot_size = Hkv * D;  // one slot holds every KV head's key: [Hkv, D], contiguous
  std::vector<A> qf, acc, row_max, row_sum, scores;  // one sequence's query rows x heads

  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_start = query_start_loc[b], query_len = query_start_loc[b + 1] - q_start;
    const int64_t seq_len = seq_lens[b], context_len = seq_len - query_len;
    const int64_t R = query_len * Hq;  // (query row, head) pairs: "rows" below; row i = (i / Hq, i % Hq)
    const int32_t* table = block_tables + b * W;
    qf.resize(R * D);
    acc.assign(R * D, A(0));
    row_max.assign(R, -std::numeric_limits<A>::infinity());
    row_sum.assign(R, A(0));
    scores.resize(R * seq_len);
    for (int64_t i = 0; i < R * D; ++i) qf[i] = widen(q[q_start * Hq * D + i]);

    // Pass 1: scores against every visible key, read in place, block by block. A block is bs
    // slots of [Hkv, D] in a row, so the walk reads it front to back, once, for all rows.
    for (int64_t j = 0, t = 0; t < seq_len; ++j) {
      const T* slot = k_cache + int64_t(table[j]) * bs * slot_size;  // block j's first slot
      for (int64_t off = 0; off < bs && t < seq_len; ++off, ++t, slot += slot_size) {
        for (int64_t r = std::max<int64_t>(0, t - context_len); r < query_len; ++r) {  // rows that see key t
          for (int64_t h = 0; h < Hq; ++h) {
            const int64_t i = r * Hq + h;
            const A s = dot(qf.data() + i * D, slot + (h / G) * D, D) * scale;
            scores[i * seq_len + t] = s;
            row_max[i] = s > row_max[i] ? s : row_max[i];
          }
        }
      }
    }
    // Pass 2: the softmax's numerators and sum, over the n = context_len + r + 1 keys row r sees.
    for (int64_t i = 0; i < R; ++i) {
      A* s = scores.data() + i * seq_len;
      const int64_t n = context_len + i / Hq + 1;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - row_max[i]);
        row_sum[i] += s[t];
      }
    }
    // Pass 3: the probability-weighted sum of the values, read in place, the same walk.
    for (int64_t j = 0, t = 0; t < seq_len; ++j) {
      const T* slot = v_cache + int64_t(table[j]) * bs * slot_size;
      for (int64_t off = 0; off < bs && t < seq_len; ++off, ++t, slot += slot_size) {
        for (int64_t r = std::max<int64_t>(0, t - context_len); r < query_len; ++r) {
          for (int64_t h = 0; h < Hq; ++h) {
            const int64_t i = r * Hq + h;
            const A p = scores[i * seq_len + t];
            const T* value = slot + (h / G) * D;
            A* a = acc.data() + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * widen(value[d]);
          }
        }
      }
    }
    for (int64_t i = 0; i < R; ++i) {
      T* o = out + q_start * Hq * D + i * D;  // row q_start + i / Hq, head i % Hq
      const A inv = A(1) / row_sum[i];
      for (int64_t d = 0; d < D; ++d) o[d] = narrow<T, A>(acc[i * D + d] * inv);
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
