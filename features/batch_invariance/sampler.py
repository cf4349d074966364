"""Keyed draws: a sampled token as a function of (the request's seed, the token's position) alone.

What it is: `KeyedSampler`, level 0's `Sampler` (level0_naive/sampler.py) with one method
replaced, the draw of a sampled row: instead of `torch.multinomial` from the request's
generator (whose state advances with every draw, so a token depends on how many draws came
before it), the token is argmax(log p + Gumbel noise), the noise `keyed_gumbel(seed, position)`.
By the Gumbel-max trick that is an exact sample from p, and it is the same sample whether the
row is drawn alone or in any batch, once or again after a preemption or a rejected guess.

    seed 7, position 12:  noise g = keyed_gumbel(7, 12)       [V], fixed for good
    p (this step's row)   token = argmax(log p + g)           same p -> same token, always

It sets `draws_by_position`, the sampler seam's flag that level 4 reads: with it, a guess is
verified by comparing it with the target's own keyed sample at its position (what is emitted
never depends on the guesses), instead of the rejection test (level4_speculative/rejection_sampler.py).

What it is not: faster, or vLLM's draw (vLLM draws the whole batch with one exponential race
on the GPU, from per-request generators).

Reference: Gumbel (1954); the Gumbel-max trick as in Maddison et al., "A* Sampling" (2014);
He, "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025).
"""

from __future__ import annotations

import torch

from level0_naive.sampler import Sampler, SamplingState


def _splitmix64(x: int) -> int:
    """Steele et al.'s 64-bit mixer: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def keyed_gumbel(seed: int, position: int, vocab_size: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Gumbel noise [V] that is a function of (seed, position) alone.

    argmax(log p + noise) is an exact sample from p (the Gumbel-max trick: the argmax of
    log p_i + G_i, G_i independent Gumbel(0, 1), is i with probability p_i). The key:
    (seed, position) mixed by splitmix64 and folded to the 32 bits PyTorch's CPU generator
    keeps (two positions share noise with probability about 2**-32).
    """
    key = _splitmix64((seed % 2**64) ^ _splitmix64(position))
    u = torch.rand(
        vocab_size, generator=torch.Generator().manual_seed((key ^ key >> 32) & 0xFFFFFFFF), dtype=torch.float64
    )  # [V]
    return (-torch.log(-torch.log(u))).to(dtype=dtype, device=device)  # u = 0 gives -inf: never the argmax


class KeyedSampler(Sampler):
    """Level 0's sampler whose sampled rows draw argmax(log p + keyed noise) (see the module docstring)."""

    draws_by_position = True

    def draw_row(self, probs: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """probs [V] -> the token (a 0-d long tensor) keyed by the request's seed and this token's position."""
        position = len(st.prompt_token_ids) + len(st.output_token_ids)  # of the token being drawn
        noise = keyed_gumbel(st.generator.initial_seed(), position, probs.shape[-1], probs.dtype, probs.device)
        return (probs.log() + noise).argmax()  # probability 0: log 0 = -inf, never drawn


__all__ = ["KeyedSampler", "keyed_gumbel"]
