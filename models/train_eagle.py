"""Train an EAGLE draft head over the frozen built-in target: `models/tiny-shakespeare-eagle/`.

What this is: EAGLE-1 (Li et al., ICML 2024), trained here on a CPU in minutes. A speculative draft that
is not a separate model: one decoder layer that reads the target's own last hidden state f_t (what its
LM head reads, after the final norm) beside the embedding of the token that came next, and predicts the
target's next hidden state; the target's own LM head turns that into a token. Drafting k tokens is k
passes of one layer, where a draft model runs all its layers k times, and the head starts from what the
target already computed.

    row t of the head:   x_t = fc([embed(tok_{t+1}) ; f_t])      [2H] -> [H]
                         g_t = norm(layer(x_0 .. x_t))           causal, RoPE at position t + 1
                         g_t ~ f_{t+1}, and lm_head(g_t) ~ the target's next token, tok_{t+2}
    drafting from a step whose target computed f_t and sampled tok_{t+1}:
                         d_1 = argmax lm_head(g_t); then row t+1 = ([embed(d_1) ; g_t]) gives d_2, ...
                         (from the second draft on, the head reads its own g, not the target's f)

The loss is EAGLE's: smooth L1 between g_t and f_{t+1} (the features are what the next row reads),
plus 0.1 x the cross-entropy of lm_head(g_t) against the target's own distribution at t + 1 (what
the draft must agree with). The features the head reads in training get uniform noise (EAGLE's
U(-0.1, 0.1)), because in drafting it reads its own, imperfect ones.

Saved (`save`): `fc.weight` [H, 2H], the layer (`layers.0.*`, Llama's names), `norm.weight`, in
safetensors, and a config.json: the target's config with one layer, `architectures:
["EagleLlamaForCausalLM"]` (vLLM's name for an EAGLE-1 Llama head) and an `eagle` section naming the
target and the features it reads. The embeddings and the LM head are the target's, not stored.

`acceptance` measures what the head buys in greedy speculation: on held-out prompts the target writes
its greedy continuation; from every position of it the head drafts k tokens, reading the target's true
features up to that position and its own after; a draft is accepted while it equals the target's token.
Reported: the acceptance at each draft position j (P(d_j right | d_1..d_{j-1} right)), and the mean
tokens a step then makes for k = 1..5 (accepted drafts plus the target's own token).

What this is not: the proposer that runs the head inside the engine (level4_speculative/eagle.py, which
reads these files), EAGLE-2's dynamic draft trees or EAGLE-3's fusion of three layers' features.

Usage:
    python models/train_eagle.py train --corpus ../shared/corpus/tinyshakespeare.txt \
        --target models/tiny-shakespeare --out models/tiny-shakespeare-eagle
    python models/train_eagle.py acceptance --corpus ../shared/corpus/tinyshakespeare.txt \
        --target models/tiny-shakespeare --head models/tiny-shakespeare-eagle

Reference: Li, Wei, Zhang, Zhang, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty" (ICML 2024) and its code (`eagle/model/cnets.py`: fc over [embedding; feature], one
decoder layer; the loss); vLLM `model_executor/models/llama_eagle.py` (the checkpoint's names).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ladder.models import train_tiny_module  # the script beside this one: its corpus split, loader, schedule

_tiny = train_tiny_module()
PAD_ID, load_corpus, load_hf, lr_at, random_batch = (_tiny.PAD_ID, _tiny.load_corpus, _tiny.load_hf, _tiny.lr_at,
                                                      _tiny.random_batch)  # fmt: skip

NOISE = 0.1  # EAGLE's uniform noise on the features read in training
CLS_WEIGHT = 0.1  # the classification loss's weight beside the features' (EAGLE's)


class EagleHead(nn.Module):
    """fc over [embedding ; feature], one Llama decoder layer, a norm (the module docstring draws it)."""

    def __init__(self, target_config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        cfg = type(target_config).from_dict({**target_config.to_dict(), "num_hidden_layers": 1})
        cfg._attn_implementation = "sdpa"  # causal without a mask (no cache: every call sees its rows whole)
        h = cfg.hidden_size
        self.config = cfg
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, 0)])
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds [B, L, H] (row t: the token at position t + 1), features [B, L, H] (row t: f_t) -> g [B, L, H]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [B, L, H]
        positions = torch.arange(1, x.shape[1] + 1, device=x.device)[None].expand(x.shape[0], -1)  # [B, L]
        for layer in self.layers:
            x = layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.norm(x)


def target_features(target, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] -> the target's last hidden states after its final norm [B, L, H]: what its LM head reads."""
    return target.model(input_ids=ids).last_hidden_state


def train(args) -> dict:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    target = load_hf(args.target)
    for p in target.parameters():
        p.requires_grad_(False)
    head = EagleHead(target.config)
    train_ids, _ = load_corpus(args.corpus)
    decay = [p for n, p in head.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in head.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))  # fmt: skip
    schedule = argparse.Namespace(lr=args.lr, min_lr=args.lr / 10, warmup=max(1, args.steps // 20), steps=args.steps)
    t0, log = time.perf_counter(), []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule)
        x, _ = random_batch(train_ids, args.batch_size, args.block + 1, gen)  # [B, T+1] bytes
        with torch.no_grad():
            f = target_features(target, x)  # [B, T+1, H]
            p_next = F.softmax(target.lm_head(f[:, 1:]), dim=-1)  # [B, T, V] the target's at t + 1
            noisy = f[:, :-1] + (torch.rand(f[:, :-1].shape, generator=gen) * 2 - 1) * NOISE  # [B, T, H]
            embeds = target.model.embed_tokens(x[:, 1:])  # [B, T, H] row t: the token at t + 1
        g = head(embeds, noisy)  # [B, T, H]
        reg = F.smooth_l1_loss(g, f[:, 1:])
        cls = -(p_next * F.log_softmax(target.lm_head(g), dim=-1)).sum(-1).mean()
        loss = reg + CLS_WEIGHT * cls
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            log.append({"step": step, "reg": round(reg.item(), 4), "cls": round(cls.item(), 4)})
            print(json.dumps(log[-1]), flush=True)
    return {"head": head, "seconds": time.perf_counter() - t0, "log": log}


def save(head: EagleHead, out: Path, target: str, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items() if "rotary" not in k}
    save_file(state, str(out / "model.safetensors"))
    cfg = {**head.config.to_dict(), "architectures": ["EagleLlamaForCausalLM"], "dtype": "bfloat16",
           "eagle": {"method": "eagle", "target": target, "features": "the target's last hidden state, after its final norm",
                     "embeddings": "the target's", "lm_head": "the target's"}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "train_log.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_head(path: str | Path, target) -> EagleHead:
    from safetensors.torch import load_file

    head = EagleHead(target.config)
    missing, unexpected = head.load_state_dict(load_file(str(Path(path) / "model.safetensors")), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return head.float().eval()


@torch.no_grad()
def acceptance(target, head: EagleHead, val_ids: torch.Tensor, prompts: int = 16, prompt_len: int = 64,
               gen_len: int = 192, k: int = 5) -> dict:  # fmt: skip
    """Greedy speculation with the head on the target's own held-out continuations (module docstring)."""
    stride = (len(val_ids) - prompt_len) // prompts
    starts = torch.arange(prompts) * stride
    seq = val_ids[starts[:, None] + torch.arange(prompt_len)]  # [P, prompt_len]
    out = target.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=gen_len, do_sample=False,
                          pad_token_id=PAD_ID)  # fmt: skip  [P, prompt_len + gen_len]
    return acceptance_on(target, head, out, prompt_len, k)


@torch.no_grad()
def acceptance_on(target, head: EagleHead, out: torch.Tensor, prompt_len: int, k: int = 5) -> dict:
    """out [P, L]: prompts and the target's greedy continuations. From every continuation position t (the
    target has computed f_0..f_t; tok_{t+1} is its token), the head drafts d_1..d_k; accepted while equal to
    the target's tokens tok_{t+2}, ... . Each draft step is one batched pass over every start of a row (rows
    after a start's own do not reach it: the attention is causal)."""
    P, L = out.shape
    f = target_features(target, out)  # [P, L, H]
    emb = target.model.embed_tokens
    right, tried = [0] * k, [0] * k
    for p in range(P):
        ts = torch.arange(prompt_len - 1, L - 2)  # starts: f_t known, tok_{t+1} the target's, tok_{t+2} to draft
        n = len(ts)
        feats = f[p, :-1].expand(n, -1, -1).clone()  # [n, L-1, H] row s: f_s
        toks = out[p, 1:].expand(n, -1).clone()  # [n, L-1] row s: tok_{s+1}
        alive = torch.ones(n, dtype=torch.bool)
        for j in range(k):
            at = ts + j  # each start's row for draft j
            ok = at + 1 < L - 1  # a token to check it against
            g = head(emb(toks), feats)[torch.arange(n), at.clamp(max=L - 2)]  # [n, H] g of that row
            d = target.lm_head(g).argmax(-1)  # [n] draft j + 1
            truth = out[p, (at + 2).clamp(max=L - 1)]  # [n] the target's token there
            counted = alive & ok
            tried[j] += int(counted.sum())
            alive = counted & (d == truth)
            right[j] += int(alive.sum())
            nxt = (at + 1).clamp(max=L - 2)  # the next row reads this draft and this g
            toks[torch.arange(n), nxt] = torch.where(ok, d, toks[torch.arange(n), nxt])
            feats[torch.arange(n), nxt] = torch.where(ok[:, None], g, feats[torch.arange(n), nxt])
    rates = [r / t if t else 0.0 for r, t in zip(right, tried)]  # P(d_j right | d_1..d_{j-1} right)
    tokens_per_step, run = [], 1.0
    for j in range(k):  # with k drafts: 1 (the target's token) + P(d_1) + P(d_1 d_2) + ...
        run *= rates[j]
        tokens_per_step.append((tokens_per_step[-1] if tokens_per_step else 1.0) + run)
    return {"acceptance_by_position": [round(r, 4) for r in rates], "positions": tried[0],
            "tokens_per_step_k1_to_k": [round(x, 3) for x in tokens_per_step]}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--corpus", required=True)
    t.add_argument("--target", default="models/tiny-shakespeare")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--block", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=1337)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--threads", type=int, default=1)
    a = sub.add_parser("acceptance")
    a.add_argument("--corpus", required=True)
    a.add_argument("--target", default="models/tiny-shakespeare")
    a.add_argument("--head", default="models/tiny-shakespeare-eagle")
    a.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.command == "train":
        done = train(args)
        _, val_ids = load_corpus(args.corpus)
        target = load_hf(args.target)
        head = done["head"].to(torch.bfloat16).float().eval()  # measured as saved: bfloat16 weights
        acc = acceptance(target, head, val_ids)
        meta = {"seed": args.seed, "steps": args.steps, "batch_size": args.batch_size, "block": args.block,
                "lr": args.lr, "train_seconds": round(done["seconds"], 1), "threads": args.threads,
                "parameters": sum(p.numel() for n, p in head.named_parameters()), "acceptance": acc,
                "log": done["log"]}  # fmt: skip
        save(head, Path(args.out), Path(args.target).name, meta)
        print(json.dumps({k: v for k, v in meta.items() if k != "log"}, indent=2))
    else:
        _, val_ids = load_corpus(args.corpus)
        target = load_hf(args.target)
        print(json.dumps(acceptance(target, load_head(args.head, target), val_ids), indent=2))


if __name__ == "__main__":
    main()
