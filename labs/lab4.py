"""Lab 4: the rejection sampler of speculative decoding.

What it is: the lab's definition (see `labs/spec.py`): every function of
`level4_speculative/rejection_sampler.py` (the residual distribution, the readable loop,
the batched version that must draw the same random numbers, and the greedy path); the
checks (level 4's own tests, whose chi-square tests carry negative controls, and
`labs/lab4_checks.py`); the planted bugs (a residual of p instead of max(0, p - q), an
acceptance test the wrong way round); and the experiment: acceptance per draft position
and speedup against k, beside Leviathan's formula (`python -m level4_speculative.demo`).

What it is not: the proposer or the scheduler's trimming (their tests are in
tests/test_level4.py), or the handout (docs/labs/lab4_rejection_sampler.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L4 = "tests/test_level4.py::"
OWN = "labs/lab4_checks.py::"

PARTS = (
    Part(
        "_final_distribution",
        """\
The distribution of the one token a step emits after the accepted drafts:
  after a rejection (q_row given): the residual norm(max(0, p - q)), i.e. (p - q) clamped at 0, divided
      by its sum; if rounding left no mass at all (the sum is 0), p itself is the best answer;
  the bonus token after a fully accepted draft (q_row is None): p itself.""",
    ),
    Part(
        "rejection_sample_ref",
        """\
One request, the readable loop (docs/level4_speculative.md, "Why the output is the target's"):
  draw k uniforms first, always k (u = torch.rand(k, generator=generator, dtype=p.dtype, device=p.device)),
  so the random stream does not depend on where the rejection falls;
  left to right: accept draft[i] if u[i] < p[i, d] / q[i, d]; write it without the division,
      u[i] * q[i, d] < p[i, d];
  at the first rejection i: return the accepted drafts plus one token drawn from
      _final_distribution(p[i], q[i]) with torch.multinomial(..., 1, generator=generator);
  all k accepted: the drafts plus a bonus token drawn from p[k] (the target's next distribution).""",
    ),
    Part(
        "rejection_sample",
        """\
The same for a batch of B requests padded to K drafts; request i has num_draft[i] = k_i <= K.
It must give exactly what rejection_sample_ref gives with the same generators, draw for draw:
  per request, k_i uniforms from its own generator (u[i, :k_i]), nothing drawn for the padding;
  p_i(d_i) and q_i(d_i) for every position with gather; accepted = (u * q_d < p_d) & valid;
  the number accepted is the length of the leading run of accepted positions (a cumulative product);
  then per request, in order, one final draw from its generator: _final_distribution(p[i, a], q[i, a]) if
  a < k_i, else (bonus) _final_distribution(p[i, a], None).
Return (emitted token lists, accepted counts).""",
    ),
    Part(
        "greedy_verify",
        """\
Accept draft[i, j] while it equals the target's token target_tokens[i, j] (at temperature 0 its argmax; and
j < num_draft[i]); then emit the target's token at the first mismatch, or the bonus target_tokens[i, k] if all
matched. No division, no random draw. Return (emitted token lists, accepted counts).""",
    ),
)

CHECKS = (
    Check("residual", "after a rejection the token is drawn from norm(max(0, p - q))",
          (OWN + "test_final_distribution",),
          "_final_distribution(p, q) is (p - q).clamp(min=0) divided by its sum (p if the sum is 0); with q None "
          "(the bonus token) it is p. Drawing from p again after a rejection counts the tokens where q > p twice.",
          rule="After a rejection, the replacement makes up exactly what rejecting took away: only a token the draft "
               "under-proposed can come out, in proportion to its shortfall."),
    Check("exactness", "the emitted token is distributed exactly as p (chi-square, with a negative control)",
          (L4 + "test_the_emitted_token_is_distributed_as_p",),
          "Accept with probability min(1, p(d)/q(d)): u * q(d) < p(d). On a rejection draw from the residual "
          "max(0, p - q), normalised. Either mistake tilts the output toward the draft: the chi-square test sees it.",
          rule="Speculative sampling must leave the output distribution exactly the target's, whatever the draft "
               "proposes."),
    Check("loop", "the readable loop: k uniforms, accept a prefix, then one more token",
          (OWN + "test_reference_loop_on_hand_made_cases",),
          "Draw all k uniforms first. Accept d_i when u_i * q_i(d_i) < p_i(d_i); stop at the first rejection and "
          "draw from the residual; if all k pass, draw the bonus token from p[k].",
          rule="Acceptance is a prefix: draft tokens are judged in order, the first rejection ends the run with a "
               "replacement token, and a fully accepted run earns one bonus token from the target."),
    Check("batched", "the batched sampler equals the loop, draw for draw",
          (L4 + "test_vectorised_sampler_equals_the_loop",),
          "Per request, draw exactly k_i uniforms from its own generator (none for padding), then one final draw; "
          "the accepted count is the leading run of accepted positions (cumprod), not the number accepted.",
          rule="The batched sampler consumes each request's random numbers exactly as the loop does, and so accepts "
               "and emits the same tokens; padding consumes nothing."),
    Check("greedy", "greedy verification accepts exactly the matching prefix", (L4 + "test_greedy_verify_accepts_exactly_the_matching_prefix",
                                                                                  OWN + "test_greedy_respects_num_draft"),
          "Accept while draft == argmax, only for j < num_draft[i]; emit the argmax at the first mismatch, or "
          "the bonus target_tokens[i, k_i].",
          rule="Greedy verification accepts a draft token exactly when the target would have chosen it, among the "
               "real drafts only, and always adds the target's own next token."),
    Check("engine", "in the engine: draft = target is accepted every time; a seeded request ignores its batch",
          (L4 + "test_draft_equal_to_target_is_accepted_every_time",
           L4 + "test_a_seeded_request_gives_the_same_tokens_whatever_the_batch"),
          "Speculation changed what the engine emits: check the greedy path's bonus token and the number "
          "accepted (it rolls num_computed_tokens back), and that each request draws only from its own generator.",
          rule="Speculation never changes what the engine emits: a draft equal to the target is always accepted, and "
               "a seeded request's tokens do not depend on its batch."),
)  # fmt: skip

BUGS = (
    Bug(
        "residual-p",
        "level4_speculative.rejection_sampler",
        "    residual = (p_row - q_row).clamp(min=0)  # [V]\n",
        "    residual = p_row.clamp(min=0)  # [V]\n",
        ("residual", "exactness"),
    ),
    Bug(
        "accept-reversed",
        "level4_speculative.rejection_sampler",
        "    accepted = (u * q_d < p_d) & valid  # [B, K]\n",
        "    accepted = (u * p_d < q_d) & valid  # [B, K]\n",
        ("batched",),
    ),
)

LAB = Lab(
    id="4",
    topic="speculative decoding: the rejection sampler",
    handout="lab4_rejection_sampler.md",
    modules=(Module("level4_speculative.rejection_sampler", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment(
        "level4_speculative.demo",
        (),
        ("--max-tokens", "6", "--max-k", "1", "-k", "1", "--batch-size", "2", "--no-progress"),
    ),  # fmt: skip
    minutes=90,
)
