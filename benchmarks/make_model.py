"""`python -m benchmarks.make_model OUT_DIR`: a random-weight ~100M-parameter Llama for the roofline run.

What it is: a Llama with GQA (hidden 768, 12 layers, 12 query / 4 KV heads, FFN 3072,
about 104M matmul parameters) and the project's byte-level tokenizer (vocab 259), saved
with `save_pretrained` so the engines load it through the real loading path. The
built-in ~6M model is too small to keep a CPU's matmul units busy (each decode step is
mostly Python and memory traffic); this one shows how close each level gets to the
machine's FLOP/s limit at large batch:

    python -m benchmarks.make_model /tmp/llama-100m
    python -m benchmarks.throughput --model /tmp/llama-100m --workload uniform --threads 1

What it is not: a trained model. Its text is noise; only its shapes matter here.

Reference: the Llama 2 architecture (Touvron et al. 2023), sized like GPT-2 small.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def build(
    out: Path,
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    kv_heads: int = 4,
    ffn: int = 3072,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ladder.models import train_tiny_module

    tiny = train_tiny_module()
    cfg = LlamaConfig(
        vocab_size=tiny.VOCAB_SIZE, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=tiny.BOS_ID, eos_token_id=tiny.EOS_ID, pad_token_id=tiny.PAD_ID,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tiny.save_tokenizer(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--max-positions", type=int, default=2048)
    a = p.parse_args(argv)
    path = build(a.out, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.max_positions)
    from .roofline import Dims

    print(f"wrote {path} ({Dims.from_checkpoint(str(path)).params / 1e6:.1f}M matmul parameters)")


if __name__ == "__main__":
    main()
