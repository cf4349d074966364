"""The model runner: one flattened forward pass, then sampling, for any level.

What it is: the piece between an engine's bookkeeping and the model. Given, for each
scheduled sequence, the new tokens to feed and where they start, it builds the
flattened batch, runs the model with the attention backend it is handed, computes
logits only where a token will be sampled, samples, and appends the tokens:

    seq A: 5 prompt tokens (prefill)     seq B: 1 token (decode)    seq C: 3 tokens
    input_ids  [ a0 a1 a2 a3 a4 | b7 | c2 c3 c4 ]          T = 9
    positions  [  0  1  2  3  4 |  7 |  2  3  4 ]
    sample at         ^ row 4     ^ 5        ^ 8            (the last row of each)

What it is not: a scheduler or a cache. It never decides who runs and never owns KV
memory; every level reuses it unchanged and swaps only the backend it passes in.

Reference: vLLM V1 `gpu_model_runner.py` (`_prepare_inputs`, logits indices).
"""

from __future__ import annotations

import torch

from .model import AttentionBackend, Transformer
from .outputs import Logprob, Sequence
from .sampling import sample, top_logprobs


class ModelRunner:
    def __init__(self, model: Transformer, tokenizer, device: torch.device):
        self.model, self.tokenizer, self.device = model, tokenizer, device

    @torch.inference_mode()
    def forward(self, chunks: list[tuple[list[int], int]], attn: AttentionBackend, sample_rows: list[int]) -> torch.Tensor:
        """chunks[i] = (new token ids of sequence i, position of the first one).

        Returns logits [len(sample_rows), V] at the last new token of each sequence
        index in `sample_rows` (a prefill chunk that does not reach the end of its
        prompt samples nothing).
        """
        ids = [t for toks, _ in chunks for t in toks]
        pos = [p + j for toks, p in chunks for j in range(len(toks))]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(input_ids, positions, attn)  # [T, hidden]
        ends, total = [], 0
        for toks, _ in chunks:
            total += len(toks)
            ends.append(total - 1)
        rows = torch.tensor([ends[i] for i in sample_rows], dtype=torch.long, device=self.device)  # [S]
        return self.model.compute_logits(hidden[rows])  # [S, V]

    @torch.inference_mode()
    def sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """logits [len(seqs), V] -> one new token per sequence, appended (stop rules applied)."""
        tokens = sample(logits, [s.sampling_state() for s in seqs])  # [B]
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        lp = top_logprobs(logits, tokens, max(want)) if want else None
        token_list = tokens.tolist()
        for i, (seq, tok) in enumerate(zip(seqs, token_list)):
            entry = None
            if lp is not None and seq.params.logprobs is not None:
                entry = self._logprob_entry(lp, i, tok, seq.params.logprobs)
            seq.append_token(tok, self.tokenizer, entry)
        return token_list

    def _logprob_entry(self, lp, i: int, tok: int, n: int) -> dict[int, Logprob]:
        chosen_lp, rank, top_ids, top_vals = lp
        entry = {
            int(t): Logprob(float(v), r + 1, self._decode_one(int(t)))
            for r, (t, v) in enumerate(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
        }
        entry[tok] = Logprob(float(chosen_lp[i]), int(rank[i]), self._decode_one(tok))
        return entry

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])
