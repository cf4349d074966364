"""The model runner: one flattened batch in, logits rows out. No cache, no sampling, no requests.

What it is: `FlatBatch`, the batch geometry computed once per step, and `ModelRunner`,
which owns the model and runs one forward over it through the attention backend it is
handed. The new tokens of every sequence are concatenated:

    seq A: 5 prompt tokens (prefill)     seq B: 1 token (decode)    seq C: 3 tokens
    input_ids        [ a0 a1 a2 a3 a4 | b7 | c2 c3 c4 ]          T = 9
    positions        [  0  1  2  3  4 |  7 |  2  3  4 ]
    query_start_loc  [ 0,              5,   6,         9 ]        B + 1 entries
    logits_indices   [             4,   5,         8 ]            the rows to sample from

A sequence asks for the logits of its last `num_logits` rows, any number from 0: here its
last token's (the next token is sampled from it), after the rows its prompt logprobs need.

What it is not: a cache, a sampler or a batching policy; the engine decides who runs and what
to do with the logits. Level 1's `Worker` adds the paged KV cache around the runner, level 2
asks 0 rows of a prompt chunk that stops short, level 4 k + 1 to verify, and level 5
broadcasts the batch to its ranks.

Reference: vLLM V1 `gpu_model_runner.py` (`_prepare_inputs`, logits indices).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import torch

from .model import AttentionBackend, Transformer

Chunk = tuple[list[int], int]  # (new token ids of one sequence, position of the first)


@dataclass
class FlatBatch:
    """Plain tensors on the CPU (picklable: nothing refers to a sequence or a cache)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    query_start_loc: torch.Tensor  # [B+1] int32: seq i's rows are qsl[i]:qsl[i+1]
    logits_indices: torch.Tensor  # [S] long: the rows whose logits are computed

    @staticmethod
    def geometry(chunks: list[Chunk], num_logits: list[int]) -> dict[str, torch.Tensor]:
        """The token fields of a batch: what every batch has, whatever its attention needs besides.

        Built as Python lists, then one tensor each: for a step's batch (tens to a few thousand
        tokens) that beats a chain of small tensor ops, whose fixed cost per op dominates there."""
        qsl = list(itertools.accumulate((len(toks) for toks, _ in chunks), initial=0))  # [B+1]
        rows = [end - j for end, k in zip(qsl[1:], num_logits) for j in range(k, 0, -1)]  # the last k rows of each
        return dict(
            input_ids=torch.tensor([t for toks, _ in chunks for t in toks], dtype=torch.long),
            positions=torch.tensor([p + j for toks, p in chunks for j in range(len(toks))], dtype=torch.long),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            logits_indices=torch.tensor(rows, dtype=torch.long),
        )

    @classmethod
    def build(cls, chunks: list[Chunk], num_logits: list[int]) -> FlatBatch:
        return cls(**cls.geometry(chunks, num_logits))

    def to(self, device: torch.device):
        """The same batch with every tensor on `device` (a no-op on the CPU)."""
        return type(self)(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


class ModelRunner:
    """Owns the model; runs one flattened forward and computes logits only where asked."""

    def __init__(self, model: Transformer):
        self.model = model
        self.device = next(model.parameters()).device
        # keep_hidden: every row's last hidden state of the last forward stays in `hidden` [T, hidden]
        # (a proposer that drafts from the target's features asks: level 4's EAGLE)
        self.keep_hidden, self.hidden = False, None

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, attn: AttentionBackend) -> torch.Tensor:
        """-> logits [len(batch.logits_indices), V], float32 or wider."""
        hidden = self.model(batch.input_ids, batch.positions, attn)  # [T, hidden]
        if self.keep_hidden:
            self.hidden = hidden
        return self.model.compute_logits(hidden[batch.logits_indices])  # [S, V]
