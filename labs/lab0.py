"""Lab 0: the KV cache and causal attention over it (level 0's contiguous slabs).

What it is: the lab's definition (see `labs/spec.py`): `causal_attention` and
`SlabAttention.__call__` / `commit` in `level0_naive/kv_cache.py`, the checks (level 0's
own tests, including the logits against Hugging Face, and `labs/lab0_checks.py`), the
planted bug (a causal mask that forgets the cached context), and the experiment: level 0's
KV waste on a spread workload (`python -m level0_naive.demo` with the student's cache).

What it is not: the handout (docs/labs/lab0_kv_cache.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L0 = "tests/test_level0.py::"
OWN = "labs/lab0_checks.py::"

PARTS = (
    Part(
        "causal_attention",
        """\
Dense attention of n new queries over a contiguous context (docs/level0_naive.md):
  GQA: each of the Hkv key/value heads serves Hq // Hkv query heads (repeat_interleave along dim 1).
  Compute in float32 at least (torch.promote_types(q.dtype, torch.float32)), and cast back at the end.
  scores [Hq, n, S] = q . k * D**-0.5 (torch.einsum is the plainest way to write it).
  The causal mask is offset by what was cached before: query i sits at position context_len + i,
  and may see keys 0 .. context_len + i; later keys get -inf before the softmax.
  softmax over the keys, then the weighted sum of v -> [n, Hq, D].""",
    ),
    Part(
        "SlabAttention.__call__",
        """\
One layer of one forward over the flattened batch. For each sequence (self.slabs and self.spans
line up: sequence i owns rows s:e of q, k and v, n = e - s new tokens):
  the slab already holds ctx = slab.used tokens; write this layer's new k and v after them
  (slab.k[layer, ctx : ctx + n], the same for v), then attend the sequence's queries over the slab's
  first ctx + n keys with causal_attention (the context length is ctx).
Return out [T, Hq, D]. Do not advance slab.used here: every layer writes to the same positions, and
the tokens count as cached only once the whole forward is done (commit).""",
    ),
    Part(
        "SlabAttention.commit",
        """\
After the forward (all layers): the new tokens are now part of every slab's context: slab.used grows
by each sequence's n.""",
    ),
)

CHECKS = (
    Check("offset-mask", "the causal mask is offset by the cached context",
          (L0 + "test_causal_attention_offset_against_full_recompute", OWN + "test_a_decode_sees_the_whole_context"),
          "Query i of a chunk sits at position context_len + i: it sees keys 0 .. context_len + i. A mask built "
          "from i alone is right for a prefill from an empty cache (so the logits check still passes) and wrong "
          "for every decode.",
          rule="A query sits after everything already cached: it may see every earlier token of its sequence, the "
               "cached ones included, and no later one. A decode sees the whole context."),
    Check("attention", "causal_attention equals softmax(q k^T / sqrt(D)) v, GQA included",
          (OWN + "test_causal_attention_equals_dense_attention",),
          "Compare with the formula: scale by D**-0.5, -inf above the (offset) diagonal, softmax over the keys. "
          "GQA: query head h reads KV head h // (Hq // Hkv), which is what repeat_interleave gives (repeat "
          "interleaves the wrong way). Compute in float32 or wider and return q's dtype.",
          rule="Attention is the softmax of the scaled query-key scores over the keys a query may see, weighting the "
               "values; under GQA each group of neighbouring query heads shares one key/value head. The arithmetic is at "
               "least float32."),
    Check("slab-writes", "a forward writes each layer's new K/V at slab.used and attends over the prefix",
          (OWN + "test_prefill_then_decodes_equal_one_forward",),
          "Write layer L's new k/v to slab.k[L, used : used + n] and attend over slab.k[L, : used + n]. Advance "
          "slab.used in commit() only, once per forward: advancing it per layer shifts every later layer.",
          rule="Each layer stores its new keys and values after what the cache already holds and attends over all of "
               "it; the cache's length grows once per forward, when every layer is done, not once per layer."),
    Check("batch", "sequences of one flattened batch stay apart", (OWN + "test_sequences_in_one_batch_stay_apart",),
          "Sequence i owns rows query_start_loc[i] : query_start_loc[i+1] of q, k, v, and only its own slab.",
          rule="Sequences in one flattened batch are independent: each reads only its own rows and its own cache."),
    Check("hf-logits", "the model's logits equal Hugging Face's (a prefill through your cache)",
          (L0 + "test_logits_match_transformers[llama]", L0 + "test_logits_match_transformers[llama3]"),
          "A whole-prompt forward through SlabAttention differs from transformers: check the scale, the mask, "
          "the GQA mapping (llama3 here has a single KV head) and the dtype of the accumulation.",
          rule="A prompt run through your cache must give Hugging Face's logits (to float tolerance): any departure "
               "from the attention formula shows up here."),
    Check("waste", "KV waste is measured from slab.used", (L0 + "test_kv_waste_is_measured_exactly",),
          "The engine counts the tokens a slab holds as slab.used: commit() must add each sequence's new tokens, "
          "once per step.",
          rule="The cache's count of stored tokens is what the engine's accounting trusts: after each step it equals "
               "exactly the tokens computed so far."),
)  # fmt: skip

BUGS = (
    Bug("mask-not-offset", "level0_naive.kv_cache",
        "    q_pos = torch.arange(n, device=q.device)[:, None] + context_len  # [n, 1]\n",
        "    q_pos = torch.arange(n, device=q.device)[:, None]  # [n, 1]\n", ("offset-mask",)),
    Bug("used-per-layer", "level0_naive.kv_cache",
        "            out[s:e] = causal_attention(q[s:e], slab.k[layer, : ctx + n], slab.v[layer, : ctx + n], ctx)\n",
        "            out[s:e] = causal_attention(q[s:e], slab.k[layer, : ctx + n], slab.v[layer, : ctx + n], ctx)\n"
        "            slab.used += n\n", ("slab-writes",)),
)  # fmt: skip

LAB = Lab(
    id="0",
    topic="the KV cache: a contiguous slab per request, causal attention over it",
    handout="lab0_kv_cache.md",
    modules=(Module("level0_naive.kv_cache", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("level0_naive.demo", (), ("--requests", "3", "--max-tokens", "8", "--no-progress")),
    minutes=60,
)
