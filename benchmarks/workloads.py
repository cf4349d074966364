"""Named, seeded workloads: the same requests, token for token, for every engine.

What it is: six request mixes, each a function of (number of requests, seed, vocab):

  uniform        every prompt 32 tokens, every output 128: the easy case for static batching
  spread         prompts 16-64, outputs 8-512 uniformly at random: short requests wait
                 behind long ones (level 2's case) and max-length slabs sit mostly empty
                 (level 1's case)
  shared-prefix  one 384-token "system prompt" (>= 90 % of every prompt) plus a distinct
                 8-32 token suffix, outputs 32-64: level 3's case
  chat           conversations replayed turn by turn; turn k's prompt is turn k-1's prompt
                 + its answer + new user text, so each turn's prompt starts with the whole
                 previous exchange (level 3's case again, across calls)
  latency        one request at a time (every engine runs it at batch 1), outputs 128-256:
                 a decode step leaves the hardware idle, level 4's case. Its prompts are
                 natural text (`texts/sonnets.txt`, sixteen public-domain lines) when the
                 harness passes the model's tokenizer, so a draft model or an n-gram
                 proposer meets the kind of text a user sends, not random ids
  poisson        prompts 16-64, outputs 8-128, arriving one by one as a Poisson process
                 (`arrivals`: seeded times at 1 request/s, which the harness divides by its
                 request rate): a request that arrives while a static batch runs waits for
                 the whole batch, under continuous batching it joins at the next step (head-
                 of-line blocking, measured as latency)

The other prompts are seeded random token ids in the printable-ASCII range (there the
work depends on lengths, not on which tokens). Every output length is exact
(`min_tokens = max_tokens`, `ignore_eos`), so every engine does the same work.

What it is not: a trace of real traffic. Except for `poisson`, arrivals are all at once (an
offline batch, as vLLM's benchmark_throughput).

Reference: vLLM `benchmarks/benchmark_dataset.py` (random and prefix-repetition datasets).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

NAMES = ("uniform", "spread", "shared-prefix", "chat", "latency", "poisson")
TEXTS = Path(__file__).resolve().parent / "texts" / "sonnets.txt"


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int  # exact: the harness sets min_tokens = max_tokens


@dataclass
class Workload:
    name: str
    description: str
    first: list[Request]
    # For chat: one list per later turn, one (user tokens, answer length) per conversation.
    follow_ups: list[list[tuple[list[int], int]]] = field(default_factory=list)
    max_num_seqs: int | None = None  # a batch limit every engine must use (latency: 1)
    arrivals: list[float] | None = None  # poisson: each request's arrival (s) at 1 request/s; None: all at once
    natural_text: bool = False  # the prompts are tokenized text, not random ids

    def play(self, run_round: Callable[[list[Request]], list[list[int]]]) -> None:
        """Run every round; `run_round(requests) -> output token ids per request`."""
        reqs = self.first
        answers = run_round(reqs)
        for turn in self.follow_ups:
            reqs = [Request(r.prompt + a + user, n) for r, a, (user, n) in zip(reqs, answers, turn)]
            answers = run_round(reqs)

    def rounds(self) -> list[list[tuple[int, int]]]:
        """(prompt length, output length) of every request, round by round (lengths are exact)."""
        lens = [(len(r.prompt), r.max_tokens) for r in self.first]
        out = [lens]
        for turn in self.follow_ups:
            lens = [(p + n + len(user), m) for (p, n), (user, m) in zip(lens, turn)]
            out.append(lens)
        return out

    @property
    def num_requests(self) -> int:
        return sum(len(r) for r in self.rounds())

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output of any request: the worst case a slab must hold."""
        return max(p + n for rnd in self.rounds() for p, n in rnd)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    hi = min(vocab, 127)
    lo = 32 if hi > 64 else 0
    return [rng.randrange(lo, hi) for _ in range(n)]


def natural_prompts(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The committed public-domain lines, tokenized by the model's own tokenizer."""
    return [encode(line) for line in TEXTS.read_text().splitlines() if line.strip()]


def make_workload(name: str, num_requests: int, vocab: int, seed: int = 0, quick: bool = False,
                  encode: Callable[[str], list[int]] | None = None) -> Workload:  # fmt: skip
    """Build workload `name` with about `num_requests` requests (chat: conversations x turns).

    `encode` (text -> token ids, the model's tokenizer): `latency` then uses natural text."""
    rng = random.Random(f"{name}-{seed}")  # each workload its own stream: adding one changes no other
    q = quick  # quick mode keeps the shapes but shrinks every length about 8-16x
    if name == "uniform":
        p, o = (16, 16) if q else (32, 128)
        reqs = [Request(_tokens(rng, p, vocab), o) for _ in range(num_requests)]
        return Workload(name, f"prompt {p}, output {o} tokens", reqs)
    if name == "spread":
        (plo, phi), (olo, ohi) = ((8, 16), (4, 32)) if q else ((16, 64), (8, 512))
        reqs = [Request(_tokens(rng, rng.randint(plo, phi), vocab), rng.randint(olo, ohi)) for _ in range(num_requests)]
        return Workload(name, f"prompt {plo}-{phi}, output {olo}-{ohi} tokens", reqs)
    if name == "shared-prefix":
        prefix_len, (slo, shi), (olo, ohi) = (96, (4, 8), (4, 8)) if q else (384, (8, 32), (32, 64))
        prefix = _tokens(rng, prefix_len, vocab)
        reqs = [
            Request(prefix + _tokens(rng, rng.randint(slo, shi), vocab), rng.randint(olo, ohi))
            for _ in range(num_requests)
        ]
        return Workload(name, f"shared prefix {prefix_len} + suffix {slo}-{shi}, output {olo}-{ohi} tokens", reqs)
    if name == "latency":
        (plo, phi), (olo, ohi), n = (
            ((8, 16), (16, 32), min(num_requests, 4)) if q else ((16, 64), (128, 256), min(num_requests, 16))
        )
        if encode is None:
            reqs = [Request(_tokens(rng, rng.randint(plo, phi), vocab), rng.randint(olo, ohi)) for _ in range(n)]
            return Workload(name, f"one at a time: prompt {plo}-{phi}, output {olo}-{ohi} tokens", reqs, max_num_seqs=1)
        lines = natural_prompts(encode)
        prompts = [p[:phi] if q else p for p in itertools.islice(itertools.cycle(lines), n)]
        reqs = [Request(p, rng.randint(olo, ohi)) for p in prompts]
        plen = sorted(len(p) for p in prompts)
        desc = f"one at a time: natural text ({TEXTS.name}), prompt {plen[0]}-{plen[-1]}, output {olo}-{ohi} tokens"
        return Workload(name, desc, reqs, max_num_seqs=1, natural_text=True)
    if name == "poisson":
        (plo, phi), (olo, ohi) = ((8, 16), (4, 16)) if q else ((16, 64), (8, 128))
        n = min(num_requests, 16 if q else 64)
        reqs = [Request(_tokens(rng, rng.randint(plo, phi), vocab), rng.randint(olo, ohi)) for _ in range(n)]
        gaps = [0.0] + [rng.expovariate(1.0) for _ in range(n - 1)]  # the first arrives at once
        arrivals = list(itertools.accumulate(gaps))  # seconds, at 1 request/s
        desc = f"Poisson arrivals: prompt {plo}-{phi}, output {olo}-{ohi} tokens"
        return Workload(name, desc, reqs, arrivals=arrivals)
    if name == "chat":
        turns = 2 if q else 4
        system, (ulo, uhi), (alo, ahi) = (16, (4, 8), (4, 8)) if q else (32, (16, 48), (32, 128))
        convs = max(1, num_requests // turns)
        first = [
            Request(_tokens(rng, system + rng.randint(ulo, uhi), vocab), rng.randint(alo, ahi)) for _ in range(convs)
        ]
        later = [
            [(_tokens(rng, rng.randint(ulo, uhi), vocab), rng.randint(alo, ahi)) for _ in range(convs)]
            for _ in range(turns - 1)
        ]
        desc = f"{convs} conversations x {turns} turns, user {ulo}-{uhi}, answers {alo}-{ahi} tokens"
        return Workload(name, desc, first, later)
    raise ValueError(f"unknown workload {name!r}: choose from {', '.join(NAMES)}")
