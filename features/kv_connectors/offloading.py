"""The offloading connector: a tiered prefix cache, so a prefix outlives the device pool.

What it is: `OffloadingConnector`, the KV connector (base.py) behind
`kv_transfer_config={"kv_connector": "OffloadingConnector", ...}`. Level 3's prefix cache keeps
a freed block's KV in the device pool until the pool needs the block; then it is gone, and the
next request with that prefix computes it again. With this connector the pool's victims go to
host memory first (and the host tier's victims to disk), and a request whose prefix misses the
device pool looks the rest of its chain up in the tiers and has those blocks copied back into
fresh device blocks before its step runs, instead of computing them:

    admission of a request with blocks h1 h2 h3 h4 | last token
      device pool:   h1 -> b7  (a hit)   h2: evicted earlier
      host tier:     h2, h3 (hits)       h4: not there       -> 1 + 2 blocks computed elsewhere
      the step:      save the blocks the pool evicted while scheduling it (device -> host),
                     then load h2, h3 into the request's fresh blocks b4, b9 (host -> device),
                     then run the forward on the tokens from h4 on

A block is saved when it is evicted (its content is still in the device pool while the step is
scheduled: the save runs first in the step, before anything writes), not as it fills: on a CPU,
where nothing overlaps, that moves each block at most once, and only the blocks the pool lets go.
vLLM's OffloadingConnector saves blocks as they fill instead, asynchronously, which a GPU overlaps
with compute. Entries found or being saved are pinned until their step has moved them (tiers.py).

What it is not: asynchronous (every copy happens inside the step, counted in the step's time),
shared between engines (each engine has its own tiers), or covering a draft model's cache (level
4 with a draft model refuses it; n-gram speculation has no cache of its own).

Reference: vLLM `offloading_connector.py` and `vllm/v1/kv_offload/`; LMCache (Liu et al.,
"CacheGen", SIGCOMM 2024, and the LMCache docs) for the tiered idea.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from dataclasses import dataclass, field

import torch

from ladder.metrics import Counter, Gauge
from level3_prefix.block_hash import block_hashes

from .base import KVConnectorBase, block_bytes, read_block
from .config import KVTransferConfig
from .tiers import DiskTier, HostTier, TierEntry


@dataclass
class OffloadMeta:
    """One step's moves: (entry, block id) pairs, saves before loads."""

    saves: list[tuple[TierEntry, int]] = field(default_factory=list)
    loads: list[tuple[TierEntry, int]] = field(default_factory=list)


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, block_size: int, hash_fn):
        extra = config.kv_connector_extra_config
        self.block_size, self.hash_fn = block_size, hash_fn
        self.cpu_bytes, self.disk_path, self.disk_bytes = (extra["cpu_bytes_to_use"], extra.get("disk_path"),
                                                           extra.get("disk_bytes_to_use"))  # fmt: skip
        self.host: HostTier | None = None  # sized by register_kv_caches (a block's bytes are the cache's)
        self.disk: DiskTier | None = None
        self.matched: dict[int, list[tuple[TierEntry, str]]] = {}  # seq_id -> (entry, its tier) of its last lookup
        self.pending = OffloadMeta()  # what the next step must move
        self._meta: OffloadMeta | None = None
        self.tally: Tally = Tally()  # hits_<tier> (tokens), bytes_saved, bytes_loaded, bytes_written, bytes_read,
        # load_seconds, save_seconds, disk_seconds, saves_refused

    # --- set-up -------------------------------------------------------------------------------
    def register_kv_caches(self, cache) -> None:
        """The worker's paged cache (level 1's PagedKVCache): a block's bytes size the tiers."""
        self.num_layers = len(cache.k)
        self.block_bytes = block_bytes(cache)  # K and V, every layer
        capacity = self.cpu_bytes // self.block_bytes
        if capacity < 1:
            raise ValueError(f"kv_transfer_config cpu_bytes_to_use={self.cpu_bytes} holds no block (one block of "
                             f"every layer's K and V is {self.block_bytes} bytes)")  # fmt: skip
        self.host = HostTier(capacity)
        if self.disk_path is not None:
            disk_capacity = self.disk_bytes // self.block_bytes
            if disk_capacity < 1:
                raise ValueError(f"kv_transfer_config disk_bytes_to_use={self.disk_bytes} holds no block "
                                 f"({self.block_bytes} bytes each)")  # fmt: skip
            self.disk = DiskTier(self.disk_path, disk_capacity)

    # --- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        """Walk the request's block names from the device hit's end through host, then disk, to the
        first miss (the last token is always computed, as with a device hit)."""
        self._unmatch(req.seq_id)
        if req.params.prompt_logprobs is not None:  # its prompt's rows need logits: computed, as level 3 does
            return 0
        bs = self.block_size
        start, usable = num_computed_tokens // bs, (req.num_tokens - 1) // bs
        hashes = block_hashes(req, usable, bs, self.hash_fn) if usable > start else []
        found = []
        for i in range(start, usable):
            parent, tokens = hashes[i - 1] if i else None, tuple(req.token_slice(i * bs, bs))
            entry, tier = self.host.get(hashes[i], parent, tokens), "host"
            if entry is None and self.disk is not None and (entry := self._promote(hashes[i], parent, tokens)):
                tier = "disk"
            if entry is None:
                break
            entry.pins += 1  # nothing may push it out before its load is done (tiers.py)
            found.append((entry, tier))
        self.matched[req.seq_id] = found
        return len(found) * bs

    def update_state_after_alloc(self, req, blocks: list, num_external_tokens: int) -> None:
        """The admission stuck: `blocks` (fresh, in the request's order) receive the first
        num_external_tokens // block_size entries of its last lookup, one each, as loads for the
        next step (their pins now held for the load); the lookup's other entries are let go."""
        found = self.matched.pop(req.seq_id, [])
        use = num_external_tokens // self.block_size
        for entry, _ in found[use:]:
            entry.pins -= 1
        for (entry, tier), block in zip(found[:use], blocks):
            self.pending.loads.append((entry, block.block_id))  # its pin now held for the load
            self.tally[f"hits_{tier}"] += self.block_size

    def block_evicted(self, block) -> None:
        """Save a named block the device pool is about to reuse, unless a tier has it already."""
        if block.block_hash in self.host or (self.disk is not None and block.block_hash in self.disk):
            return
        entry = TierEntry(block.block_hash, block.parent_hash, block.tokens, pins=1)
        victims = self.host.put(entry)
        if victims is None:  # every host entry is pinned this step: this block is not kept
            self.tally["saves_refused"] += 1
            return
        self._spill(victims)
        self.pending.saves.append((entry, block.block_id))

    def build_connector_meta(self, sched) -> OffloadMeta:
        meta, self.pending = self.pending, OffloadMeta()
        return meta

    def request_finished(self, req, block_ids: list[int]) -> None:
        self._unmatch(req.seq_id)

    # --- worker side ----------------------------------------------------------------------------
    @torch.inference_mode()
    def start_load_kv(self, cache) -> None:
        """Saves first (the evicted blocks, before this step overwrites them), then loads."""
        meta = self._meta
        if meta is None or not (meta.saves or meta.loads):
            return
        t0 = time.perf_counter()
        for entry, b in meta.saves:  # [L, bs, Hkv, D] each: every layer's copy of block b, in host memory
            entry.k, entry.v = read_block(cache, b)
            entry.pins -= 1
        t1 = time.perf_counter()
        self.load_blocks(cache, meta.loads)
        t2 = time.perf_counter()
        self.tally["bytes_saved"] += len(meta.saves) * self.block_bytes
        self.tally["bytes_loaded"] += len(meta.loads) * self.block_bytes
        self.tally["save_seconds"] += t1 - t0
        self.tally["load_seconds"] += t2 - t1

    def load_blocks(self, cache, loads: list[tuple[TierEntry, int]]) -> None:
        """Each (entry, block id): the entry's K and V of every layer into that block of the cache
        (level 1's PagedKVCache: cache.k[layer] is [num_blocks, bs, Hkv, D]); its load's pin released."""
        for entry, b in loads:
            for layer in range(self.num_layers):  # entry.k[layer]: [bs, Hkv, D], one block of one layer
                cache.k[layer][b].copy_(entry.k[layer])
                cache.v[layer][b].copy_(entry.v[layer])
            entry.pins -= 1

    # --- the tiers --------------------------------------------------------------------------------
    def _promote(self, block_hash: bytes, parent, tokens) -> TierEntry | None:
        """A disk hit, read back into the host tier (the disk keeps its copy), or None."""
        t0 = time.perf_counter()
        entry = self.disk.get(block_hash, parent, tokens)
        if entry is None:
            return None
        victims = self.host.put(entry)
        if victims is None:
            return None  # no room above it this step: a miss
        self._spill(victims)
        self.tally["bytes_read"] += self.block_bytes
        self.tally["disk_seconds"] += time.perf_counter() - t0
        return entry

    def _spill(self, victims: list[TierEntry]) -> None:
        """The host tier's victims go to disk (if there is one), else they are dropped."""
        if self.disk is None:
            return
        t0 = time.perf_counter()
        for entry in victims:
            if entry.block_hash not in self.disk:
                self.disk.put(entry)
                self.tally["bytes_written"] += self.block_bytes
        self.tally["disk_seconds"] += time.perf_counter() - t0

    def _unmatch(self, seq_id: int) -> None:
        for entry, _ in self.matched.pop(seq_id, []):
            entry.pins -= 1

    def reset(self) -> None:
        """Forget every entry no step still needs (`reset_prefix_cache` forgets the tiers too)."""
        for block_hash in [h for h, e in self.host.entries.items() if e.pins == 0]:
            del self.host.entries[block_hash]
        if self.disk is not None:
            self.disk.close()
            self.disk = DiskTier(self.disk_path, self.disk.capacity)

    # --- what the engine reports ----------------------------------------------------------------
    def stats(self) -> dict:
        t = self.tally
        out = {"host_blocks": len(self.host), "host_capacity_blocks": self.host.capacity,
               "hits_host_tokens": t["hits_host"], "bytes_saved": t["bytes_saved"], "bytes_loaded": t["bytes_loaded"],
               "save_seconds": t["save_seconds"], "load_seconds": t["load_seconds"],
               "saves_refused": t["saves_refused"]}  # fmt: skip
        if self.disk is not None:
            out.update(disk_blocks=len(self.disk), disk_capacity_blocks=self.disk.capacity,
                       hits_disk_tokens=t["hits_disk"], bytes_written=t["bytes_written"], bytes_read=t["bytes_read"],
                       disk_seconds=t["disk_seconds"])  # fmt: skip
        return out

    def metrics(self) -> list:
        """Per tier, Prometheus-style (level 6 serves them on /metrics; counters gain `_total`)."""
        t, tiers = self.tally, ["host"] + (["disk"] if self.disk is not None else [])
        held = {"host": len(self.host), "disk": len(self.disk) if self.disk is not None else 0}
        moved = {("host", "save"): t["bytes_saved"], ("host", "load"): t["bytes_loaded"],
                 ("disk", "save"): t["bytes_written"], ("disk", "load"): t["bytes_read"]}  # fmt: skip
        seconds = {"host": t["load_seconds"], "disk": t["disk_seconds"]}
        out = []
        for tier in tiers:
            out.append(Counter("ladder:kv_offload_hits", {"tier": tier}, value=t[f"hits_{tier}"]))
            out += [Counter("ladder:kv_offload_bytes", {"tier": tier, "direction": d}, value=moved[tier, d])
                    for d in ("save", "load")]  # fmt: skip
            out.append(Counter("ladder:kv_offload_seconds", {"tier": tier}, value=seconds[tier]))
            out.append(Gauge("ladder:kv_offload_blocks", {"tier": tier}, value=held[tier]))
        return out

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


__all__ = ["OffloadingConnector", "OffloadMeta"]
