"""Level 4: level 3's engine with a proposer. Draft k tokens cheaply, verify them in one forward.

What it is: `LLMEngine` and `LLM` of level 3 with `speculative_config` (vLLM's knob). One
step, for a request that is decoding:

    schedule()        1 + k tokens for it (the budget counts them; k lookahead KV slots)
    prepare_input()   the proposer drafts d_1..d_k (a draft model through its own paged
                      cache on the same block tables, or an n-gram lookup), then the
                      target's batch gets [last token, d_1..d_k] as one query of k + 1
                      tokens, with logits rows for all k + 1 positions
    worker.execute()  the target's ordinary forward (the paged kernel handles any query length)
    sample()          the rejection sampler keeps a prefix of the draft and adds one token:
                      exactly the target's distribution (`rejection_sampler.py`)
    update_from_output()  num_computed_tokens += 1 + accepted (the rejected positions are
                      rolled back: their K/V stays in the slots and is overwritten later);
                      a block is named for sharing only once it is verified in both caches;
                      the accepted tokens are appended one by one, so a stop rule cuts the
                      run exactly where it fires

Requests that prefill, or have no room or budget for drafts, run as at level 3 in the
same batch. Without `speculative_config` this is level 3, step for step.

What it is not: a tree or multi-draft speculator, or overlapped drafting. Sampling
from q and p per row is a Python loop over rows, as level 0's sampler is.

Reference: Leviathan et al. (ICML 2023); Chen et al. (2023); vLLM `v1/spec_decode/`,
`v1/worker/gpu_model_runner.py` (spec decode metadata, `logits_indices`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from level0_naive.kv_cache import kv_bytes_per_token
from level0_naive.loader import LoadedModel, load_model
from level0_naive.metrics import Counter, Metric, Vector
from level0_naive.outputs import logprob_entries
from level0_naive.sampling import is_plain_greedy, probabilities
from level0_naive.stats import Timer
from level1_paged.worker import ModelInput, Worker
from level2_continuous.engine import SamplerOutput
from level2_continuous.scheduler import Scheduler, SchedulerOutput
from level3_prefix.engine import LLM as PrefixLLM
from level3_prefix.engine import LLMEngine as PrefixEngine

from .config import SpeculativeConfig, SpeculativeEngineConfig
from .proposers import DraftModelProposer, NgramProposer, Proposal, Proposer, draft_state
from .rejection_sampler import greedy_verify, rejection_sample
from .request import SpecRequest
from .scheduler import SpecScheduler


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters; `accepted_per_pos` has one entry per draft position (bounded)."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # drafts that ended in a rejection (the others were accepted whole)
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # time in the proposer

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        self.num_rejections += accepted < k
        for i in range(k):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """Leviathan's alpha: accepted / draft tokens actually judged (judging stops at a rejection).
        Under i.i.d. acceptance, P(first i drafts accepted) = alpha**i."""
        judged = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / judged if judged else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying step, the bonus or recovered token included (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position(self) -> list[float]:
        """P(draft token i is accepted | it was proposed): compare with alpha**i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]


class LLMEngine(PrefixEngine):
    config_class = SpeculativeEngineConfig
    sequence_class = SpecRequest

    # --- construction: the draft model, the KV split, the proposer, the scheduler -------------
    def load_model(self) -> LoadedModel:
        loaded = super().load_model()
        self.load_draft(loaded)
        return loaded

    def load_draft(self, target: LoadedModel) -> None:
        """The draft model (whole, on this process), checked against the target's vocabulary."""
        self.spec: SpeculativeConfig | None = self.config.speculative_config
        self.draft: LoadedModel | None = None
        if self.spec is not None and self.spec.method == "draft_model":
            self.draft = load_model(self.spec.model, self.dtype, self.device)
            tv, dv = target.config.vocab_size, self.draft.config.vocab_size
            if tv != dv:
                raise ValueError(f"speculative_config.model {self.spec.model!r} has a vocabulary of {dv} tokens; "
                                 f"the target's has {tv}: a draft must share the target's vocabulary")  # fmt: skip
        k = self.spec.num_speculative_tokens if self.spec is not None else 0
        self.spec_stats = SpecDecodeStats(accepted_per_pos=[0] * k, drafted_per_pos=[0] * k)

    def kv_bytes_per_token(self) -> int:
        """Target and draft caches have the same number of blocks, so the KV budget is split in
        proportion to what one token costs in each."""
        target = super().kv_bytes_per_token()
        return target + (kv_bytes_per_token(self.draft.config, self.dtype) if self.draft else 0)

    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)  # level 2: the target's worker, the KV manager, the scheduler
        self.proposer: Proposer | None = self.make_proposer()
        self._proposals: dict[int, Proposal] = {}  # this step's drafts, from prepare_input to sample

    def make_proposer(self) -> Proposer | None:
        """The draft model's own Worker (same block count and block tables as the target), or n-grams."""
        if self.spec is None:
            return None
        if self.draft is None:
            return NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        if self.draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config.model {self.spec.model!r} handles {self.draft.config.max_position_embeddings} "
                             f"positions, fewer than max_model_len={self.max_model_len}")  # fmt: skip
        draft_worker = Worker(self.draft.model, self.num_blocks, self.config.block_size, self.config.attention_backend)
        return DraftModelProposer(draft_worker, self.kv.block_table, self.config.block_size)

    def make_scheduler(self) -> Scheduler:
        if self.spec is None:
            return super().make_scheduler()
        c = self.config
        return SpecScheduler(
            self.kv,
            c.max_num_batched_tokens,
            c.max_num_seqs,
            c.policy,
            num_speculative_tokens=self.spec.num_speculative_tokens,
            disable_by_batch_size=self.spec.disable_by_batch_size,
        )

    # --- the step ------------------------------------------------------------------------------
    def prepare_input(self, sched: SchedulerOutput) -> ModelInput:
        """Draft, then build the target's batch: [last token, d_1..d_k] for each speculating request."""
        if self.proposer is None:
            return super().prepare_input(sched)
        with Timer() as t:
            self._proposals = self.proposer.propose(sched)
        self.spec_stats.draft_seconds += t.seconds
        self._trim_to_proposals(sched)
        chunks, tables, num_logits = [], [], []
        for req, n in sched.scheduled:
            k, start = sched.num_spec.get(req.seq_id, 0), req.num_computed_tokens
            drafts = self._proposals[req.seq_id].token_ids if k else []
            chunks.append((req.token_slice(start, n - k) + drafts, start))
            tables.append(self.kv.block_table(req))
            num_logits.append(k + 1 if k else int(start + n == req.num_tokens))
        return ModelInput.build(chunks, tables, self.config.block_size, num_logits)

    def _trim_to_proposals(self, sched: SchedulerOutput) -> None:
        """A proposer may find fewer tokens than scheduled (an n-gram with no match): verify only those."""
        for i, (req, n) in enumerate(sched.scheduled):
            k = sched.num_spec.get(req.seq_id, 0)
            got = len(self._proposals[req.seq_id].token_ids) if k else 0
            if got < k:
                sched.scheduled[i] = (req, n - (k - got))
                if got:
                    sched.num_spec[req.seq_id] = got
                else:
                    del sched.num_spec[req.seq_id]

    @torch.inference_mode()
    def sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> SamplerOutput:
        """logits [S, V]: k + 1 rows for a speculating request, 1 for a plain one (batch order)."""
        if self.proposer is None:
            return super().sample(sched, logits)
        out, row = SamplerOutput(), 0
        plain, plain_rows, spec = [], [], []
        for req, n in sched.scheduled:
            k = sched.num_spec.get(req.seq_id, 0)
            if k:
                spec.append((req, k, row))
                row += k + 1
            elif req.num_computed_tokens + n == req.num_tokens:
                plain.append(req)
                plain_rows.append(row)
                row += 1
        emitted = self._verify(spec, logits) if spec else {}
        if plain:
            tokens, logprobs = self.sample_tokens(logits[plain_rows], plain)
            emitted.update({req.seq_id: ([t], [lp]) for req, t, lp in zip(plain, tokens, logprobs)})
        for req, _ in sched.scheduled:  # batch order
            if req.seq_id in emitted:
                tokens, logprobs = emitted[req.seq_id]
                out.requests.append(req)
                out.token_ids.append(tokens)
                out.logprobs.append(logprobs)
        for req, k, _ in spec:
            out.num_rejected[req.seq_id] = k - (len(emitted[req.seq_id][0]) - 1)
        return out

    def _verify(
        self, spec: list[tuple[SpecRequest, int, int]], logits: torch.Tensor
    ) -> dict[int, tuple[list[int], list]]:
        """Rejection sampling for every speculating request; greedy ones take the exact-match path."""
        K, V = max(k for _, k, _ in spec), logits.shape[-1]
        draft = torch.zeros(len(spec), K, dtype=torch.long)
        num_draft = torch.tensor([k for _, k, _ in spec])
        for i, (req, k, _) in enumerate(spec):
            draft[i, :k] = torch.tensor(self._proposals[req.seq_id].token_ids)
        rows = [logits[r : r + k + 1] for _, k, r in spec]  # each [k+1, V]
        target_argmax = torch.zeros(len(spec), K + 1, dtype=torch.long)
        p = torch.zeros(len(spec), K + 1, V, dtype=logits.dtype)
        sampled = []
        for i, (req, k, _) in enumerate(spec):
            if is_plain_greedy(req.params):
                target_argmax[i, : k + 1] = rows[i].argmax(-1)
                continue
            states = [draft_state(req, draft[i, :j].tolist()) for j in range(k + 1)]
            p[i, : k + 1] = probabilities(rows[i], states)  # processed exactly as the draft's q was
            if req.params.greedy:
                target_argmax[i, : k + 1] = p[i, : k + 1].argmax(-1)
            else:
                sampled.append(i)
        results = dict(zip(range(len(spec)), zip(*greedy_verify(draft, num_draft, target_argmax))))
        if sampled:
            q = torch.stack([self._draft_probs(spec[i][0], spec[i][1], K, V, logits.dtype) for i in sampled])
            toks, accepted = rejection_sample(
                draft[sampled], num_draft[sampled], q, p[sampled], [spec[i][0].generator for i in sampled]
            )
            results.update(zip(sampled, zip(toks, accepted)))
        emitted = {}
        for i, (req, k, _) in enumerate(spec):
            tokens, accepted = results[i]
            self.spec_stats.record(k, accepted)
            lps = logprob_entries(rows[i][: len(tokens)], torch.tensor(tokens), [req] * len(tokens), self.tokenizer)
            emitted[req.seq_id] = (tokens, lps)
        return emitted

    def _draft_probs(self, req: SpecRequest, k: int, K: int, V: int, dtype) -> torch.Tensor:
        """q [K, V] for one request: what its proposer sampled from, or a point mass on each draft
        token when the proposer is deterministic (n-gram). Rows past k are padding."""
        prop: Proposal = self._proposals[req.seq_id]
        q = torch.zeros(K, V, dtype=dtype)
        if prop.probs is not None:
            q[:k] = prop.probs.to(dtype)
        else:
            q[torch.arange(k), torch.tensor(prop.token_ids)] = 1.0
        return q

    def update_from_output(self, sched: SchedulerOutput, out: SamplerOutput):
        moved = super().update_from_output(sched, out)
        if self.draft is not None:  # the draft's K/V past the verified tokens is stale now
            for req, _ in sched.scheduled:
                req.draft_num_computed = min(req.draft_num_computed, req.num_computed_tokens)
        self._proposals = {}
        return moved

    def num_shareable_tokens(self, req: SpecRequest) -> int:
        """A block is named (and so shareable) only when every token in it is verified in both caches."""
        if self.proposer is not None and self.proposer.has_kv_cache:
            return min(req.num_computed_tokens, req.draft_num_computed)
        return req.num_computed_tokens

    # --- metrics ---------------------------------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        s = self.spec_stats
        return super().get_metrics() + [
            Counter("vllm:spec_decode_num_drafts", value=s.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", value=s.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", value=s.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(s.accepted_per_pos)),
        ]


class LLM(PrefixLLM):
    """Level 3's front end over the speculative engine."""

    engine_class = LLMEngine

    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.llm_engine.spec_stats
