"""EAGLE: draft from the target's own last hidden states with one trained decoder layer.

What it is: `speculative_config={"method": "eagle", "model": "tiny-shakespeare-eagle", ...}` (vLLM's
names). The head (models/train_eagle.py trains it; models/README.md is its card) is `EagleModel`: an
fc over [the token's embedding ; the target's feature at the position before], one decoder layer of
level 0's, a norm, and the target's own embeddings and LM head (shared, not copied). It runs through
its own `Worker`, so it has its own paged KV cache (one layer) on the target's block tables, as the
draft model's does (proposers.py).

    token position p:        0    1              2              ...  L-1                    |  L   (drafting)
    the head's row for p:    -   [e(t1); f0]    [e(t2); f1]     ...  [e(t_{L-1}); f_{L-2}]  |  [e(d1); g_{L-1}] ...
    written at slot:         -    0              1              ...  L-2                    |  L-1
    its output g_p           -> lm_head -> the token at p + 1 (d1 from g_{L-1}, d2 from g_L, ...)

Position 0 has no feature before it, so no row (the head was never trained on one). Row p is written at
slot p - 1, and rotated at position p - 1 (RoPE is relative: moving every row by one changes nothing a
row sees), so the head's slots fill from 0 with no gap and none holds what an earlier request left
there. `draft_num_computed` counts the head's slots (rows 1 .. d fill slots 0 .. d - 1), so a block is
named only once the head holds it too, as for a draft model: that needs the row of the token after the
block. This is vLLM's layout (its slot p holds the target's h_p beside the token t_{p+1}).

f_p is the target's last hidden state (after its final norm) at position p: the target's runner keeps
its step's rows (`ModelRunner.keep_hidden`), and `observe` files each scheduled request's rows by
position after the forward (a verification's rows past the accepted guesses are simply never read:
the catch-up reads f only below the request's newest token), and runs the head over the step's prompt
chunks at once (their tokens are known), as a draft model's prefill does, so that their blocks can be
named even for a request that never drafts. The filed rows wait until the head has read them (a crowded
batch that does not draft leaves a row per token the request holds in the cache), so the engine's KV
budget counts one per token (engine.py's `draft_kv_bytes_per_token`), and they go with the request's
blocks (preempted, finished: kv_cache_manager.py). `propose` then catches the head up to the newest token
(rows after its newest slot, each reading the target's feature one position back), samples d_1 from
its last row, and runs k - 1 one-row passes, each reading the head's own g. A request admitted on a
prefix hit of c tokens has the head's slots below c (the hit's blocks): its first row is c + 1, whose
feature f_c this step's forward computes. A checkpoint's copy of the embeddings or LM head is dropped,
never loaded into the target's modules the head shares.

With the compiled step (features/compilation, a CPU's default) the target runs compiled and its hidden
states are the graph's output, kept the same way. The head runs eager by default: compiled, it was
slower per pass on a CPU at batch 1 (624-690 against 565-594 us a forward, `python -m
benchmarks.compiled_step --eagle`: one layer saves fewer dispatches than Dynamo's and the runner's
per-call costs add). Asked for (`compilation_config`, on a GPU where its pieces are captured), it is
compiled too, its features a graph input (`step_inputs`: the compiled runner passes them beside the
tokens; an attribute read inside the graph would be a constant of it).

Over level 5's tensor-parallel ranks the head runs on the driver, as a draft model does there, beside a
copy of the target's two ends (`target_ends`: embeddings and LM head, read from the checkpoint; the
driver holds no other target weights), and reads the hidden states of the driver's own rank: every TP
rank holds them whole after the last layer's all-reduce, so they cost no message. Not on every rank:
the head's cache and sampling would then be repeated tp times for the same drafts.

What it is not: EAGLE-2's draft trees or EAGLE-3's fused features; the head with pipeline parallelism
(refused: the last stage's hidden states would have to travel to the driver too).

Reference: Li et al., "EAGLE" (ICML 2024); vLLM `v1/spec_decode/eagle.py` (EagleProposer: the target's
hidden states in, the head's own KV cache, drafts after sampling), `model_executor/models/llama_eagle.py`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ladder.models import resolve_path
from level0_naive.loader import LoadedModel, model_config_from_hf
from level0_naive.model import DecoderLayer, Linear, ModelConfig, RMSNorm, Transformer, rope_inv_freq
from level0_naive.ops import DEFAULT_OPS, Ops
from level0_naive.sampler import Sampler
from level1_paged.model_input import ModelInput
from level1_paged.worker import Worker

from .proposers import DraftModelProposer
from .request import SpecRequest


class EagleModel(nn.Module):
    """`EagleModel(cfg, target)(input_ids [T], positions [T], attn) -> g [T, H]`, reading `self.features` [T, H]
    (row i: the feature at the position before input i's), which the proposer sets before each forward."""

    compile_by_default = False  # the compiled step's room leaves it eager unless compilation is asked for (why: above)

    def __init__(self, cfg: ModelConfig, target: Transformer):
        super().__init__()
        self.config = cfg  # the target's shape, one layer: what the head's paged cache is sized by
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_tokens, self.lm_head = target.model.embed_tokens, target.lm_head  # the target's own
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.features: torch.Tensor | None = None
        self.ops = DEFAULT_OPS  # the head's own modules' (set_ops); the shared two keep the target's

    def set_ops(self, ops: Ops) -> None:
        """Route the head's own linears, norms and RoPE through `ops` (not the shared embeddings and LM head:
        they are the target's, and follow its ops)."""
        self.ops = ops
        for module in (*self.fc.modules(), *self.layers.modules(), *self.norm.modules()):
            if hasattr(module, "ops"):
                module.ops = ops

    def step_inputs(self, n: int | None = None) -> tuple[torch.Tensor, ...]:
        """The per-token inputs besides the tokens and positions, for the compiled runner to pass into its graph
        (an attribute read inside the graph would be a constant of it): this step's features [T, H]; `n`: zeros
        for n rows instead (the runner's warm-up)."""
        if n is None:
            return (self.features,)
        return (self.fc.weight.new_zeros(n, self.config.hidden_size),)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, features=None) -> torch.Tensor:
        """`features` [T, H]: the compiled runner passes them (`step_inputs`); the eager one leaves `self.features`."""
        features = self.features if features is None else features
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features], dim=-1))  # [T, 2H] -> [T, H]
        angles = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)  # [T, H]: g, the head's guess at the target's feature

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))


def target_ends(target: LoadedModel, dtype: torch.dtype, device, ops: Ops) -> Transformer:
    """The target's two ends alone, a model of no layers: its embeddings and LM head (and its final norm, which
    the head does not use) read from its checkpoint, every other tensor left unread. What the head shares when
    the target's layers live in other processes (level 5's ranks), so that the driver, where the head runs,
    holds these two and nothing more."""
    from safetensors import safe_open

    from level0_naive.loader import checkpoint_name, tensor_files

    cfg, files = target.config, tensor_files(Path(target.path))  # name -> its file
    with torch.device("meta"):
        ends = Transformer(replace(cfg, num_layers=0), ops)
    state = {}
    for name in ends.state_dict():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        stored = checkpoint_name(name, target.hf_config.get("model_type", ""))
        with safe_open(str(files[stored]), "pt") as f:
            state[name] = f.get_tensor(stored).to(dtype=dtype, device=device)
    ends.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        ends.lm_head.weight = ends.model.embed_tokens.weight
    ends.inv_freq = rope_inv_freq(cfg).to(device)  # (built on "meta" above; unused, but no tensor is left without values)
    return ends.eval()


def load_eagle(name: str, target: LoadedModel, dtype: torch.dtype, device, ops: Ops = DEFAULT_OPS) -> LoadedModel:
    """The head's checkpoint (config.json + model.safetensors, models/train_eagle.py's `save`) over `target`,
    checked: its hidden size and vocabulary must be the target's (it reads the target's features and shares
    its embeddings and LM head)."""
    from safetensors.torch import load_file

    path = resolve_path(name)
    hf = json.loads((Path(path) / "config.json").read_text())
    if "EagleLlamaForCausalLM" not in (hf.get("architectures") or []):
        raise ValueError(f"speculative_config.model {name!r} is not an EAGLE head (its config.json's architectures: "
                         f"{hf.get('architectures')}; models/train_eagle.py makes one)")  # fmt: skip
    cfg, tcfg = model_config_from_hf(hf), target.config
    if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ValueError(f"the EAGLE head {name!r} has hidden size {cfg.hidden_size} and a vocabulary of "
                         f"{cfg.vocab_size}; the target's are {tcfg.hidden_size} and {tcfg.vocab_size}")  # fmt: skip
    # (its embeddings and LM head: the target's modules; over level 5's ranks, where this process holds no
    # target weights, a copy of those two read from the target's checkpoint)
    model = EagleModel(cfg, target.model if target.model is not None else target_ends(target, dtype, device, ops))
    # A checkpoint may carry copies of the target's embeddings or LM head (some published heads do): they are
    # dropped, never loaded, since loading them would write into the target's own modules, which the head shares
    state = {k: v.to(dtype) for k, v in load_file(str(Path(path) / "model.safetensors")).items()
             if not k.startswith(("embed_tokens.", "lm_head."))}  # fmt: skip
    missing, unexpected = model.load_state_dict(state, strict=False)
    shared = {k for k in missing if k.startswith(("embed_tokens.", "lm_head."))}  # the target's
    if unexpected or set(missing) - shared:
        raise ValueError(f"the EAGLE head {name!r}: missing {sorted(set(missing) - shared)}, unexpected {unexpected}")
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = rope_inv_freq(cfg).to(device)  # float32, as the target's (.to(dtype) rounded it)
    # the target's ops for the head's own modules (ops.py: batch-invariant ones, say)
    model.set_ops(target.model.ops if target.model is not None else ops)
    return LoadedModel(model, cfg, None, [], Path(path), hf, {})


class EagleProposer(DraftModelProposer):
    """The draft model's proposer (its own Worker and paged cache, the same catch-up and sampling), with
    each of the head's rows given its feature: the target's, filed by `observe`, or the head's own g."""

    def __init__(self, worker: Worker, target_runner, block_table, block_size: int, sampler: Sampler):
        super().__init__(worker, block_table, block_size, sampler)
        self.target_runner = target_runner  # its `hidden` [T, H] after each forward: the target's features
        self.head = worker.model
        target_runner.keep_hidden = worker.runner.keep_hidden = True  # (the head's: its own g of its last rows)
        self.g: dict[int, torch.Tensor] = {}  # during `propose`: each drafting request's last g [H]

    def prefill(self, sched) -> None:
        """Nothing before the target's forward: the head's rows need the target's features of the step."""

    @torch.inference_mode()
    def observe(self, sched) -> None:
        """After the target's forward: each scheduled request's rows of it, filed by position; then the head's
        rows over this step's prompt chunks (their tokens are known, their features just filed), as a draft
        model's prefill keeps its cache with the prompt: a block is named only once the head holds it too, so
        without this a request that never drafts (one token; a crowded step) would name no prompt block."""
        hidden, row = self.target_runner.hidden, 0  # [T, H], rows in the batch's order
        chunks, feats, reqs = [], [], []
        for req, n in sched.scheduled:
            filed = getattr(req, "eagle_features", None)
            c = req.num_computed_tokens
            if filed is None or not filed[0] <= c <= filed[0] + len(filed[1]):  # a first step, a preemption, a hit
                filed = [c, hidden.new_empty(0, hidden.shape[1])]  # past what was filed: start afresh here
            start, kept = filed
            req.eagle_features = [start, torch.cat([kept[: c - start], hidden[row : row + n]])]  # (verified rows kept)
            row += n
            # the head's rows for the prompt's tokens after its newest slot, as far as both the token (the prompt's)
            # and the feature before it (this step's at the latest) are known
            first, last = req.draft_num_computed + 1, min(c + n, len(req.prompt_token_ids) - 1)
            if first <= last:
                chunks.append((req.token_slice(first, last - first + 1), first))
                feats.append(self._features(req, first, last - first + 1))
                reqs.append((req, 0))
                req.draft_num_computed = last  # its slots 0 .. last - 1
        if chunks:
            self._run(chunks, feats, reqs, sample=False)

    def _features(self, req: SpecRequest, first: int, n: int) -> torch.Tensor:
        """The target's features at positions first - 1 .. first + n - 2 (zeros where not filed)."""
        start, kept = getattr(req, "eagle_features", None) or (0, self.head.fc.weight.new_empty(0, 0))
        out = self.head.fc.weight.new_zeros(n, self.head.config.hidden_size)  # (on the head's device, in its dtype)
        for i in range(n):
            p = first - 1 + i - start
            if 0 <= p < len(kept):
                out[i] = kept[p]
        return out

    def catch_up(self, drafting: list[tuple[SpecRequest, int]]) -> torch.Tensor:
        """The draft model's catch-up, each row beside its feature; keeps each one's last g for `one_more`."""
        chunks, feats = [], []
        for req, _ in drafting:  # catch up to the newest token's row (its slot: the position before it)
            start = req.draft_num_computed + 1
            chunks.append((req.token_slice(start, req.num_tokens - start), start))
            feats.append(self._features(req, start, req.num_tokens - start))
            # Only these rows read the target's features: the guesses' rows below read the head's own, so
            # they are redone from the target's once verified (the count stays here, and the engine's cut
            # after a verification keeps it there)
            req.draft_num_computed = req.num_tokens - 1
            self._forget(req)
        logits, g_rows = self._run(chunks, feats, drafting)  # [D, V], [D, H]
        self.g = {r.seq_id: row for (r, _), row in zip(drafting, g_rows)}  # each one's last row's g
        return logits

    def one_more(self, active: list[tuple[SpecRequest, int]], drafts: dict) -> torch.Tensor:
        """One more token each, beside the head's own g of the row before (not counted in draft_num_computed:
        these rows are redone from the target's features once verified)."""
        step = [([drafts[r.seq_id][-1]], r.num_tokens + len(drafts[r.seq_id]) - 1) for r, _ in active]
        logits, g_rows = self._run(step, [self.g[r.seq_id][None] for r, _ in active], active)
        self.g.update({r.seq_id: row for (r, _), row in zip(active, g_rows)})
        return logits

    def _run(self, chunks, feats, reqs, sample: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the head over `chunks` (their features beside them) -> each chunk's last row's logits
        [D, V] and g [D, H] (what its next row reads); `sample=False`: the rows' K/V only (no logits row)."""
        w = self.head.fc.weight
        self.head.features = torch.cat(feats).to(device=w.device, dtype=w.dtype)  # [T, H]
        tables = [self.block_table(r) for r, _ in reqs]
        slots = [(tokens, first - 1) for tokens, first in chunks]  # row p at slot (and RoPE position) p - 1
        batch = ModelInput.build(slots, tables, self.block_size, [int(sample)] * len(chunks))
        logits = self.worker.execute(batch)
        return logits, self.worker.runner.hidden[batch.logits_indices.to(w.device)]  # (the rows the logits are of)

    @staticmethod
    def _forget(req: SpecRequest) -> None:
        """Features below the newest token's position - 1 are never read again (the head has those rows)."""
        start, kept = req.eagle_features if getattr(req, "eagle_features", None) else (0, None)
        if kept is not None:
            drop = max(0, req.num_tokens - 1 - start)  # the next catch-up starts at num_tokens at the latest
            req.eagle_features = [start + drop, kept[drop:]]


__all__ = ["EagleModel", "EagleProposer", "load_eagle"]
