"""Lab 4's own checks: the rejection sampler on hand-made distributions.

What it is: pytest tests that `python -m labs check 4` runs next to level 4's own tests:
the residual distribution exactly, the loop on cases where the outcome is forced (p = q
accepts everything; a draft token the target gives probability 0 is always rejected), and
the greedy path's handling of padding. Level 4's chi-square tests check the distribution.

What it is not: a statistical test (those are in tests/test_level4.py, with their negative
controls).

Reference: Leviathan et al. (ICML 2023), appendix A.1.
"""

from __future__ import annotations

import torch

import level4_speculative.rejection_sampler as rs


def test_final_distribution():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    got = rs._final_distribution(p, q)
    want = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)  # max(0, p - q) = [0.4, 0, 0], normalised
    torch.testing.assert_close(got, want, msg="after a rejection: norm(max(0, p - q))")
    p2, q2 = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.25, 0.75], dtype=torch.float64)
    torch.testing.assert_close(rs._final_distribution(p2, q2), torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(rs._final_distribution(p, None), p, msg="the bonus token: p itself")
    torch.testing.assert_close(rs._final_distribution(p, p), p, msg="no residual mass left (p = q): fall back to p")


def test_reference_loop_on_hand_made_cases():
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    p = torch.softmax(torch.randn(4, 5, generator=g(), dtype=torch.float64), -1)  # [k+1, V]
    out = rs.rejection_sample_ref([1, 2, 3], p[:3].clone(), p, g())
    assert len(out) == 4 and out[:3] == [1, 2, 3], f"q = p: every draft is accepted and a bonus follows, got {out}"
    p_zero = p.clone()
    p_zero[1, 2] = 0.0  # the target never emits token 2 at position 1
    p_zero[1] /= p_zero[1].sum()
    for seed in range(5):
        out = rs.rejection_sample_ref([1, 2, 3], p[:3].clone(), p_zero, torch.Generator().manual_seed(seed))
        assert out[0] == 1 and len(out) == 2 and out[1] != 2, (
            f"a draft token with p = 0 must be rejected, and the residual must not emit it: got {out}"
        )
    a = rs.rejection_sample_ref([4], p[:1].clone(), p[:2], torch.Generator().manual_seed(3))
    b = rs.rejection_sample_ref([4], p[:1].clone(), p[:2], torch.Generator().manual_seed(3))
    assert a == b, "the same generator seed must give the same tokens"


def test_greedy_respects_num_draft():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7]])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    out, acc = rs.greedy_verify(draft, torch.tensor([3, 1]), argmax)
    assert acc == [3, 1], f"request 1 has only 1 draft token (the rest is padding): accepted {acc}"
    assert out == [[5, 6, 7, 8], [5, 6]], f"after the accepted drafts: the argmax at the next position, got {out}"
