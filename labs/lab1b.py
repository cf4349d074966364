"""Lab 1b: the paged-attention Triton kernel, run on a CPU through Triton's interpreter, and a
batch-invariant split-KV reduction.

What it is: the lab's definition (see `labs/spec.py`): the body of
`_paged_attention_kernel` in `level1_paged/triton_attention.py` after its prologue (which
sequence and query block a program owns, and its query tile, stay): the walk over the
keys in tiles, the per-key block-table lookup, the causal mask, the online softmax and the
store. The checks are level 1's kernel tests and `labs/lab1b_checks.py` (fixed batches
whose unowned cache slots hold NaN, so reading a wrong key shows); the experiment
(`labs/lab1b_experiment.py`) compares tile sizes and counts the kernel's inner-loop work.
Step 2 (batch invariance, docs/batch_invariance.md): `attend_row` in
`level1_paged/attention_split.py`, one query row against its keys in splits of a fixed
size, merged in order; its checks run the invariance property (a row's bits alone, in a
chunk, in a batch) and a planted bug makes the split size depend on the query length.

What it is not: a GPU lab (everything runs under TRITON_INTERPRET=1; on a GPU the same
file compiles for real) or the handout (docs/labs/lab1b_kernel.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

K = "tests/test_level1_kernel.py::"
OWN = "labs/lab1b_checks.py::"

PARTS = (
    Part(
        "_paged_attention_kernel",
        keep_until="scale = tl.load(scale_ptr).to(ACC_DTYPE)",
        hint="""\
The rest of the kernel: this program's BLOCK_M query rows against its sequence's keys, in tiles.
(docs/level1_kernel.md; FlashAttention-2's online softmax; the picture at the top of this file)
1. Online softmax state, in ACC_DTYPE: m [BLOCK_M] = -inf (running max), l [BLOCK_M] = 0 (running sum
   of exp), acc [BLOCK_M, HEAD_DIM_PADDED] = 0 (running sum of exp * v).
2. Causal skip: the last real query of this block is at q_pos = min((q_block_local + 1) * BLOCK_Q,
   query_len) - 1; it sees context_len + that + 1 keys, so loop over tl.cdiv(num_keys, TILE_SIZE) tiles.
3. For each tile: k_pos = tile * TILE_SIZE + offs_t, k_ok = k_pos < num_keys.
   The physical block of each key: tl.load(block_tables_ptr + seq * stride_bt_seq + k_pos // BLOCK_SIZE,
   mask=k_ok, other=0), as int64; its slot in the block: k_pos % BLOCK_SIZE.
   Load K as [D_PAD, TILE] (transposed, ready for tl.dot(Q, K)) and V as [TILE, D_PAD] with the
   strides, masked by dim_ok and k_ok (other=0.0), and upcast both right after the load (.to(ACC_DTYPE)).
   S = tl.dot(Q, K, input_precision=DOT_PRECISION) * scale; a row sees key k_pos iff row_ok and
   k_pos <= context_len + q_pos; -inf elsewhere.
   m_new = max(m, row max of S); subtract m_new (or 0 where m_new is still -inf: padding rows) before
   tl.exp; alpha = exp(m - m_new) rescales what was summed under the old max: l = l * alpha + sum(P),
   acc = acc * alpha + tl.dot(P, V); m = m_new.
4. out = acc / l (l is 0 only on padding rows: use 1 there), stored at q_tok rows and q_head heads, in
   out_ptr's dtype (out.to(out_ptr.dtype.element_ty)), masked by row_ok and dim_ok.""",
    ),
)

SPLIT_PARTS = (
    Part(
        "attend_row",
        hint="""\
One query row q [Hq, D] against its first num_keys keys k, v [L, Hq, D] -> out [Hq, D], in splits of
split_size keys cut at FIXED positions (0, S, 2S, ...) and merged left to right (the picture at the top
of this file; FlashAttention's online softmax, one split at a time).
1. Running state, in q's dtype: m [Hq] = -inf, l [Hq] = 0, a [Hq, D] = 0.
2. For start in 0, S, 2S, ... < num_keys: the split's partial m_j, l_j, a_j = split_partial(q, k[start:end],
   v[start:end], scale); m_new = max(m, m_j); rescale what you have and what the split brings to m_new
   (exp(m - m_new), exp(m_j - m_new)) before adding; m = m_new.
3. out = a / l.""",
    ),
)

CHECKS = (
    Check("decode", "decodes through shuffled block tables equal the oracle",
          (OWN + "test_decodes",),
          "One query per sequence over its whole context, itself included: it sees every key with k_pos <= "
          "context_len + q_pos (<=, not <). Look up each key's physical block through the table "
          "(k_pos // BLOCK_SIZE) and its slot (k_pos % BLOCK_SIZE); a NaN in the output means a key outside "
          "the sequence was read (mask the loads with k_ok).",
          rule="A decode query attends to its sequence's whole context, itself included, and reads only keys of its "
               "own sequence, found through its block table."),
    Check("prefill-chunk", "a prefill chunk over a cached context (causal, several q blocks and tiles)",
          (OWN + "test_prefill_chunk_over_a_cached_context",),
          "Query row r is token q_pos = q_block_local * BLOCK_Q + r // G of the chunk, at position context_len + "
          "q_pos: it sees keys k_pos <= context_len + q_pos. Across tiles keep the online softmax exact: when the "
          "max grows, rescale l and acc by exp(m_old - m_new).",
          rule="Each query of a chunk sees the cached context and the chunk's tokens up to and including itself; a "
               "softmax computed tile by tile must equal the softmax over all keys at once."),
    Check("tiles-and-blocks", "tile and block sizes are independent (bs 1, bs 32 with tile 16, head dim 80)",
          (OWN + "test_tiles_and_blocks_are_independent",),
          "A tile may span several blocks (bs < TILE) or part of one (bs > TILE): look the block up per key, "
          "never per tile. Head dims that are not powers of two are padded: mask the loads with dim_ok.",
          rule="The tile size and the block size are independent: a key is found through its own block whatever tile "
               "it falls in, and padding (of a tile or of the head dimension) contributes nothing."),
    Check("dtypes", "fp16/bf16 inputs are upcast after every load; the output has q's dtype",
          (OWN + "test_half_precision_inputs", K + "test_triton_default_entry_point_and_bf16"),
          "The interpreter has no bf16 arithmetic: .to(ACC_DTYPE) right after each tl.load, and store "
          "out.to(out_ptr.dtype.element_ty).",
          rule="The arithmetic runs in the accumulation precision whatever the inputs' dtype, and the output comes "
               "back in the query's dtype."),
    Check("engine-order", "write K/V, then attend (the engine's order)", (K + "test_write_then_attend_matches_dense",
                                                                           K + "test_triton_empty_batch"),
          "After write_kv_cache_triton put the new tokens' K/V in their slots, attention over them must equal "
          "dense causal attention.",
          rule="Attention must read the cache exactly as the engine's writer laid it out: over freshly written keys "
               "and values it equals dense causal attention."),
    Check("split-oracle", "split-KV attention equals the oracle (decodes and chunks; splits of 1, 5, 16, 1000 keys)",
          (OWN + "test_split_attention_equals_the_oracle", K + "test_split_attention_matches_ref"),
          "Merging two partial softmaxes: both are rescaled to the larger max before they are added, l and a "
          "alike; a split of one key, or one split longer than the row, must work too.",
          rule="Split-KV attention is exact: merging partial results computed under different maxima gives the "
               "softmax over all the keys at once."),
    Check("split-invariance", "a row's bits do not depend on the batch, the chunk or the query length",
          (OWN + "test_split_attention_is_batch_invariant", K + "test_split_attention_rows_are_batch_invariant"),
          "Cut the keys at positions that depend on the row's position alone (0, S, 2S, ... with S = split_size, "
          "whatever the query length) and merge the splits in order.",
          rule="A row's result depends only on its own query and keys: a decode, a row of a prefill chunk and a row "
               "in a larger batch give identical bits."),
)  # fmt: skip

BUGS = (
    Bug(
        "split-by-query-length",
        "level1_paged.attention_split",
        "attend_row(row, k, v, context_len + r + 1, scale, split_size)",
        "attend_row(row, k, v, context_len + r + 1, scale, split_size * query_len)",  # bigger tiles for prefills
        ("split-invariance",),
    ),
    Bug(
        "no-rescale",
        "level1_paged.triton_attention",
        "        acc = acc * alpha[:, None] + tl.dot(P, V, input_precision=DOT_PRECISION)\n",
        "        acc = acc + tl.dot(P, V, input_precision=DOT_PRECISION)\n",
        ("prefill-chunk",),
    ),
    Bug(
        "mask-off-by-one",
        "level1_paged.triton_attention",
        "        visible = row_ok[:, None] & (k_pos[None, :] <= context_len + q_pos[:, None])\n",
        "        visible = row_ok[:, None] & (k_pos[None, :] < context_len + q_pos[:, None])\n",
        ("decode", "prefill-chunk"),
    ),
)

LAB = Lab(
    id="1b",
    topic="the paged-attention Triton kernel, under the interpreter",
    handout="lab1b_kernel.md",
    modules=(Module("level1_paged.triton_attention", PARTS), Module("level1_paged.attention_split", SPLIT_PARTS)),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment(
        "labs.lab1b_experiment",
        (),
        (
            "--contexts",
            "8",
            "--chunk",
            "4",
            "--chunk-context",
            "8",
            "--tiles",
            "16",
            "--block-sizes",
            "4",
            "--head-dim",
            "16",
        ),
    ),  # fmt: skip
    minutes=150,
)
