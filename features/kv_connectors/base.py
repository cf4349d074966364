"""The KV connector seam: vLLM V1's `KVConnectorBase_V1`, the two sides of one object.

What it is: the methods an engine calls on a connector, in the order one step calls them. A
connector is how KV cache that lives outside this engine's device pool (in host memory, on
disk, in another engine) gets into a request's blocks, and how blocks get out:

    scheduler side (level 3's KV cache manager calls these while the step is scheduled)
      is_receiving(req)               is the waiting request's KV still arriving? (then it is not
                                      admissible this step; the others are: level 3's scheduler)
      get_num_new_matched_tokens(req, num_computed)  at admission, after the device pool's own
                                      prefix hit of num_computed tokens: how many more of the
                                      request's tokens the connector holds (whole blocks)
      update_state_after_alloc(req, blocks, n)       the admission stuck: `blocks` are the fresh
                                      blocks those n tokens go into; remember to load them
      block_evicted(block)            the pool is about to overwrite a named block (an
                                      offloading connector saves it first; vLLM's saves happen
                                      as blocks fill instead, which a GPU overlaps with compute)
      build_connector_meta(sched)     everything the worker must move this step -> metadata
      request_finished(req, block_ids) a request left: anything to send or keep?
    worker side (level 1's worker calls these around the forward pass)
      bind_connector_metadata(meta)   this step's metadata (in one process: handed over directly;
                                      vLLM ships it inside the SchedulerOutput to each worker)
      start_load_kv(cache)            move what the metadata says, before the forward reads it
      wait_for_layer_load(layer)      block until layer `layer` is in (a synchronous load: no-op)
      save_kv_layer(layer, k, v)      a layer's new K/V is written (a producer sends it on)
      wait_for_save()                 block until everything is out, after the forward
      get_finished()                  requests whose asynchronous sends/receives completed

    one step:  schedule ──(get_num_new_matched_tokens, update_state_after_alloc, block_evicted)──>
               build_connector_meta ──> worker: bind, start_load_kv, forward, wait_for_save

The layer-by-layer pair (`wait_for_layer_load`, `save_kv_layer`) is the seam a connector that
overlaps transfers with compute needs (vLLM calls them from its attention layer); both
connectors here move every layer at once, so nothing calls them: the offloading connector
before the forward, the TCP connector's producer when a request finishes and its consumer on a
thread while the request waits (docs/kv_connectors.md).

What it is not: a transport or a tier (tcp.py and wire.py; offloading.py and tiers.py). A
request may wait for its KV to arrive (`is_receiving`), but once admitted its loads complete
within the step that scheduled it.

Reference: vLLM `vllm/distributed/kv_transfer/kv_connector/v1/base.py` (`KVConnectorBase_V1`).
"""

from __future__ import annotations

import torch


class KVConnectorBase:
    """A connector that holds nothing and moves nothing: every method's contract, and the defaults."""

    # --- scheduler side ---------------------------------------------------------------------
    def is_receiving(self, req) -> bool:
        """The request's KV is still on its way: the scheduler leaves it waiting, admitting others
        (vLLM: get_num_new_matched_tokens answers load_async=True, the request turns
        WAITING_FOR_REMOTE_KVS until the worker's get_finished reports it received)."""
        return False

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        """Tokens past the first `num_computed_tokens` (the device pool's hit, whole blocks) that the
        connector can put into the request's blocks this step; a multiple of the block size."""
        return 0

    def update_state_after_alloc(self, req, blocks: list, num_external_tokens: int) -> None:
        """The admission that asked stuck: `blocks` (level 3's KVBlocks) receive the tokens."""

    def block_evicted(self, block) -> None:
        """The device pool is about to reuse a named block (its content is still there now)."""

    def build_connector_meta(self, sched) -> object:
        """What the worker must do this step (called once per step, after scheduling)."""
        return None

    def request_finished(self, req, block_ids: list[int]) -> None:
        """A request left (finished or aborted); its blocks are freed after this returns."""

    # --- worker side ------------------------------------------------------------------------
    def bind_connector_metadata(self, meta) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, cache) -> None:
        """Move what the bound metadata says between `cache` (level 1's PagedKVCache) and the outside."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer `layer` of this step's loads is in `cache` (see the module docstring: not called yet)."""

    def save_kv_layer(self, layer: int, k, v) -> None:
        """Layer `layer`'s new K/V is in the cache (see the module docstring: not called yet)."""

    def wait_for_save(self) -> None:
        """Everything this step sends is out."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(request ids done sending, request ids done receiving) since the last call."""
        return set(), set()

    # --- what the engine reports ------------------------------------------------------------
    def stats(self) -> dict:
        return {}

    def metrics(self) -> list:
        return []

    def close(self) -> None:
        """Release what the connector holds outside the process's memory (files, sockets)."""


def block_bytes(cache) -> int:
    """Bytes of one block of every layer's K and V in `cache` (level 1's PagedKVCache: cache.k[layer]
    is [num_blocks, bs, Hkv, D])."""
    return 2 * len(cache.k) * cache.k[0][0].numel() * cache.k[0].element_size()


def read_block(cache, b: int) -> tuple:
    """Block b of every layer, copied to host memory -> (k, v), each [L, bs, Hkv, D]: what a connector
    keeps or sends of a block before the pool may overwrite it."""
    return (torch.stack([k[b] for k in cache.k]).to("cpu", copy=True),
            torch.stack([v[b] for v in cache.v]).to("cpu", copy=True))  # fmt: skip


__all__ = ["KVConnectorBase", "block_bytes", "read_block"]
