# Lab 4: your copy of level4_speculative/rejection_sampler.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 4 THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""Modified rejection sampling: accept a prefix of the draft, and the output is exactly the target's.

What it is: the verify step of speculative decoding. For one request, the draft proposed
d_1..d_k, each d_i sampled from the draft's (processed) distribution q_i; the target's
one forward over [last token, d_1..d_k] gave p_1..p_{k+1}. Then, left to right:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
    at the first rejection i: emit one token from the residual  norm(max(0, p_i - q_i))
    if all k are accepted:     emit a bonus token from p_{k+1}

Why the output is distributed exactly as p (Leviathan et al. 2023, appendix A.1): for
any token x, P(emit x at step i) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y)))
* max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p(x), q(x)) + max(0, p(x) - q(x))
= p(x), because the residual's normaliser equals the rejection probability.

  - `rejection_sample_ref`: the readable loop, one request at a time.
  - `rejection_sample`: the same, vectorised over the batch (the random draws stay per
    request, from each request's own generator, in the same order as the loop's: k
    uniforms, then one final draw), tested equal to the loop.
  - `greedy_verify`: temperature 0 has its own path: accept d_i iff it is the target's
    argmax, then emit the target's argmax at the first mismatch (or as the bonus). No
    division, no random draw.

What it is not: the proposer, or the bookkeeping (level 2's `update_from_output` counts
as computed only the positions up to the newest accepted token).

Reference: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023); Chen et al., "Accelerating LLM Decoding with Speculative
Sampling" (2023); vLLM `v1/sample/rejection_sampler.py`.
"""

from __future__ import annotations

import torch


def _final_distribution(p_row: torch.Tensor, q_row: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, p - q)) after a rejection (q given), or p itself for the bonus token (q None).
    If rounding leaves no residual mass, p is the exact answer's best approximation."""
    # TODO (lab 4): _final_distribution
    # The distribution of the one token a step emits after the accepted drafts:
    #   after a rejection (q_row given): the residual norm(max(0, p - q)), i.e. (p - q) clamped at 0, divided
    #       by its sum; if rounding left no mass at all (the sum is 0), p itself is the best answer;
    #   the bonus token after a fully accepted draft (q_row is None): p itself.
    raise NotImplementedError("lab 4: write _final_distribution")


def rejection_sample_ref(
    draft: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    """One request. draft [k] token ids; q [k, V] the draft's distributions; p [k+1, V] the
    target's. Returns the emitted tokens: the accepted drafts and one more."""
    # TODO (lab 4): rejection_sample_ref
    # One request, the readable loop (docs/level4_speculative.md, "Why the output is the target's"):
    #   draw k uniforms first, always k (u = torch.rand(k, generator=generator, dtype=p.dtype, device=p.device)),
    #   so the random stream does not depend on where the rejection falls;
    #   left to right: accept draft[i] if u[i] < p[i, d] / q[i, d]; write it without the division,
    #       u[i] * q[i, d] < p[i, d];
    #   at the first rejection i: return the accepted drafts plus one token drawn from
    #       _final_distribution(p[i], q[i]) with torch.multinomial(..., 1, generator=generator);
    #   all k accepted: the drafts plus a bonus token drawn from p[k] (the target's next distribution).
    raise NotImplementedError("lab 4: write rejection_sample_ref")


@torch.inference_mode()
def rejection_sample(draft: torch.Tensor, num_draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     generators: list[torch.Generator | None]) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """A batch of B requests, padded to K draft tokens.

    draft [B, K] long (padding: any id), num_draft [B] long (k_i <= K), q [B, K, V],
    p [B, K+1, V]. Returns (emitted tokens per request, accepted drafts per request).
    """
    # TODO (lab 4): rejection_sample
    # The same for a batch of B requests padded to K drafts; request i has num_draft[i] = k_i <= K.
    # It must give exactly what rejection_sample_ref gives with the same generators, draw for draw:
    #   per request, k_i uniforms from its own generator (u[i, :k_i]), nothing drawn for the padding;
    #   p_i(d_i) and q_i(d_i) for every position with gather; accepted = (u * q_d < p_d) & valid;
    #   the number accepted is the length of the leading run of accepted positions (a cumulative product);
    #   then per request, in order, one final draw from its generator: _final_distribution(p[i, a], q[i, a]) if
    #   a < k_i, else (bonus) _final_distribution(p[i, a], None).
    # Return (emitted token lists, accepted counts).
    raise NotImplementedError("lab 4: write rejection_sample")


def greedy_verify(
    draft: torch.Tensor, num_draft: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[list[list[int]], list[int]]:
    """Temperature 0. draft [B, K], num_draft [B], target_argmax [B, K+1] (of the processed
    target logits). Accept while the draft matches the target's argmax; then the argmax."""
    # TODO (lab 4): greedy_verify
    # Temperature 0: accept draft[i, j] while it equals the target's argmax target_argmax[i, j] (and j < num_draft[i]);
    # then emit the argmax at the first mismatch, or the bonus argmax target_argmax[i, k] if all matched.
    # No division, no random draw. Return (emitted token lists, accepted counts).
    raise NotImplementedError("lab 4: write greedy_verify")
