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
    if q_row is None:
        return p_row
    residual = (p_row - q_row).clamp(min=0)  # [V]
    total = residual.sum()
    return residual / total if total > 0 else p_row


def rejection_sample_ref(
    draft: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    """One request. draft [k] token ids; q [k, V] the draft's distributions; p [k+1, V] the
    target's. Returns the emitted tokens: the accepted drafts and one more."""
    k = len(draft)
    u = torch.rand(k, generator=generator, dtype=p.dtype, device=p.device)  # always k draws: determinism
    for i, d in enumerate(draft):
        if u[i] * q[i, d] >= p[i, d]:  # reject: u >= p/q, written without a division
            return draft[:i] + [int(torch.multinomial(_final_distribution(p[i], q[i]), 1, generator=generator))]
    return draft + [int(torch.multinomial(p[k], 1, generator=generator))]


@torch.inference_mode()
def rejection_sample(draft: torch.Tensor, num_draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     generators: list[torch.Generator | None]) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """A batch of B requests, padded to K draft tokens.

    draft [B, K] long (padding: any id), num_draft [B] long (k_i <= K), q [B, K, V],
    p [B, K+1, V]. Returns (emitted tokens per request, accepted drafts per request).
    """
    B, K = draft.shape
    u = torch.zeros(B, K, dtype=p.dtype, device=p.device)  # [B, K]
    ks = num_draft.tolist()
    for i, (k, g) in enumerate(zip(ks, generators)):
        u[i, :k] = torch.rand(k, generator=g, dtype=p.dtype, device=p.device)
    p_d = p[:, :K].gather(-1, draft[..., None])[..., 0]  # [B, K]: p_i(d_i)
    q_d = q.gather(-1, draft[..., None])[..., 0]  # [B, K]: q_i(d_i) > 0, d_i was drawn from q_i
    valid = torch.arange(K, device=p.device)[None, :] < num_draft[:, None]  # [B, K]
    accepted = (u * q_d < p_d) & valid  # [B, K]
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B]: up to the first rejection
    emitted, counts = [], num_accepted.tolist()
    for i, (a, k, g) in enumerate(zip(counts, ks, generators)):
        final = _final_distribution(p[i, a], q[i, a] if a < k else None)  # [V]
        emitted.append(draft[i, :a].tolist() + [int(torch.multinomial(final, 1, generator=g))])
    return emitted, counts


def greedy_verify(
    draft: torch.Tensor, num_draft: torch.Tensor, target_argmax: torch.Tensor
) -> tuple[list[list[int]], list[int]]:
    """Temperature 0. draft [B, K], num_draft [B], target_argmax [B, K+1] (of the processed
    target logits). Accept while the draft matches the target's argmax; then the argmax."""
    B, K = draft.shape
    valid = torch.arange(K, device=draft.device)[None, :] < num_draft[:, None]  # [B, K]
    matches = (draft == target_argmax[:, :K]) & valid  # [B, K]
    num_accepted = matches.long().cumprod(-1).sum(-1)  # [B]
    counts = num_accepted.tolist()
    rows = target_argmax.tolist()
    return [draft[i, :a].tolist() + [rows[i][a]] for i, a in enumerate(counts)], counts
