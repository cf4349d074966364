"""Lab 5b: a mixture of experts, and the permutation that sends tokens to their experts.

What it is: the lab's definition (see `labs/spec.py`): in `features/moe/layer.py`, `dispatch` (the
(token, expert) slots sorted by expert, and how many each expert gets) and `combine` (each
expert output weighted and added back to its token). The same two functions run the experts
in one process (one matmul per expert over contiguous rows) and decide, under expert
parallelism, which rank each row is sent to (`features/moe/parallel.py`). The checks are the
level's own tests (`tests/test_moe.py`, `tests/test_level0.py`, `tests/test_level5_moe.py`,
`tests/test_equivalence.py`); three planted bugs; the experiment (`python -m
features.moe.demo`: one process, TP=2 and EP on the built-in mixture, with the student's
permutation).

What it is not: the router or the experts (read, not written), or the handout
(docs/labs/lab5b_moe.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

M = "tests/test_moe.py::"
EQ = "tests/test_equivalence.py::"

PARTS = (
    Part(
        "dispatch",
        """\
Slot t*k + j is token t's j-th choice (ids[t, j]). Return `order`, the slots sorted by expert id, tokens in
their original order within one expert (a stable sort: torch.argsort(..., stable=True) on ids flattened),
and `counts`, a Python list of how many slots each of the num_experts experts gets (zeros included:
torch.bincount with minlength). Row i of the sorted batch is then token order[i] // k.""",
    ),
    Part(
        "combine",
        """\
rows[i] is an expert's output for slot order[i]. Scale each row by its slot's routing weight (weights
flattened the same way, then taken in `order`), and add it to its token's row of a zero [num_tokens, d]
tensor (index_add_ over the tokens order // k, with k = weights.shape[1]). The result is each token's
weighted sum over its k experts.""",
    ),
)

CHECKS = (
    Check("permutation", "dispatch then combine is the identity, for random routings",
          (M + "test_dispatch_then_combine_is_the_identity",),
          "dispatch: order = argsort(ids.reshape(-1), stable=True), counts = bincount(..., minlength=E).tolist(). "
          "combine: rows * weights.reshape(-1)[order, None], then zeros.index_add_(0, order // k, ...).",
          rule="Every (token, expert) slot appears once, grouped by expert, and comes back to its own token "
               "with its own weight."),
    Check("paths", "the grouped path equals the naive loop; the logits equal Hugging Face's",
          (M + "test_the_naive_and_the_grouped_paths_are_equal", "tests/test_level0.py::test_logits_match_transformers[mixtral]",
           "tests/test_level0.py::test_logits_match_transformers[qwen2_moe]", M + "test_top_k_ties_are_broken_as_hugging_face_breaks_them"),
          "If the permutation check passes, look at counts: moe_grouped walks the sorted rows expert by expert, "
          "counts[e] rows each, in expert order.",
          rule="Sorting tokens by expert changes how the work is grouped, never what a token gets."),
    Check("expert-parallel", "under expert parallelism every row reaches its expert's rank and comes back",
          (EQ + "test_level5_moe_greedy_output_equals_the_oracle[mixtral-moe-ep2]",
           "tests/test_level5_moe.py::test_ep_sends_tokens_and_tp_sums_activations"),
          "ExpertParallelMoE splits your sorted rows by rank: experts [r*E/N, (r+1)*E/N) are rank r's, so rows "
          "must be sorted by expert in increasing order for the split to send each to its owner.",
          rule="Rows sorted by expert are rows sorted by the rank that owns the expert: each reaches its "
               "expert's rank, and its answer returns to its token."),
)  # fmt: skip

BUGS = (
    Bug("descending", "features.moe.layer",
        "    order = torch.argsort(flat, stable=True)  # [T*k]\n",
        "    order = torch.argsort(flat, stable=True, descending=True)  # [T*k]\n",
        ("permutation", "expert-parallel")),
    Bug("unpermuted-weights", "features.moe.layer",
        "    scaled = rows * weights.reshape(-1)[order].unsqueeze(1)  # [T*k, d]\n",
        "    scaled = rows * weights.reshape(-1).unsqueeze(1)  # [T*k, d]\n", ("permutation", "paths")),
    Bug("wrong-token", "features.moe.layer",
        "    return out.index_add_(0, order // k, scaled)\n",
        "    return out.index_add_(0, order % num_tokens, scaled)\n", ("permutation", "paths")),
)  # fmt: skip

LAB = Lab(
    id="5b",
    topic="a mixture of experts: the permutation that sends tokens to their experts, on one rank or many",
    handout="lab5b_moe.md",
    modules=(Module("features.moe.layer", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("features.moe.demo", ("--requests", "8"),
                          ("--requests", "2", "--max-tokens", "4", "--no-progress")),  # fmt: skip
    minutes=60,
)
