"""The tiers below the device pool: host memory, then disk, each bounded, each evicting LRU.

What it is: where the offloading connector (offloading.py) keeps the blocks the device pool
lets go. A tier holds `TierEntry`s, each one full block of every layer's K and V under the
block's name (level 3's chained hash, block_hash.py), its parent's name and its tokens (checked
on every hit, as the device pool checks them: a hash collision never hands out foreign KV):

    device pool (level 3)  --evicts a named block-->  HostTier  --its LRU victim-->  DiskTier
                           <--a prefix hit, loaded--  (bytes)   <--a hit, promoted-- (a folder)

`HostTier` is an OrderedDict, least recently used first, bounded in entries (bytes / a block's
bytes: every entry of one engine has the same size). An entry is *pinned* while a step still
has to fill it (a save) or read it (a load): the tier never drops a pinned entry, and refuses a
new one rather than grow past its bound. `DiskTier` writes one file per entry (`torch.save`) in a
folder of its own and deletes its LRU file past its bound.

What it is not: shared between engines or kept across restarts (the disk folder is this
engine's, removed when the tier is collected or the process exits: a killed process leaves it), or a transport (nothing here knows about requests or steps).

Reference: vLLM `vllm/v1/kv_offload/` (its CPU tier's LRU manager and the tiering spec);
LMCache's local CPU and disk backends.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch


@dataclass(eq=False)
class TierEntry:
    block_hash: bytes
    parent_hash: bytes | None
    tokens: tuple[int, ...]
    k: torch.Tensor | None = None  # [L, bs, Hkv, D]: every layer's keys of the block (None until saved)
    v: torch.Tensor | None = None  # [L, bs, Hkv, D]
    pins: int = 0  # steps' saves and loads still to do with it

    def matches(self, parent: bytes | None, tokens: tuple[int, ...]) -> bool:
        return self.parent_hash == parent and self.tokens == tokens


class HostTier:
    """Entries in host memory, at most `capacity` of them, LRU first (see the module docstring)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> TierEntry | None:
        """The entry with this name and content (now the most recently used), or None."""
        e = self.entries.get(block_hash)
        if e is None or not e.matches(parent, tokens):
            return None
        self.entries.move_to_end(block_hash)
        return e

    def put(self, entry: TierEntry) -> list[TierEntry] | None:
        """Add `entry` (most recently used): the entries it pushed out (LRU, unpinned, saved), or None
        if every entry is pinned and it does not fit (then it is not added)."""
        excess = len(self.entries) + 1 - self.capacity
        evictable = (e for e in self.entries.values() if e.pins == 0 and e.k is not None)  # LRU first
        victims = list(islice(evictable, max(excess, 0)))
        if len(victims) < excess:
            return None  # the tier stays as it was, its order too
        for victim in victims:
            del self.entries[victim.block_hash]
        self.entries[entry.block_hash] = entry
        return victims


class DiskTier:
    """Entries as files in a folder of this tier's own under `root`, at most `capacity` of them."""

    def __init__(self, root: str | Path, capacity: int):
        Path(root).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="ladder-kv-", dir=root))
        self._remove = weakref.finalize(self, shutil.rmtree, self.dir, True)  # when the engine goes, at the latest
        self.capacity = capacity
        self.index: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()  # name -> (parent, tokens)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def path(self, block_hash: bytes) -> Path:
        return self.dir / f"{block_hash.hex()}.pt"

    def put(self, entry: TierEntry) -> None:
        """Write a saved entry (a no-op if it is there already); delete the LRU file past the bound."""
        if entry.block_hash in self.index:
            self.index.move_to_end(entry.block_hash)
            return
        torch.save({"k": entry.k, "v": entry.v}, self.path(entry.block_hash))
        self.index[entry.block_hash] = (entry.parent_hash, entry.tokens)
        while len(self.index) > self.capacity:
            old, _ = self.index.popitem(last=False)
            self.path(old).unlink(missing_ok=True)

    def get(self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> TierEntry | None:
        """The entry read back from its file (a new TierEntry), or None."""
        meta = self.index.get(block_hash)
        if meta is None or meta != (parent, tokens):
            return None
        self.index.move_to_end(block_hash)
        data = torch.load(self.path(block_hash), weights_only=True)
        return TierEntry(block_hash, parent, tokens, data["k"], data["v"])

    def bytes_on_disk(self) -> int:
        return sum(self.path(h).stat().st_size for h in self.index)

    def close(self) -> None:
        self._remove()
        self.index.clear()


__all__ = ["TierEntry", "HostTier", "DiskTier"]
