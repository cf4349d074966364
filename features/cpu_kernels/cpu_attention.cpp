// Paged attention for the CPU, compiled: the loop nest the Triton kernel runs, in plain C++.
//
// What this is
//   paged_attention_{f32,f64,bf16}(q, k_cache, v_cache, query_start_loc, seq_lens,
//   block_tables, sizes..., scale, out): the contract of level1_paged/attention_ref.py
//   (read its docstring for the metadata) on raw pointers to contiguous tensors. It reads
//   every key and value IN PLACE through the block table: no gather into a contiguous copy,
//   no GQA copies, one call per layer for decodes, prefill chunks and verifications alike.
//   write_kv_{f32,f64,bf16} stores a step's new keys and values in their slots first.
//   cpu_attention.py builds this file once (level0_naive/native.py) and calls it through ctypes.
//
//   The loop nest, for one sequence b (sequences run one after another):
//
//     rows = (query row r, query head h) pairs   1 x Hq for a decode, (k+1) x Hq for a verification
//     for j, blk in enumerate(block_tables[b]):  pass 1: K, in place, one block at a time
//       for each row (r, h) that sees block j's keys   (key t is seen if t <= context_len + r)
//         for the keys t of blk it sees, four at a time:   slot blk, off holds [Hkv, D]
//           s[r, h][t] = scale * dot(q[r, h], k_cache[blk, off, h / G])   G query heads per KV head
//     p[r, h][t] = exp(s - max) / sum            pass 2: the exact softmax, in the accumulator type
//     out[r, h] = sum_t p[r, h][t] * v_cache[blk, off, h / G]   pass 3: V, the same walk
//
//   A block is bs slots of [Hkv, D] in a row (8 KiB for 16 slots of 2 x 64 floats): it stays
//   in the L1 cache while every row and head that reads it does. Query rows go ROWS (16) at a
//   time, so a long prefill's scores take 16 x Hq x seq_len values, not query_len x Hq x seq_len. In pass 1 four keys are
//   scored at once (four independent chains of adds, so the CPU overlaps them); in pass 3 a
//   row's D accumulators stay in registers over the block.
//
// The order of every sum is fixed (batch invariance)
//   A score is the dot product of two D-vectors in 32-byte lanes (8 floats or 4 doubles,
//   whatever the CPU's widest vector: the same order on every machine): lane l adds up
//   d = l, l + 8, l + 16, ... in order, then the lanes add in one fixed tree. The softmax's
//   sum and pass 3's weighted sum run over keys t = 0, 1, 2, ... in order. Which keys a row
//   sees depends only on its absolute position, and -ffp-contract=off keeps every a * b + c
//   two roundings on every path. So a row's output depends only on its own query, keys and
//   values: not on how many other rows or sequences are in the batch, how the prompt was
//   chunked, or whether the row is a decode, a chunk or a verification. This is what
//   `batch_invariant=True` relies on (docs/batch_invariance.md).
//
// What this is not
//   Not a matrix-matrix kernel: each (row, key) pair is one dot product. Against the torch
//   backend it is 1.7-3.3x as fast on decodes, 1.1-2.3x on queries of up to 8 tokens, 1.1-2x
//   on prefills from the start, and 0.6-0.9x for a chunk of 16+ tokens over a longer cached
//   context (cpu_attention.py routes those to SDPA; its LONG_QUERY comment has the figures).
//   Not threaded (the engine's matmuls own the threads), no
//   float16 (the torch backend takes it), no split-KV, sliding windows, ALiBi or soft-capping,
//   and no intrinsics: GCC's vector extensions compile to SSE, AVX or NEON.
//
// 8-bit caches (kv_cache_dtype: features/quantization/kv.py)
//   paged_attention_{f32,f64,bf16}_{i8,f8} read the cache's bytes in place, the same walk:
//   "i8": each head's D int8 values and then its float32 scale (a head's slot is D + 4 bytes);
//   "f8": float8 e4m3 bytes (a 256-entry table widens them) and one scale per layer for K, one
//   for V. Each block is widened once per tile of rows into a block-sized buffer (each value
//   times its scale), which every row and head of the tile then reads as the float walk reads
//   a float block: no copy of the cache is made, only of the block in hand.
//
// Reference: vLLM's csrc/cpu/attention.cpp (its CPU paged attention, much more tuned),
// Kwon et al. SOSP 2023 section 4.1; He et al., "Defeating Nondeterminism in LLM Inference"
// (Thinking Machines, 2025) for the fixed reduction order.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16.h"  // bf16, widen, narrow: the one copy the kernels share

// The 8-bit caches' elements: int8 widens as itself; an e4m3 byte through a table of its 256 values.
struct fp8 {
  uint8_t b;
};
static float FP8_TABLE[256];
static const bool FP8_TABLE_FILLED = [] {  // e4m3 ("fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);  // subnormal, or normal
    if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
    FP8_TABLE[b] = (b & 128) ? -v : v;
  }
  return true;
}();
static inline float widen(int8_t x) { return float(x); }
static inline float widen(fp8 x) { return FP8_TABLE[x.b]; }

// How a cache stores a head: Q = 0 the model's dtype (a head is D values), 1 int8 with its float32
// scale after its D bytes, 2 fp8 with one scale for the layer. An 8-bit block is widened once,
// into `out` [bs, Hkv, D] in the accumulator type (each value times its scale: the dequantized
// values the torch backend computes), and read from there by every row and head of the tile.
template <int Q, typename A, typename C>
static inline const A* dequantize_block(const C* blk, int64_t bs, int64_t Hkv, int64_t D, A layer_scale, A* out) {
  const int64_t HS = Q == 1 ? D + 4 : D;
  for (int64_t t = 0; t < bs * Hkv; ++t) {  // every (slot, head) of the block
    const C* h = blk + t * HS;
    A s = layer_scale;
    if constexpr (Q == 1) {
      float f;
      std::memcpy(&f, reinterpret_cast<const char*>(h + D), sizeof f);
      s = A(f);
    }
    A* o = out + t * D;
    for (int64_t d = 0; d < D; ++d) o[d] = A(widen(h[d])) * s;
  }
  return out;
}

// 32 bytes of lanes: 8 floats or 4 doubles.
template <typename A> struct Lanes {
  typedef A vec __attribute__((vector_size(32)));
  static constexpr int N = 32 / sizeof(A);
};

template <typename A, typename T>
static inline typename Lanes<A>::vec load(const T* p) {  // N values, widened to the accumulator type
  typename Lanes<A>::vec v;
  for (int i = 0; i < Lanes<A>::N; ++i) v[i] = widen(p[i]);
  return v;
}

template <typename A>
static inline A lane_sum(typename Lanes<A>::vec v) {  // the fixed tree: lane i += lane i + w, w = N/2, N/4, ..., 1
  constexpr int N = Lanes<A>::N;
  A s[N];
  std::memcpy(s, &v, sizeof v);
  for (int w = N / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) s[i] += s[i + w];
  return s[0];
}

// dot(q, k) over D in the fixed order above; `dot4` computes four of them at once, each in
// exactly the operations `dot1` does (so a key's score never depends on its neighbours).
template <typename A, typename T>
static inline A dot1(const A* q, const T* k, int64_t D) {
  constexpr int N = Lanes<A>::N;
  typename Lanes<A>::vec a = {};
  int64_t d = 0;
  for (; d + N <= D; d += N) a += load<A>(q + d) * load<A>(k + d);
  for (int i = 0; d < D; ++d, ++i) a[i] += q[d] * widen(k[d]);  // the tail, when D % N != 0
  return lane_sum<A>(a);
}
template <typename A, typename T>
static inline void dot4(const A* q, const T* k, int64_t stride, int64_t D, A* out) {  // keys k, k + stride, ...
  constexpr int N = Lanes<A>::N;
  typename Lanes<A>::vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const T *k1 = k + stride, *k2 = k1 + stride, *k3 = k2 + stride;
  int64_t d = 0;
  for (; d + N <= D; d += N) {
    const typename Lanes<A>::vec qv = load<A>(q + d);
    a0 += qv * load<A>(k + d);
    a1 += qv * load<A>(k1 + d);
    a2 += qv * load<A>(k2 + d);
    a3 += qv * load<A>(k3 + d);
  }
  for (int i = 0; d < D; ++d, ++i) {
    a0[i] += q[d] * widen(k[d]);
    a1[i] += q[d] * widen(k1[d]);
    a2[i] += q[d] * widen(k2[d]);
    a3[i] += q[d] * widen(k3[d]);
  }
  out[0] = lane_sum<A>(a0), out[1] = lane_sum<A>(a1), out[2] = lane_sum<A>(a2), out[3] = lane_sum<A>(a3);
}

// Ask the memory system for a cache block before the walk reaches it: `bytes` from p, a 64-byte line at
// a time. The blocks of a sequence lie anywhere in the pool, so the hardware's prefetcher, which follows
// one address stream within a page, starts each block cold, and a decode's arithmetic per block is short
// (a few hundred nanoseconds). In an engine's step the cache is never hot (a step reads every running
// request's K and V once, 25 MB at batch 64 for the built-in model): measured on a 2-core EPYC, the
// calls of a batch-64 decode (context 57) took 342-349 us a layer without it and 249-287 with it, the
// loop alone with its blocks hot 126 us (142 with the prefetches): about 0.5 ms of a 13 ms step, which
// `python -m benchmarks.profile --batches 16,64 --compiled` run three times each way put within its noise
// (13.3-13.5 ms before, 12.5-13.5 after). A prefetch reads nothing into a register: it changes no result.
static inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Query rows are taken ROWS at a time, so the score buffer is ROWS x Hq x seq_len values
// whatever the prompt's length (an 8K-token prefill of a 32-head model in one piece would
// need 8 GiB of scores). Every row's own arithmetic is the same in any tile.
constexpr int64_t ROWS = 16;

template <typename T, typename A, typename C = T, int Q = 0>
static void attend(const T* q, const C* k_cache, const C* v_cache,  // [T, Hq, D], [N, bs, Hkv, HS] x2
                   const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_tables,  // [B+1], [B], [B, W]
                   int64_t num_seqs, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, double scale_d,
                   T* out, double k_scale_d = 1, double v_scale_d = 1) {  // [T, Hq, D]; the fp8 layer scales
  using vec = typename Lanes<A>::vec;
  constexpr int N = Lanes<A>::N;
  const int64_t G = Hq / Hkv;  // query heads per KV head: query head h reads KV head h / G
  const A scale = static_cast<A>(scale_d), k_scale = static_cast<A>(k_scale_d), v_scale = static_cast<A>(v_scale_d);
  const int64_t HS = Q == 1 ? D + 4 : D;  // a head's elements in a cache slot (int8: its values, then 4 bytes of scale)
  const int64_t block_bytes = bs * Hkv * HS * int64_t(sizeof(C));
  const int64_t slot = Hkv * D;  // one slot holds every KV head's key: [Hkv, D], contiguous (an 8-bit block: widened)
  using E = std::conditional_t<Q == 0, T, A>;  // what the walk reads: the cache itself, or a widened block
  std::vector<A> widened(Q == 0 ? 0 : bs * Hkv * D);
  std::vector<A> qf, acc, scores, row_max, row_sum;  // one tile's rows (query row x head)

  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_start = query_start_loc[b], query_len = query_start_loc[b + 1] - q_start;
    const int64_t seq_len = seq_lens[b], context_len = seq_len - query_len;
    const int32_t* table = block_tables + b * W;
    for (int64_t r0 = 0; r0 < query_len; r0 += ROWS) {  // query rows r0 .. r1 - 1 of this sequence
      const int64_t r1 = std::min(r0 + ROWS, query_len);
      const int64_t R = (r1 - r0) * Hq;       // rows; row i = (query row r0 + i / Hq, head i % Hq)
      const int64_t keys = context_len + r1;  // the most any of them sees
      qf.resize(R * D);
      acc.assign(R * D, A(0));
      scores.resize(R * keys);
      row_max.assign(R, -std::numeric_limits<A>::infinity());
      row_sum.resize(R);
      for (int64_t i = 0; i < R * D; ++i) qf[i] = widen(q[(q_start + r0) * Hq * D + i]);

      // Pass 1: scores, block by block, and each row's running maximum.
      for (int64_t j = 0, t0 = 0; t0 < keys; ++j, t0 += bs) {  // block j holds keys t0 .. t0 + bs - 1
        const C* cached = k_cache + int64_t(table[j]) * bs * Hkv * HS;
        // the next block this walk reads: K's next, or V's first for pass 3
        const C* next = t0 + bs < keys ? k_cache + int64_t(table[j + 1]) * bs * Hkv * HS
                                       : v_cache + int64_t(table[0]) * bs * Hkv * HS;
        prefetch(next, block_bytes);
        const E* blk;
        if constexpr (Q == 0) blk = cached;
        else blk = dequantize_block<Q, A, C>(cached, bs, Hkv, D, k_scale, widened.data());
        for (int64_t r = std::max(r0, t0 - context_len); r < r1; ++r) {  // rows that see key t0
          const int64_t seen = std::min({bs, seq_len - t0, context_len + r + 1 - t0});  // of this block's keys
          for (int64_t h = 0; h < Hq; ++h) {
            const int64_t i = (r - r0) * Hq + h;
            const E* k = blk + (h / G) * D;
            A* s = scores.data() + i * keys + t0;
            int64_t off = 0;
            for (; off + 4 <= seen; off += 4) dot4<A, E>(qf.data() + i * D, k + off * slot, slot, D, s + off);
            for (; off < seen; ++off) s[off] = dot1<A, E>(qf.data() + i * D, k + off * slot, D);
            A m = row_max[i];
            for (off = 0; off < seen; ++off) {
              s[off] *= scale;
              m = s[off] > m ? s[off] : m;
            }
            row_max[i] = m;
          }
        }
      }
      // Pass 2: the numerators, and their sum over the n = context_len + r + 1 keys row r sees
      // (lanes of t mod N, then the fixed tree: the order depends on n alone).
      for (int64_t i = 0; i < R; ++i) {
        A* s = scores.data() + i * keys;
        const int64_t n = context_len + r0 + i / Hq + 1;
        for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - row_max[i]);
        vec part = {};
        int64_t t = 0;
        for (; t + N <= n; t += N) part += load<A>(s + t);
        for (int l = 0; t < n; ++t, ++l) part[l] += s[t];
        row_sum[i] = lane_sum<A>(part);
      }
      // Pass 3: the probability-weighted sum of the values, the same walk; per row and head,
      // 2N accumulators at a time stay in registers over a block's keys.
      for (int64_t j = 0, t0 = 0; t0 < keys; ++j, t0 += bs) {
        const C* cached = v_cache + int64_t(table[j]) * bs * Hkv * HS;
        if (t0 + bs < keys) prefetch(v_cache + int64_t(table[j + 1]) * bs * Hkv * HS, block_bytes);
        else if (r1 < query_len) prefetch(k_cache + int64_t(table[0]) * bs * Hkv * HS, block_bytes);  // the next tile's
        else if (b + 1 < num_seqs && seq_lens[b + 1] > 0)  // the next sequence's first K block
          prefetch(k_cache + int64_t(block_tables[(b + 1) * W]) * bs * Hkv * HS, block_bytes);
        const E* blk;
        if constexpr (Q == 0) blk = cached;
        else blk = dequantize_block<Q, A, C>(cached, bs, Hkv, D, v_scale, widened.data());
        for (int64_t r = std::max(r0, t0 - context_len); r < r1; ++r) {
          const int64_t seen = std::min({bs, seq_len - t0, context_len + r + 1 - t0});
          for (int64_t h = 0; h < Hq; ++h) {
            const int64_t i = (r - r0) * Hq + h;
            const A* p = scores.data() + i * keys + t0;
            const E* v = blk + (h / G) * D;
            A* a = acc.data() + i * D;
            int64_t d = 0;
            for (; d + 2 * N <= D; d += 2 * N) {
              vec a0 = load<A>(a + d), a1 = load<A>(a + d + N);
              for (int64_t off = 0; off < seen; ++off) {
                a0 += p[off] * load<A>(v + off * slot + d);
                a1 += p[off] * load<A>(v + off * slot + d + N);
              }
              std::memcpy(a + d, &a0, sizeof a0);
              std::memcpy(a + d + N, &a1, sizeof a1);
            }
            for (; d < D; ++d)  // the tail, when D % 2N != 0
              for (int64_t off = 0; off < seen; ++off) a[d] += p[off] * widen(v[off * slot + d]);
          }
        }
      }
      for (int64_t i = 0; i < R; ++i) {
        T* o = out + (q_start + r0) * Hq * D + i * D;  // row q_start + r0 + i / Hq, head i % Hq
        const A inv = A(1) / row_sum[i];
        for (int64_t d = 0; d < D; ++d) o[d] = narrow<T, A>(acc[i * D + d] * inv);
      }
    }
  }
}

// The new tokens' keys and values into their slots: k, v [T, Hkv, D] (rows `stride` apart, so a
// slice of a fused qkv output needs no copy), slot_mapping [T] -> k_cache, v_cache [N * bs, Hkv, D].
template <typename T>
static void write_kv(const T* k, const T* v, int64_t k_stride, int64_t v_stride, const int64_t* slots, int64_t num_tokens,
                     int64_t slot, T* k_cache, T* v_cache) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_cache + slots[t] * slot, k + t * k_stride, slot * sizeof(T));
    std::memcpy(v_cache + slots[t] * slot, v + t * v_stride, slot * sizeof(T));
  }
}

// The entry points cpu_attention.py calls (C names: no C++ mangling, so ctypes finds them).
#define ENTRY(SUFFIX, T, A)                                                                                     \
  extern "C" void paged_attention_##SUFFIX(const void* q, const void* k, const void* v, const int32_t* qsl,     \
                                           const int32_t* lens, const int32_t* tables, int64_t B, int64_t Hq,   \
                                           int64_t Hkv, int64_t D, int64_t bs, int64_t W, double scale,         \
                                           void* out) {                                                        \
    attend<T, A>(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), qsl, lens,      \
                 tables, B, Hq, Hkv, D, bs, W, scale, static_cast<T*>(out));                                    \
  }                                                                                                             \
  extern "C" void write_kv_##SUFFIX(const void* k, const void* v, int64_t k_stride, int64_t v_stride,           \
                                    const int64_t* slots, int64_t n, int64_t slot, void* kc, void* vc) {        \
    write_kv<T>(static_cast<const T*>(k), static_cast<const T*>(v), k_stride, v_stride, slots, n, slot,         \
                static_cast<T*>(kc), static_cast<T*>(vc));                                                      \
  }
ENTRY(f32, float, float)
ENTRY(f64, double, double)
ENTRY(bf16, bf16, float)

// The 8-bit caches' entry points: q and out in the model's dtype, the caches bytes.
#define ENTRY8(SUFFIX, T, A, KIND, C, Q)                                                                        \
  extern "C" void paged_attention_##SUFFIX##_##KIND(const void* q, const void* k, const void* v,               \
                                                    const int32_t* qsl, const int32_t* lens, const int32_t* tables, \
                                                    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,  \
                                                    int64_t W, double scale, double k_scale, double v_scale,    \
                                                    void* out) {                                               \
    attend<T, A, C, Q>(static_cast<const T*>(q), static_cast<const C*>(k), static_cast<const C*>(v), qsl, lens, \
                       tables, B, Hq, Hkv, D, bs, W, scale, static_cast<T*>(out), k_scale, v_scale);          \
  }
ENTRY8(f32, float, float, i8, int8_t, 1)
ENTRY8(f64, double, double, i8, int8_t, 1)
ENTRY8(bf16, bf16, float, i8, int8_t, 1)
ENTRY8(f32, float, float, f8, fp8, 2)
ENTRY8(f64, double, double, f8, fp8, 2)
ENTRY8(bf16, bf16, float, f8, fp8, 2)
