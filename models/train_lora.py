"""Train the built-in LoRA adapters: the tiny Shakespeare model fine-tuned three ways, as PEFT checkpoints.

What this is: one script that takes the built-in target (`models/tiny-shakespeare/`, made by
train_tiny.py), picks a part of the corpus, and trains a rank-8 LoRA adapter on it with PEFT
(`LoraConfig`, `get_peft_model`), the base weights frozen; then saves it with `save_pretrained`
(`adapter_config.json`, `adapter_model.safetensors`, bfloat16), the format vLLM, PEFT and this
engine's `LoRARequest` read. The parts, each a fine-tune a reader can see in one greedy line:

    verona      every speech of Romeo and Juliet's speakers: the next speaker is ROMEO, the NURSE, ...
    richard     every speech of Richard III's court: GLOUCESTER, QUEEN ELIZABETH, BUCKINGHAM, ...
    capitals    the whole corpus in capital letters: the same plays, shouted

The adapters in `models/tiny-shakespeare-loras/` were made by it; `models/README.md` has the
command and the held-out losses it printed (each adapter against the base model on its own part).

What this is not: a general fine-tuning tool (one CPU process, random windows, AdamW at a
constant rate after a warmup, no evaluation beyond one held-out loss), or the engine's LoRA
(features/lora/ serves these; this only makes them).

References: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021); PEFT's
`LoraConfig` and `PeftModel.save_pretrained`; train_tiny.py's recipe (its windows and loss).

Usage:
    python models/train_lora.py --corpus ../shared/corpus/tinyshakespeare.txt --part verona \
        --out models/tiny-shakespeare-loras/verona
    python models/train_lora.py --corpus ../shared/corpus/tinyshakespeare.txt --part verona \
        --out models/tiny-shakespeare-loras/verona --behaviour      # what each adapter does to greedy text
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from train_tiny import load_hf, random_batch  # this script's folder: run as `python models/train_lora.py`

BASE = Path(__file__).resolve().parent / "tiny-shakespeare"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# The corpus has no play titles: a play is its speakers (the ones who speak in no other play; Richard III's
# court counts GLOUCESTER, who speaks in Henry VI too).
VERONA = {"ROMEO", "JULIET", "NURSE", "MERCUTIO", "BENVOLIO", "TYBALT", "CAPULET", "LADY CAPULET", "FRIAR LAURENCE",
          "MONTAGUE", "LADY MONTAGUE", "PARIS", "PRINCE", "SAMPSON", "GREGORY", "PETER", "BALTHASAR", "FRIAR JOHN"}
RICHARD = {"KING RICHARD III", "GLOUCESTER", "QUEEN ELIZABETH", "BUCKINGHAM", "CLARENCE", "HASTINGS", "QUEEN MARGARET",
           "DUCHESS OF YORK", "STANLEY", "DERBY", "RICHMOND", "CATESBY", "RATCLIFF", "LADY ANNE", "BRAKENBURY", "TYRREL",
           "RIVERS", "DORSET", "GREY"}  # fmt: skip


def speeches(text: str, speakers: set[str]) -> str:
    """Every speech block ("NAME:\\n<lines>\\n\\n") of the given speakers, joined in order."""
    blocks = re.split(r"\n\n+", text)
    return "".join(b + "\n\n" for b in blocks if b.split(":\n", 1)[0] in speakers)


PARTS = {
    "verona": lambda text: speeches(text, VERONA),
    "richard": lambda text: speeches(text, RICHARD),
    "capitals": str.upper,
}


def part_ids(corpus: str, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's text as byte ids, split 90/10 into training and held-out bytes. Its own last 10 %
    is held out: the adapter never sees those bytes (the base model may have: a play's speeches lie
    wherever the play does; the capitals' held-out bytes are the corpus's own held-out 10 %, unseen by both)."""
    text = PARTS[part](Path(corpus).read_bytes().decode("utf-8"))
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)  # [N]
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:]


@torch.no_grad()
def held_out_loss(model, val: torch.Tensor, block: int) -> float:
    """Mean next-byte cross-entropy (nats/byte) over the held-out bytes' first (up to 64) whole windows."""
    n = min((len(val) - 1) // block, 64)
    x, y = val[: n * block].view(n, block), val[1 : n * block + 1].view(n, block)  # [n, block] each
    logits = model(input_ids=x, use_cache=False).logits  # [n, block, V]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def train(args) -> dict:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train_ids, val_ids = part_ids(args.corpus, args.part)
    base = load_hf(args.base)
    before = held_out_loss(base, val_ids, args.block)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0,
                        task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base, config)  # the base frozen; lora_A random, lora_B zero: it starts as the base
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20)  # a short warmup, then constant
        x, y = random_batch(train_ids, args.batch_size, args.block, gen)  # [B, block] each
        logits = model(input_ids=x, use_cache=False).logits  # [B, block, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    after = held_out_loss(model, val_ids, args.block)
    for p in trainable:  # stored as the base model is, bfloat16
        p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(args.out)
    Path(args.out, "README.md").unlink(missing_ok=True)  # PEFT's blank model card
    conf_file = Path(args.out) / "adapter_config.json"  # the base by its folder name, not this machine's path
    conf = json.loads(conf_file.read_text())
    conf["base_model_name_or_path"] = "tiny-shakespeare"
    conf_file.write_text(json.dumps(conf, indent=2) + "\n")
    log = {"part": args.part, "rank": args.rank, "lora_alpha": 2 * args.rank, "targets": TARGETS,
           "steps": args.steps, "batch_size": args.batch_size, "block": args.block, "lr": args.lr, "seed": args.seed,
           "train_bytes": len(train_ids), "held_out_bytes": len(val_ids),
           "held_out_loss_base": round(before, 4), "held_out_loss_adapter": round(after, 4),
           "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    Path(args.out, "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log))
    return log


HEADING = re.compile(r"^([A-Z][A-Za-z ]+):$", re.M)


@torch.no_grad()
def behaviour(args) -> dict:
    """What each adapter does to greedy text, measured: 16 prompts (speeches from the corpus's held-out
    10 %, each followed by a blank line, so the next speaker is the model's), 200 bytes each from the base
    model and from every adapter in `--out`'s parent folder; per model, the share of the speaker headings it
    writes that belong to Romeo and Juliet and to Richard III's court, and the share of its letters that are
    capitals."""
    from peft import PeftModel

    torch.set_num_threads(args.threads)
    text = Path(args.corpus).read_bytes().decode("utf-8")
    blocks = [b for b in re.split(r"\n\n+", text[int(0.9 * len(text)):]) if HEADING.match(b.split("\n", 1)[0])]
    prompts = [b + "\n\n" for b in blocks[1 : 1 + 16 * 8 : 8]]  # every 8th whole speech (the first may be cut)
    folder = Path(args.out).parent
    models = {"base model": None} | {d.name: d for d in sorted(folder.iterdir()) if (d / "adapter_config.json").is_file()}
    rows = {}
    for name, adapter in models.items():
        model = load_hf(args.base)
        model = model if adapter is None else PeftModel.from_pretrained(model, str(adapter)).eval()
        heads, letters, capitals = [], 0, 0
        for prompt in prompts:
            ids = torch.tensor([list(prompt.encode("utf-8"))])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200, do_sample=False,
                                 pad_token_id=258)[0, ids.shape[1]:]  # fmt: skip
            said = bytes(t for t in out.tolist() if t < 256).decode("utf-8", errors="replace")
            heads += HEADING.findall(said)
            letters += sum(c.isalpha() for c in said)
            capitals += sum(c.isupper() for c in said)
        rows[name] = {"headings": len(heads), "verona": round(sum(h in VERONA for h in heads) / max(1, len(heads)), 2),
                      "richard": round(sum(h in RICHARD for h in heads) / max(1, len(heads)), 2),
                      "capitals": round(capitals / max(1, letters), 2)}  # fmt: skip
        print(name, json.dumps(rows[name]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True, help="a text file (never committed)")
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default=str(BASE))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--behaviour", action="store_true",
                    help="train nothing: measure the base model and every adapter beside --out (speakers, capitals)")
    args = ap.parse_args()
    behaviour(args) if args.behaviour else train(args)


if __name__ == "__main__":
    main()
