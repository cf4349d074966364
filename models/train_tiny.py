"""Train the project's built-in models: a tiny Shakespeare target and its draft.

What this is: one script that builds a byte-level Hugging Face tokenizer,
trains a small Llama-architecture causal LM (`transformers.LlamaForCausalLM`)
on a text file, saves it with `save_pretrained` (bfloat16 safetensors, config,
generation config, tokenizer), optionally distils a draft model from a trained
target, and measures how often the draft's greedy token agrees with the
target's. The checkpoints in `models/tiny-shakespeare/` and
`models/tiny-shakespeare-draft/` were made by it; `models/README.md` has the
exact commands and the numbers they gave.

What this is not: a general training framework. One CPU process, no data
loader, no checkpoint resume, no dropout, no mixed-device tricks. The model is
Hugging Face's own Llama, not the engine's `level0_naive/model.py`, so that the
engine is tested against weights it did not help to make.

References: Karpathy's nanoGPT `train.py` and its `shakespeare_char` config
(the recipe: random windows, AdamW, warmup + cosine); char-rnn's Tiny
Shakespeare corpus; Hinton et al. 2015, "Distilling the Knowledge in a Neural
Network" (the KL-to-teacher loss); Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding" (why draft/target agreement matters).

Usage:
    python models/train_tiny.py train --preset target \
        --corpus ../shared/corpus/tinyshakespeare.txt --out models/tiny-shakespeare
    python models/train_tiny.py train --preset draft --distill-from models/tiny-shakespeare \
        --corpus ../shared/corpus/tinyshakespeare.txt --out models/tiny-shakespeare-draft
    python models/train_tiny.py agreement --target models/tiny-shakespeare \
        --draft models/tiny-shakespeare-draft --corpus ../shared/corpus/tinyshakespeare.txt
    python models/train_tiny.py sample --model models/tiny-shakespeare --prompt "ROMEO:"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# The tokenizer: one token per byte, so any UTF-8 text round-trips exactly.
# ---------------------------------------------------------------------------

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 259

# Each message becomes a speaker block as in the play ("ROMEO:\n<lines>\n\n"),
# so a model that has only ever read the play still "understands" a chat.
# String literals rather than raw newlines in the template, because Jinja's
# whitespace control would otherwise eat them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ (message['role'] | upper) + ':\\n' + message['content'] + '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:\\n' }}{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the one ByteLevel uses).

    The `tokenizers` ByteLevel pre-tokenizer rewrites every byte as one of
    these 256 printable characters before the model sees it; the ByteLevel
    decoder maps them back. We build the table ourselves only to give the
    character for byte b the token id b.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)  # unprintable bytes move past Latin-1
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_tokenizer(model_max_length: int = 2048):
    """A `PreTrainedTokenizerFast` whose ids 0..255 are the byte values.

    Pipeline: ByteLevel pre-tokenizer (no regex split, no prefix space, so the
    whole text is one "word" of byte characters) -> BPE with an empty merge
    list (so every byte character stays its own token) -> ByteLevel decoder.
    Encoding adds NO BOS: the models were trained on raw byte windows of the
    corpus, never seeing <bos>, so a prompt is just its bytes. <bos>, <eos>
    and <pad> exist (256, 257, 258) for engines that want them; the models
    never emit <eos>, so generation stops on max_tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}  # char -> byte id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)])
    assert tok.get_vocab_size() == VOCAB_SIZE and tok.token_to_id(EOS) == EOS_ID
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        # The default cleanup deletes the space in " ," and " ." on decode,
        # which would break the exact round trip.
        clean_up_tokenization_spaces=False,
        # What engines default their context to (level 0's core.py): the training window for the
        # built-in models, so a server does not advertise positions the model never learned.
        model_max_length=model_max_length,
    )


def save_tokenizer(out: Path, model_max_length: int = 2048) -> None:
    tokenizer = build_tokenizer(model_max_length)
    tokenizer.save_pretrained(out)
    # transformers 5 folds the special tokens into tokenizer_config.json; older
    # readers (and humans) look for this file too.
    stm = out / "special_tokens_map.json"
    if not stm.exists():
        stm.write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
    # transformers 5 writes tokenizer_class "TokenizersBackend" and puts the
    # template in chat_template.jinja; transformers 4 knows neither. Name the
    # class both versions load and keep a copy of the template in the config.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    # The chat template must survive the save, whichever file it went to.
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out)
    assert reloaded.chat_template == CHAT_TEMPLATE


# ---------------------------------------------------------------------------
# Models and their training recipes.
# ---------------------------------------------------------------------------


@dataclass
class Preset:
    # architecture (LlamaConfig fields)
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    tie_word_embeddings: bool
    # recipe
    steps: int
    batch_size: int
    block_size: int  # training window; max_position_embeddings is larger
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    eval_every: int
    distill_alpha: float = 0.0  # weight of KL-to-target when --distill-from
    # a mixture of experts (Mixtral's architecture) when num_experts > 0: each layer's MLP is
    # `num_experts` SwiGLU experts of width intermediate_size, `experts_per_token` per token
    num_experts: int = 0
    experts_per_token: int = 0
    router_aux_loss_coef: float = 0.0  # Switch's load-balancing loss: keeps every expert in use


PRESETS = {
    # ~6 M parameters, 1000 steps x 8192 bytes (~8 epochs of the training
    # split). On a 2-core CPU shared with other work a 6 M model that sees
    # 8 M bytes beats a 10 M one that sees half as many (compute-optimal
    # sizing); a 0.5 M draft on the same recipe already reaches ~1.6.
    # GQA (4 query heads share 2 KV heads) so the engine's GQA path runs on
    # the built-in model. Tied embeddings: the 259-row table is tiny either
    # way, and it exercises the tied-weight loading path.
    "target": Preset(
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        head_dim=64,
        tie_word_embeddings=True,
        steps=1000,
        batch_size=32,
        block_size=256,
        lr=2e-3,
        min_lr=1e-4,
        warmup=100,
        weight_decay=0.1,
        eval_every=200,
    ),
    # ~0.5 M parameters, under 1/8 of the target's matmul FLOPs per token at
    # every context length up to 2048 (see the README for the arithmetic).
    # Untied embeddings, so the other loading path is exercised too.
    "draft": Preset(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=448,
        head_dim=64,
        tie_word_embeddings=False,
        steps=1000,
        batch_size=32,
        block_size=256,
        lr=3e-3,
        min_lr=1e-4,
        warmup=100,
        weight_decay=0.1,
        eval_every=200,
        distill_alpha=0.8,
    ),
    # ~3.2 M parameters, ~1.1 M of them active per token: Mixtral's layout (8 experts, 2 per
    # token) at the target's depth budget. Untied embeddings like Mixtral's. The load-balancing
    # loss keeps all eight experts busy, so the routing picture and expert parallelism have
    # something to show.
    "moe": Preset(
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=160,
        head_dim=48,
        tie_word_embeddings=False,
        steps=800,
        batch_size=32,
        block_size=256,
        lr=2e-3,
        min_lr=1e-4,
        warmup=80,
        weight_decay=0.1,
        eval_every=200,
        num_experts=8,
        experts_per_token=2,
        router_aux_loss_coef=0.02,
    ),
}


def make_config(p: Preset, max_positions: int):
    from transformers import LlamaConfig, MixtralConfig

    if p.num_experts:
        return MixtralConfig(
            vocab_size=VOCAB_SIZE, hidden_size=p.hidden_size, num_hidden_layers=p.num_hidden_layers,
            num_attention_heads=p.num_attention_heads, num_key_value_heads=p.num_key_value_heads,
            intermediate_size=p.intermediate_size, head_dim=p.head_dim, tie_word_embeddings=p.tie_word_embeddings,
            max_position_embeddings=max_positions, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None,
            num_local_experts=p.num_experts, num_experts_per_tok=p.experts_per_token,
            router_aux_loss_coef=p.router_aux_loss_coef, output_router_logits=True,
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        )  # fmt: skip
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        intermediate_size=p.intermediate_size,
        head_dim=p.head_dim,
        tie_word_embeddings=p.tie_word_embeddings,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def matmul_flops_per_token(cfg, context: int) -> dict[str, int]:
    """Multiply-add FLOPs (2 per MAC) one token costs in the forward pass.

    weights: every projection (q, k, v, o, gate, up, down) and the lm_head;
    the embedding lookup is a gather, not a matmul. attention: q.k^T and
    p.v against `context` earlier positions, 2 * 2 * context * (heads *
    head_dim) per layer.
    """
    d, L, f = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    hq = cfg.num_attention_heads * cfg.head_dim
    hkv = cfg.num_key_value_heads * cfg.head_dim
    active = getattr(cfg, "num_experts_per_tok", 1) or 1  # a mixture: only the chosen experts run
    router = getattr(cfg, "num_local_experts", 0) * d
    per_layer = d * hq + 2 * d * hkv + hq * d + 3 * d * f * active + router  # MACs
    weights = 2 * (L * per_layer + d * cfg.vocab_size)
    attention = 2 * 2 * context * hq * L
    return {"weights": weights, "attention": attention, "total": weights + attention}


# ---------------------------------------------------------------------------
# Data: the corpus is its own token stream (byte b is token b).
# ---------------------------------------------------------------------------


def load_corpus(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the corpus as int64 ids; validation = the last 10 % of bytes."""
    data = Path(path).read_bytes()
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # [N]
    n_train = int(0.9 * len(ids))
    return ids[:n_train], ids[n_train:]


def random_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator):
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(block + 1)  # [B, block+1]
    chunk = data[idx]  # [B, block+1]
    return chunk[:, :-1], chunk[:, 1:]  # inputs [B, block], targets [B, block]


def val_windows(val: torch.Tensor, block: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows covering the validation split, in order."""
    n = (len(val) - 1) // block
    if limit is not None:
        n = min(n, limit)
    return val[: n * block + 1]


@torch.no_grad()
def evaluate(model, val: torch.Tensor, block: int, limit: int | None, autocast: bool, batch: int = 32) -> float:
    """Mean next-byte cross-entropy (nats/byte) over non-overlapping windows."""
    model.eval()
    ids = val_windows(val, block, limit)
    n = (len(ids) - 1) // block
    x = ids[:-1].view(n, block)  # [n, block]
    y = ids[1:].view(n, block)  # [n, block]
    total = 0.0
    for i in range(0, n, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x[i : i + batch], use_cache=False).logits  # [b, block, V]
        total += F.cross_entropy(logits.float().flatten(0, 1), y[i : i + batch].flatten(), reduction="sum").item()
    model.train()
    return total / y.numel()


def lr_at(step: int, p: Preset) -> float:
    """Linear warmup, then cosine decay from lr to min_lr (nanoGPT's schedule)."""
    if step < p.warmup:
        return p.lr * (step + 1) / p.warmup
    t = (step - p.warmup) / max(1, p.steps - p.warmup)
    return p.min_lr + 0.5 * (1 + math.cos(math.pi * t)) * (p.lr - p.min_lr)


def load_hf(path: str | Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    # "eager" experts: a loop any dtype runs (transformers' grouped matmul has no float64 kernel)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager")
    model.eval()
    return model


# ---------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------


def train(args) -> None:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from transformers import AutoModelForCausalLM, GenerationConfig

    console = Console()
    p = PRESETS[args.preset]
    for field in ("steps", "batch_size", "lr"):  # small overrides for experiments
        if getattr(args, field) is not None:
            setattr(p, field, getattr(args, field))
    if args.distill_alpha is not None:
        p.distill_alpha = args.distill_alpha
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)

    train_ids, val_ids = load_corpus(args.corpus)
    cfg = make_config(p, args.max_positions)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")  # float32 master weights
    model.train()
    n_params = sum(t.numel() for t in model.parameters())
    teacher = load_hf(args.distill_from) if args.distill_from else None
    if teacher is not None:
        assert teacher.config.vocab_size == VOCAB_SIZE
    flops = matmul_flops_per_token(cfg, p.block_size)
    console.log(
        f"preset={args.preset} params={n_params:,} flops/token@{p.block_size}={flops['total']:,} "
        f"train={len(train_ids):,} val={len(val_ids):,} bytes distill={args.distill_from} "
        f"alpha={p.distill_alpha if teacher else 0} bf16={not args.fp32} threads={args.threads}"
    )
    console.log(json.dumps(asdict(p)))

    # Decay matrices only; norms' gains stay free (nanoGPT's split).
    decay = [t for t in model.parameters() if t.dim() >= 2]
    no_decay = [t for t in model.parameters() if t.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": p.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=p.lr,
        betas=(0.9, 0.99),
    )
    autocast = not args.fp32
    history = []
    t0 = time.time()
    tokens_seen = 0
    ema_loss = None
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  {task.fields[tps]:,.0f} tok/s  val {task.fields[val]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(args.preset, total=p.steps, loss=float("nan"), tps=0.0, val="-")
        for step in range(p.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, p)
            x, y = random_batch(train_ids, p.batch_size, p.block_size, gen)  # [B, T] each
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(input_ids=x, use_cache=False)
                logits = out.logits.float()  # [B, T, V]
                ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss = ce
                if p.num_experts:  # the router's load-balancing loss (transformers computes it with the logits)
                    loss = loss + p.router_aux_loss_coef * out.aux_loss
                if teacher is not None:
                    with torch.no_grad():
                        t_logits = teacher(input_ids=x, use_cache=False).logits.float()  # [B, T, V]
                    # KL(target || draft): pulls the draft's whole distribution,
                    # and so its argmax, toward the target's.
                    kl = F.kl_div(
                        F.log_softmax(logits, -1).flatten(0, 1),
                        F.log_softmax(t_logits, -1).flatten(0, 1),
                        log_target=True,
                        reduction="batchmean",
                    )
                    loss = p.distill_alpha * kl + (1 - p.distill_alpha) * ce
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

            tokens_seen += x.numel()
            ema_loss = ce.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * ce.item()
            tps = tokens_seen / (time.time() - t0)
            last = step == p.steps - 1
            if (step + 1) % p.eval_every == 0 or last:
                # 64 windows x 256 = 16 k bytes: cheap enough to run often.
                v = evaluate(model, val_ids, p.block_size, limit=64, autocast=autocast)
                history.append(
                    {
                        "step": step + 1,
                        "train_ce_ema": round(ema_loss, 4),
                        "val": round(v, 4),
                        "elapsed_s": round(time.time() - t0, 1),
                    }
                )
                progress.console.log(
                    f"step {step + 1}: train ce {ema_loss:.4f}  val {v:.4f}  {tps:,.0f} tok/s  {time.time() - t0:.0f}s"
                )
                progress.update(task, val=f"{v:.3f}")
            progress.update(task, advance=1, loss=ema_loss, tps=tps)
    train_s = time.time() - t0

    # Save in bfloat16 (half the bytes), then measure the checkpoint as saved:
    # the number in the README is for the weights a user loads.
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out)
    save_tokenizer(out, model_max_length=p.block_size)
    saved = load_hf(out, dtype=torch.float32)
    val_full = evaluate(saved, val_ids, p.block_size, limit=None, autocast=False)
    report = {
        "preset": args.preset,
        "params": n_params,
        "flops_per_token": flops,
        "distill_from": args.distill_from,
        "recipe": asdict(p),
        "seed": args.seed,
        "threads": args.threads,
        "bf16_autocast": autocast,
        "train_wall_s": round(train_s, 1),
        "tokens_seen": tokens_seen,
        "val_loss_saved_fp32_full_split": round(val_full, 4),
        "history": history,
    }
    # Kept beside the script, not in the checkpoint directory, so the model
    # folder holds only what a Hugging Face loader expects.
    (out.parent / f"{out.name}.train_log.json").write_text(json.dumps(report, indent=2) + "\n")
    console.log(
        f"saved {out}: val loss (bf16 weights, fp32 eval, whole val split) = {val_full:.4f} nats/byte; "
        f"train {train_s / 60:.1f} min"
    )


# ---------------------------------------------------------------------------
# Draft/target agreement and sampling.
# ---------------------------------------------------------------------------


@torch.no_grad()
def agreement(
    target,
    draft,
    val_ids: torch.Tensor,
    block: int = 256,
    windows: int = 64,
    prompts: int = 16,
    prompt_len: int = 64,
    gen_len: int = 192,
) -> dict[str, float]:
    """Greedy agreement of draft with target, measured two ways.

    teacher_forced: over `windows` non-overlapping validation windows of
    `block` bytes, the fraction of positions where argmax(draft logits) ==
    argmax(target logits), both given the same true prefix.

    on_target_greedy: for `prompts` validation prompts of `prompt_len` bytes
    spaced evenly through the split, the target greedily continues `gen_len`
    bytes; then the fraction of those continuation positions where the draft's
    argmax equals the target's token, given the target's own prefix. This is
    the per-token acceptance rate of greedy speculative decoding.
    """
    ids = val_windows(val_ids, block, windows)
    n = (len(ids) - 1) // block
    x = ids[:-1].view(n, block)  # [n, block]
    same = total = 0
    for i in range(0, n, 16):
        a = target(input_ids=x[i : i + 16]).logits.argmax(-1)  # [b, block]
        b = draft(input_ids=x[i : i + 16]).logits.argmax(-1)
        same += (a == b).sum().item()
        total += a.numel()
    tf = same / total

    stride = (len(val_ids) - prompt_len) // prompts
    starts = torch.arange(prompts) * stride
    seq = val_ids[starts[:, None] + torch.arange(prompt_len)]  # [P, prompt_len]
    out = target.generate(
        seq, attention_mask=torch.ones_like(seq), max_new_tokens=gen_len, do_sample=False, pad_token_id=PAD_ID
    )  # [P, prompt_len + gen_len]
    t_next = out[:, prompt_len:]  # [P, gen_len] the target's greedy tokens
    d_next = draft(input_ids=out[:, :-1]).logits.argmax(-1)[:, prompt_len - 1 :]  # [P, gen_len]
    og = (d_next == t_next).float().mean().item()
    return {
        "teacher_forced": tf,
        "teacher_forced_positions": total,
        "on_target_greedy": og,
        "on_target_greedy_positions": t_next.numel(),
    }


def run_agreement(args) -> None:
    torch.set_num_threads(args.threads)
    _, val_ids = load_corpus(args.corpus)
    result = agreement(load_hf(args.target), load_hf(args.draft), val_ids)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, indent=2))


def run_sample(args) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_hf(args.model)
    prompt = args.prompt.replace("\\n", "\n")  # lets the shell pass a two-character "\n"
    x = torch.tensor([tok.encode(prompt)])
    kw = (
        {"do_sample": False}
        if args.temperature == 0
        else {"do_sample": True, "temperature": args.temperature, "top_k": 0}
    )
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_tokens, pad_token_id=PAD_ID, **kw
    )
    print(tok.decode(out[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a preset on a corpus and save it in HF format")
    t.add_argument("--preset", choices=sorted(PRESETS), required=True)
    t.add_argument("--corpus", required=True, help="a text file (never committed)")
    t.add_argument("--out", required=True)
    t.add_argument("--distill-from", default=None, help="a trained target directory: add KL-to-target to the loss")
    t.add_argument("--distill-alpha", type=float, default=None, help="weight of the KL term (preset default)")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--batch-size", type=int, default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--max-positions", type=int, default=2048)
    t.add_argument("--seed", type=int, default=1337)
    # One thread by default: on a CPU shared with other work, two OpenMP
    # threads wait on each other at every barrier and ran 3x slower than one.
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--fp32", action="store_true", help="disable bf16 autocast")
    a = sub.add_parser("agreement", help="greedy agreement rate of a draft with its target")
    a.add_argument("--target", required=True)
    a.add_argument("--draft", required=True)
    a.add_argument("--corpus", required=True)
    a.add_argument("--threads", type=int, default=os.cpu_count())
    s = sub.add_parser("sample", help="print a continuation of a prompt")
    s.add_argument("--model", required=True)
    s.add_argument("--prompt", default="ROMEO:\\n")
    s.add_argument("--max-tokens", type=int, default=300)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    {"train": train, "agreement": run_agreement, "sample": run_sample}[args.cmd](args)


if __name__ == "__main__":
    main()
