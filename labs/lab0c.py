"""Lab 0c: the sampler's filters and penalties (level 0's `sampler.py` and `logits_processors.py`).

What it is: the lab's definition (see `labs/spec.py`): in `level0_naive/logits_processors.py`,
`apply_penalties` (repetition over the prompt and the output, presence and frequency over the
output); in `level0_naive/sampler.py`, `filter_logits` (top-k, then top-p, then min-p, on one
row: the definition) and `filter_logits_batch` (the same for a batch whose rows each have their
own settings: what the engines run); the checks (tests/test_sampling.py, and labs/lab0c_checks.py against Hugging
Face's processors); three planted bugs; the experiment (labs/lab0c_experiment.py: the built-in
model sampled under each setting, diversity against likelihood).

What it is not: the draw (`Sampler.draw`: one generator per request), the batch twin of the
penalties (`Penalties.batch`, read, not written) or the handout (docs/labs/lab0c_sampler.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

S = "tests/test_sampling.py::"
OWN = "labs/lab0c_checks.py::"

PENALTY_PARTS = (
    Part(
        "apply_penalties",
        """\
logits [V] of one row, st.params its settings. Repetition (p.repetition_penalty != 1, Hugging Face's): every
token in st.prompt_token_ids + st.output_token_ids, seen once or more, has its logit divided by the penalty
if it is positive and multiplied by it otherwise. Then presence and frequency (OpenAI's, output tokens only):
subtract p.frequency_penalty x (times the token was generated) + p.presence_penalty x (1 if it was at all).
Return a new tensor; leave `logits` as it was.""",
    ),
)

SAMPLER_PARTS = (
    Part(
        "filter_logits",
        """\
One row, already divided by the temperature; disallowed tokens become -inf, in this order. top_k (0: off):
keep the tokens at least as large as the k-th largest. top_p (1: off), over the probabilities of what top-k
left: sort them best first (stable), keep each token whose better tokens' mass is still under top_p (the
token that crosses the line is kept). min_p (0: off): keep the tokens whose probability is at least min_p x
the top probability. The most likely token always survives.""",
    ),
    Part(
        "filter_logits_batch",
        """\
filter_logits for every row of logits [B, V] at once, row i with top_k[i], top_p[i], min_p[i] (tensors [B]),
and bit for bit what filter_logits gives row i: no Python loop over rows. top_k: a row's k-th largest is one
gather from one descending sort (k of 0 or >= V: keep everything). top_p: one stable sort, a cumulative sum
per row, top_p as a column; a row whose top_p is 1 keeps everything. min_p: against each row's own max.""",
    ),
)

CHECKS = (
    Check("filters", "top-k, top-p and min-p keep what their definitions and Hugging Face's warpers keep",
          (OWN + "test_filters_keep_what_hugging_faces_warpers_keep",
           S + "test_filters_never_emit_a_token_outside_the_allowed_set",
           S + "test_top_k_one_and_tiny_top_p_are_greedy"),
          "filter_logits: top-p keeps a token when the mass of the tokens before it (cumsum - itself) is still "
          "under top_p, so the token that crosses the line stays; min_p is relative to the top probability.",
          rule="A filter keeps exactly the tokens its definition keeps: never fewer (the most likely always "
               "stays), never more."),
    Check("penalties", "repetition, presence and frequency penalties follow their definitions",
          (S + "test_penalties_follow_their_definitions", OWN + "test_the_repetition_penalty_is_hugging_faces",
           S + "test_repetition_penalty_lowers_the_chance_of_repeats"),
          "Repetition: where(logits > 0, logits / penalty, logits * penalty) on the tokens seen in the prompt "
          "or the output; presence and frequency from torch.bincount of the output only.",
          rule="A penalty makes a token that was seen less likely, whatever the sign of its logit, and counts "
               "what its definition counts (the prompt for repetition, the output for the other two)."),
    Check("batch", "the batch, each row with its own settings, gives what one row at a time gives, bit for bit",
          (S + "test_batched_probabilities_equal_the_per_row_loop",
           S + "test_batched_probabilities_run_a_processor_without_batch_row_by_row"),
          "filter_logits_batch: read the k-th largest per row with gather((k - 1)[:, None]) from one descending "
          "sort, compare against per-row columns ([:, None]), and let top_p >= 1 keep a whole row.",
          rule="A row's tokens may not depend on which other rows share its batch, or on their settings."),
)  # fmt: skip

BUGS = (
    Bug("top-p-drops-crossing", "level0_naive.sampler",
        "        keep_sorted = mass_before < top_p  # the token that crosses top_p is kept\n",
        "        keep_sorted = sorted_p.cumsum(0) < top_p\n", ("filters", "batch")),
    Bug("repetition-divides-all", "level0_naive.logits_processors",
        "        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)\n",
        "        penalised = logits / p.repetition_penalty\n", ("penalties", "batch")),
    Bug("min-p-absolute", "level0_naive.sampler",
        "        keep &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values\n",
        "        keep &= probs >= min_p[:, None]\n", ("batch",)),
)  # fmt: skip

LAB = Lab(
    id="0c",
    topic="the sampler: top-k, top-p, min-p and the penalties, one row and a batch",
    handout="lab0c_sampler.md",
    modules=(Module("level0_naive.logits_processors", PENALTY_PARTS), Module("level0_naive.sampler", SAMPLER_PARTS)),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("labs.lab0c_experiment", (), ("--samples", "2", "--max-tokens", "8")),
    minutes=60,
)
