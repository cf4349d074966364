"""Block hashes: the name of a full block, chained to the names before it. Where they are computed.

What it is: `hash_block(parent, tokens)`, the name of one full block: SHA-256 over its parent's
name, its token ids and any extra keys, so a name stands for the whole prefix up to and
including the block, not for one block's tokens alone:

    request tokens:  [ t0 .. t15 | t16 .. t31 | t32 .. t37 ]      block_size 16
    block names:       h1 = H(-, t0..15)   h2 = H(h1, t16..31)    (partial: no name)

    "ROMEO: But soft" ... and "JULIET: But soft" ...: the same second block's tokens, different
    names, because their first blocks differ; and the same prompt on two LoRA adapters: different
    names from the first block on (its extra key is the adapter: `adapter_key`)

`block_hashes(req, n)` gives a request's first n names, each computed once and kept on the
request (`PrefixRequest.block_hashes`, as vLLM keeps them on its Request): a preempted request
comes back with the same tokens, and so the same names. The prefix cache looks a request's
names up at admission and names its blocks as they fill (prefix_cache.py).

What it is not: the cache (prefix_cache.py, block_pool.py), or Python's `hash()`: a name must be
stable across processes and Python versions, and 256 bits wide, so that two different prefixes
meeting on one name would take about 2**128 blocks (the pool checks the tokens on every hit anyway).

Reference: vLLM `v1/core/kv_cache_utils.py` (`hash_block_tokens`, `BlockHash`) and
`docs/design/prefix_caching.md`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from level2_continuous.request import Request


def hash_block(parent: bytes | None, tokens: tuple[int, ...], extra: tuple = ()) -> bytes:
    """SHA-256 of (parent hash, token ids, extra keys) in a canonical byte encoding.

    Stable across processes and Python versions (unlike `hash()`), and 256 bits wide,
    so two different prefixes meeting on a name would take ~2**128 blocks. The pool
    also keeps each block's tokens and parent and checks them on every hit.
    """
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    for key in extra:
        h.update(repr(key).encode())
    return h.digest()


@dataclass
class PrefixRequest(Request):
    """Level 2's request, with the names of its full blocks (computed once each; kept across a preemption)."""

    block_hashes: list[bytes] = field(default_factory=list)


def adapter_key(req) -> tuple:
    """The first block's extra key: the request's LoRA adapter, if it has one. Its KV was computed
    through the adapter's projections, so it must never serve a request on another adapter (or on
    none); the chain carries the difference to every later block (vLLM adds the LoRA id the same way)."""
    lora = getattr(req, "lora_request", None)
    return () if lora is None else (("lora", lora.lora_int_id),)


def block_hashes(req, num_blocks: int, block_size: int, hash_fn=hash_block) -> list[bytes]:
    """The chained names of `req`'s first `num_blocks` full blocks, memoised on `req.block_hashes`."""
    hashes = req.block_hashes
    while len(hashes) < num_blocks:
        i = len(hashes)
        tokens = tuple(req.token_slice(i * block_size, block_size))
        hashes.append(hash_fn(hashes[-1] if hashes else None, tokens, adapter_key(req) if i == 0 else ()))
    return hashes[:num_blocks]


__all__ = ["hash_block", "block_hashes", "adapter_key", "PrefixRequest"]
