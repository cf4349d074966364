"""Level 4: level 3's engine with a proposer. Draft k tokens cheaply, verify them in one forward.

What it is: `SpeculativeEngine` (exported as `LLMEngine`) and `LLM` of level 3 with
`speculative_config` (vLLM's knob), drafting the vLLM V1 way: *after* a step, so the
next step's scheduler sees only "this request has k more tokens to compute"
(`SpecRequest`). What this level overrides:

    stage                 component                                  file
    make_kv_manager()     name a block once the draft's cache has it too  kv_cache_manager.py
    prepare_input()       the draft's cache follows the prompt chunks     proposers.py (prefill)
    sample()              each request's guesses judged (greedy, by position
                          or rejection sampling) over k + 1 logits rows  rejection_sampler.py
    post_step()           num_drafts, reserve KV slots, propose guesses  engine.py, proposers.py

One decoding request over two steps:

    step s, post_step:  the proposer drafts d_1..d_k (a draft model through its own paged
                        cache on the same block tables, or an n-gram lookup) and leaves them
                        on the request; their KV slots are reserved now, from free blocks
                        only (speculation never preempts anyone: fewer guesses instead)
    step s+1, schedule: 1 + k tokens, counted in the budget like any others
              forward:  [last token, d_1..d_k] as one query with k + 1 logits rows
                        (level 2's prepare_input; the paged kernel handles any query length)
              sample:   the rejection sampler keeps a prefix of the guesses and adds one
                        token: exactly the target's distribution (`rejection_sampler.py`)
              update:   level 2's `update_from_output` appends them one by one (a stop rule
                        cuts the run where it fires) and counts as computed only positions
                        up to the newest token: the rejected ones' K/V is overwritten later

Requests that prefill, or have no room for guesses, run as at level 3 in the same
batch. Without `speculative_config` this is level 3, step for step.

What it is not: a tree or multi-draft speculator, or overlapped drafting. Sampling
from q and p per row is a Python loop over rows, as level 0's sampler is.

Reference: Leviathan et al. (ICML 2023); Chen et al. (2023); vLLM `v1/spec_decode/`,
`v1/worker/gpu_model_runner.py` (spec decode metadata, `logits_indices`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ladder.metrics import Counter, Metric, Vector
from level0_naive.kv_cache import kv_bytes_per_token
from level0_naive.loader import LoadedModel, load_model
from level0_naive.outputs import logprob_entries
from level0_naive.stats import Timer
from level1_paged.engine import compilation_for
from level1_paged.model_input import ModelInput
from level1_paged.worker import Worker
from level2_continuous.scheduler import ModelRunnerOutput, SchedulerOutput
from level3_prefix.engine import LLM as PrefixLLM
from level3_prefix.engine import PrefixCachingEngine

from .config import SpeculativeConfig
from .kv_cache_manager import DraftAwareKVCacheManager
from .proposers import DraftModelProposer, NgramProposer, Proposer, draft_state
from .rejection_sampler import Guesses, verify
from .request import SpecRequest


def num_drafts(req: SpecRequest, k: int, batch_size: int, disable_by_batch_size: int | None) -> int:
    """How many guesses a request may make for its next step: k while it is decoding (feeding
    the one token it sampled last), fewer near `max_model_len` or its `max_tokens` (a step emits
    at most k + 1 tokens: no point verifying a guess it could not keep), none while it prefills
    or recomputes. With `disable_by_batch_size`, none while more requests run than that: a busy
    target gains little from verifying k + 1 tokens per request, and on a CPU, where a step's
    cost grows with its tokens, it loses. (The step's token budget may still cut some: level 2's
    scheduler schedules what fits, and only the guesses scheduled are verified.)"""
    crowded = disable_by_batch_size is not None and batch_size > disable_by_batch_size
    if not req.is_decoding or crowded:
        return 0
    remaining = req.max_total_tokens - req.num_tokens  # tokens it may still add (max_tokens, max_model_len)
    return max(0, min(k, remaining - 1))


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


class SpeculativeEngine(PrefixCachingEngine):
    config_parts = {**PrefixCachingEngine.config_parts, "speculative": SpeculativeConfig}
    sequence_class = SpecRequest

    # --- construction: the draft model, the KV split, the proposer, the scheduler -------------
    def load_model(self) -> LoadedModel:
        loaded = super().load_model()
        self.load_draft(loaded)
        return loaded

    def load_draft(self, target: LoadedModel) -> None:
        """The draft model (whole, on this process), checked against the target's vocabulary; a
        public step of loading, so that a level that loads its target otherwise (level 5: only
        its metadata, on the driver) still gets its draft."""
        self.speculative_config: SpeculativeConfig | None = self.config.speculative
        self.draft: LoadedModel | None = None
        if self.speculative_config is not None and self.speculative_config.method == "eagle":
            from .eagle import load_eagle  # a head over the target's own features (eagle.py)

            self.draft = load_eagle(self.speculative_config.model, target, self.dtype, self.device, self.ops)
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            self.draft = load_model(self.speculative_config.model, self.dtype, self.device, self.ops)
            tv, dv = target.config.vocab_size, self.draft.config.vocab_size
            if tv != dv:
                raise ValueError(f"speculative_config.model {self.speculative_config.model!r} has a vocabulary of {dv} tokens; "
                                 f"the target's has {tv}: a draft must share the target's vocabulary")  # fmt: skip
        k = self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0
        self.spec_stats = SpecDecodeStats(accepted_per_pos=[0] * k, drafted_per_pos=[0] * k)

    def kv_bytes_per_token(self) -> int:
        """Target and draft caches have the same number of blocks, so the KV budget is split in
        proportion to what one token costs in each."""
        return super().kv_bytes_per_token() + self.draft_kv_bytes_per_token()

    def draft_kv_bytes_per_token(self) -> int:
        """What one token costs in the draft's cache (0 without a draft model). EAGLE's head also keeps the
        target's feature of each token it has not read yet (eagle.py files them): a row of the hidden size,
        counted per token too, since while a crowded batch does not draft (`disable_by_batch_size`) the head
        does not catch up and a running request's rows wait for it, one per token it holds in the cache (and
        none once its blocks are freed: kv_cache_manager.py drops them)."""
        if self.draft is None:
            return 0
        cache = kv_bytes_per_token(self.draft.config, self.dtype)
        if self.speculative_config.method == "eagle":
            cache += self.draft.config.hidden_size * self.dtype.itemsize  # (the features: the target's dtype)
        return cache

    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)  # level 2: the target's worker, the KV manager, the scheduler
        self.proposer: Proposer | None = self.make_proposer()

    def make_proposer(self) -> Proposer | None:
        """The draft model's own Worker (same block count and block tables as the target), or n-grams."""
        if self.speculative_config is None:
            return None
        if self.draft is None:
            return NgramProposer(self.speculative_config.prompt_lookup_min, self.speculative_config.prompt_lookup_max)
        if self.draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config.model {self.speculative_config.model!r} handles {self.draft.config.max_position_embeddings} "
                             f"positions, fewer than max_model_len={self.max_model_len}")  # fmt: skip
        c, eagle = self.config.cache, self.speculative_config.method == "eagle"
        draft_worker = Worker(self.draft.model, self.num_blocks, c.block_size, c.attention_backend,
                              self.config.model.batch_invariant, compilation_for(self.config))  # fmt: skip
        if eagle:
            from .eagle import EagleProposer

            return EagleProposer(draft_worker, self.worker.runner, self.kv.block_table, c.block_size, self.sampler)
        return DraftModelProposer(draft_worker, self.kv.block_table, c.block_size, self.sampler)

    @property
    def fork_samples(self) -> bool:
        """n > 1 samples fork after the prompt (level 3) unless a draft model keeps a second cache,
        which the forks' copy-on-write would have to copy too (not done: they prefill, as at level 2)."""
        return self.draft is None

    def make_kv_manager(self):
        """Level 3's, but a block is named only once the draft's cache holds it too."""
        if self.draft is None:
            return super().make_kv_manager()
        c = self.config.cache
        if c.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config with a draft model is not built (the connector would have to "
                             "move the draft's cache too): use method='ngram' or no speculation")  # fmt: skip
        return DraftAwareKVCacheManager(self.num_blocks, c.block_size, c.enable_prefix_caching)

    # --- the step ------------------------------------------------------------------------------
    def prepare_input(self, sched: SchedulerOutput) -> ModelInput:
        """Level 2's batch; first, the draft's cache takes this step's prompt chunks too."""
        if self.proposer is not None:
            with Timer() as t:
                self.proposer.prefill(sched)
            self.spec_stats.draft_seconds += t.seconds
        return super().prepare_input(sched)

    @torch.inference_mode()
    def sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> ModelRunnerOutput:
        """logits [S, V]: k + 1 rows for a request verifying k guesses, 1 for a plain one (batch order)."""
        if self.proposer is None:
            return super().sample(sched, logits)
        self.proposer.observe(sched)  # (EAGLE files the target's features of the step's rows)
        plain, plain_rows, spec, row = [], [], [], 0
        for req, n in sched.scheduled:
            rows = req.num_logits(n)
            if rows > 1:
                spec.append((req, rows - 1, row))
            elif rows:
                plain.append(req)
                plain_rows.append(row)
            row += rows
        emitted = self._verify(spec, logits) if spec else {}
        if plain:
            tokens, logprobs = self.sample_tokens(logits[plain_rows], plain)
            emitted.update({req.seq_id: ([t], [lp]) for req, t, lp in zip(plain, tokens, logprobs)})
        out = ModelRunnerOutput()
        for req, _ in sched.scheduled:  # batch order
            if req.seq_id in emitted:
                tokens, logprobs = emitted[req.seq_id]
                out.requests.append(req)
                out.token_ids.append(tokens)
                out.logprobs.append(logprobs)
        return out

    def post_step(self, sched: SchedulerOutput) -> None:
        """The step's tokens are in: guesses for the next step, for each request that may make some."""
        if self.proposer is None:
            return
        c, batch_size = self.speculative_config, len(self.scheduler.running)
        with Timer() as t:
            drafting = []
            for req, _ in sched.scheduled:
                req.drop_spec_tokens()  # verified this step (or cut by the budget: then never verified)
                if self.proposer.has_kv_cache:  # the draft's K/V past the verified tokens is stale now
                    req.draft_num_computed = min(req.draft_num_computed, req.num_computed_tokens)
                if req.is_finished:
                    continue
                k = num_drafts(req, c.num_speculative_tokens, batch_size, c.disable_by_batch_size)
                if k := self.reserve_slots(req, k):
                    drafting.append((req, k))
            if drafting:
                self.proposer.propose(drafting)
                if self.proposer.has_kv_cache:  # the draft caught up: blocks both caches now hold can be named
                    for req, _ in drafting:  # (without a draft cache, update_from_output named them already)
                        self.kv.cache_blocks(req)
        self.spec_stats.draft_seconds += t.seconds

    def reserve_slots(self, req: SpecRequest, k: int) -> int:
        """KV slots for k guesses (the draft writes them now, the target verifies them next step),
        from free blocks only: when they run out, as many guesses as the request's blocks hold."""
        if k and not self.kv.allocate_slots(req, 1 + k):  # positions up to num_tokens + k
            k = max(0, len(self.kv.block_table(req)) * self.config.cache.block_size - req.num_tokens)
        return k

    def _verify(
        self, spec: list[tuple[SpecRequest, int, int]], logits: torch.Tensor
    ) -> dict[int, tuple[list[int], list]]:
        """Every speculating request's guesses judged (rejection_sampler.verify decides each one's path), the
        counters kept, the logprobs of what it emits. spec[i] = (request, k, its first logits row)."""
        batch = []
        for req, k, row in spec:
            draft = req.spec_token_ids[:k]  # the budget may have cut the rest
            plain = self.sampler.is_plain_greedy(req.params)  # its argmax needs no per-position state
            states = [] if plain else [draft_state(req, draft[:j]) for j in range(k + 1)]  # as the draft's q was
            q = None if req.spec_probs is None else req.spec_probs[:k]  # None: a point mass (n-grams)
            batch.append(Guesses(draft, logits[row : row + k + 1], req.params, states, q))
        emitted = {}
        for (req, k, _), g, (tokens, accepted) in zip(spec, batch, verify(batch, self.sampler)):
            self.spec_stats.record(k, accepted)
            ids = torch.tensor(tokens, device=g.logits.device)  # the emitted tokens, back on the logits' device
            lps = logprob_entries(g.logits[: len(tokens)], ids, [req.params.logprobs] * len(tokens),
                                  self.tokenizer)  # fmt: skip
            emitted[req.seq_id] = (tokens, lps)
        return emitted

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

    engine_class = SpeculativeEngine

    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.llm_engine.spec_stats


LLMEngine = SpeculativeEngine  # vLLM's name
