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
  - `greedy_verify`: the path of a request whose token at each position is fixed by the
    target alone (temperature 0: its argmax): accept d_i iff it is the target's token, then
    emit the target's token at the first mismatch (or as the bonus). No division, no draw.

Where it is decided and done: `verify`, which the engine calls with every verifying request of
a step, picks each request's path, runs each path once for the batch, and returns what each
request emits:

    the request                                      its path                 a guess is accepted iff
    greedy, and nothing reshapes its logits          verify_greedy            it is the target's argmax
    greedy with logits processors, or a sampler      verify_by_position       it is the target's own token at
      whose draws are keyed by position (a room's)                            its position: the argmax of the
                                                                              processed p, or its keyed draw
    sampled                                          verify_sampled           u * q(d) < p(d): the rejection test

The keyed path is exact too: the target's token at a position is a sample of p that does not
depend on the guesses, and a guess is kept only when it is that token.

What it is not: the proposer, or the bookkeeping (level 2's `update_from_output` counts
as computed only the positions up to the newest accepted token).

Reference: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023); Chen et al., "Accelerating LLM Decoding with Speculative
Sampling" (2023); vLLM `v1/sample/rejection_sampler.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from level0_naive.logits_processors import SamplingState
from level0_naive.sampling_params import SamplingParams


def _final_distribution(p_row: torch.Tensor, q_row: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, p - q)) after a rejection (q given), or p itself for the bonus token (q None).
    If rounding leaves no residual mass, p is the exact answer's best approximation."""
    if q_row is None:
        return p_row
    residual = (p_row - q_row).clamp(min=0)  # [V]
    total = residual.sum()
    return torch.where(total > 0, residual / total, p_row)  # `if total > 0` would wait for the GPU


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
    counts = num_accepted.tolist()  # the host needs them: the accepted tokens go into the requests
    if not B:
        return [], []
    finals = torch.cat([
        torch.multinomial(_final_distribution(p[i, a], q[i, a] if a < k else None), 1, generator=g)
        for i, (a, k, g) in enumerate(zip(counts, ks, generators))
    ]).tolist()  # [B]: the token after each request's accepted guesses, one copy for the batch
    drafts = draft.tolist()
    return [drafts[i][:a] + [finals[i]] for i, a in enumerate(counts)], counts


def greedy_verify(
    draft: torch.Tensor, num_draft: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[list[list[int]], list[int]]:
    """draft [B, K], num_draft [B], target_tokens [B, K+1]: the target's token at each position (at
    temperature 0 the argmax of its processed logits). Accept while the draft matches; then the target's."""
    B, K = draft.shape
    valid = torch.arange(K, device=draft.device)[None, :] < num_draft[:, None]  # [B, K]
    matches = (draft == target_tokens[:, :K]) & valid  # [B, K]
    num_accepted = matches.long().cumprod(-1).sum(-1)  # [B]
    counts, rows, drafts = num_accepted.tolist(), target_tokens.tolist(), draft.tolist()  # to the host, once each
    return [drafts[i][:a] + [rows[i][a]] for i, a in enumerate(counts)], counts


# --- the step's verification: each request's path, decided here ------------------------------
@dataclass
class Guesses:
    """One request's guesses, as the step verifies them."""

    draft: list[int]  # d_1 .. d_k
    logits: torch.Tensor  # [k+1, V]: the target's raw logits at [last token, d_1 .. d_k]
    params: SamplingParams  # the request's
    states: list[SamplingState]  # [k+1]: each position's row, the guesses before it taken as output
    # (empty for a plain greedy request, whose argmax needs none)
    q: torch.Tensor | None  # [k, V]: what the proposer drew d_i from; None: a point mass (n-grams)


def verify(batch: list[Guesses], sampler) -> list[tuple[list[int], int]]:
    """(emitted tokens, accepted guesses) for each request of `batch`, in order: each request's path
    (the table in the module docstring), each path run once for the whole batch."""
    greedy = [i for i, g in enumerate(batch) if sampler.is_plain_greedy(g.params)]
    p = {i: sampler.probabilities(g.logits, g.states) for i, g in enumerate(batch) if i not in greedy}  # [k+1, V]
    by_position = [i for i in p if batch[i].params.greedy or sampler.draws_by_position]
    sampled = [i for i in p if i not in by_position]
    results = {}
    results.update(zip(greedy, verify_greedy([batch[i] for i in greedy])))
    results.update(zip(by_position, verify_by_position([batch[i] for i in by_position], [p[i] for i in by_position], sampler)))
    results.update(zip(sampled, verify_sampled([batch[i] for i in sampled], [p[i] for i in sampled])))
    return [results[i] for i in range(len(batch))]


def _padded(rows: list[list[int]] | list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """Token rows of different lengths -> [B, width] long on `device`, padded with 0 (never read: num_draft
    bounds them). A row may be a list (the guesses, from the host) or a tensor (the target's, on the device)."""
    out = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long, device=device)
    return out


def _match(batch: list[Guesses], targets: list[torch.Tensor]) -> list[tuple[list[int], int]]:
    """greedy_verify over requests whose target token at each position is known (`targets[i]` [k+1])."""
    if not batch:
        return []
    K, dev = max(len(g.draft) for g in batch), batch[0].logits.device
    num_draft = torch.tensor([len(g.draft) for g in batch], device=dev)
    return list(zip(*greedy_verify(_padded([g.draft for g in batch], K, dev), num_draft, _padded(targets, K + 1, dev))))


def verify_greedy(batch: list[Guesses]) -> list[tuple[list[int], int]]:
    """Plain greedy: the target's token at each position is the argmax of its raw logits."""
    return _match(batch, [g.logits.argmax(-1) for g in batch])


def verify_by_position(batch: list[Guesses], p: list[torch.Tensor], sampler) -> list[tuple[list[int], int]]:
    """The target's token at each position is its own draw from its processed p (`sampler.draw`: the
    argmax for a greedy row, the keyed sample under `draws_by_position`), whatever the guesses were."""
    return _match(batch, [sampler.draw(pi, g.states) for g, pi in zip(batch, p)])


def verify_sampled(batch: list[Guesses], p: list[torch.Tensor]) -> list[tuple[list[int], int]]:
    """Modified rejection sampling (`rejection_sample`) against the draft's q (a point mass on each guess
    where the proposer kept none), each request drawing from its own generator."""
    if not batch:
        return []
    K, V, dev = max(len(g.draft) for g in batch), p[0].shape[-1], p[0].device
    q = torch.zeros(len(batch), K, V, dtype=p[0].dtype, device=dev)  # [B, K, V]; rows past a request's k: padding
    pp = torch.zeros(len(batch), K + 1, V, dtype=p[0].dtype, device=dev)  # [B, K+1, V]
    for i, (g, pi) in enumerate(zip(batch, p)):
        k = len(g.draft)
        pp[i, : k + 1] = pi
        if g.q is not None:
            q[i, :k] = g.q[:k].to(q.dtype)
        else:
            q[i, torch.arange(k, device=dev), torch.tensor(g.draft, device=dev)] = 1.0
    num_draft = torch.tensor([len(g.draft) for g in batch], device=dev)
    generators = [g.states[0].generator for g in batch]  # each on the device: its draws are made there
    return list(zip(*rejection_sample(_padded([g.draft for g in batch], K, dev), num_draft, q, pp, generators)))
