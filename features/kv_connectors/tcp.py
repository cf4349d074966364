"""The TCP connector: disaggregated prefill and decode, a request's KV carried from one engine to another.

What it is: `TCPConnector`, behind `kv_transfer_config={"kv_connector": "TCPConnector",
"kv_role": ...}`. Two engines, each with its own device pool, share the work of one request:

    proxy ── prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": true, "transfer_id": t} ──>
             prefill instance (kv_producer): computes the prompt; when the request finishes, its
             full blocks are copied to host memory (its outbox) and it answers with
    proxy <── kv_transfer_params={"do_remote_prefill": true, "remote_host", "remote_port", "transfer_id": t}
    proxy ── the same request, those kv_transfer_params ──> decode instance (kv_consumer):
             its scheduler sees a request whose KV is elsewhere and leaves it WAITING FOR KV
             (admitting others meanwhile) while a thread fetches the blocks over TCP (wire.py:
             checked layout, tokens, a CRC per block); then it is admitted like a prefix hit:
             fresh blocks, the fetched KV loaded into them before the step, and only the prompt's
             last tokens (past the last full block) computed before it decodes

Each side counts what it moved (`stats()`, Prometheus `ladder:kv_transfer_*`). A fetch that
fails (the producer unreachable or too slow, a checksum that does not match, a refused layout,
an unknown transfer) costs nothing but time: the consumer computes the prompt itself, and the
outcome is counted. The producer keeps an unfetched transfer at most `ttl_s` seconds, and
`kv_buffer_size` bytes in all (the oldest dropped first); a fetched one is gone.

The producer copies a finished request's blocks in `request_finished`, from its cache, before
they are freed (one process: the scheduler side reaches the worker's cache directly). vLLM's
connectors instead save layer by layer from the forward (`save_kv_layer`) or keep the blocks
allocated until the consumer has read them (`request_finished` returns delay_free_blocks), and
read straight from GPU memory (NIXL, NCCL); here every byte goes through host memory and a socket.

A fetch that has ended counts as arrived only once `get_finished` has said so, which level 3's
engine asks once per step before it schedules (vLLM's worker reports finished receives the same
way): within a step, a request is waiting for its KV or not, whatever the thread does meanwhile.

What it is not: tensor-parallel on either side (level 5 refuses a kv_transfer_config over ranks),
asynchronous in the consumer's worker (the fetched blocks are copied in at the start of the
admission's step, like a tier's), or a proxy (level6_serving/disagg.py).

Reference: vLLM `kv_connector/v1/nixl_connector.py` (kv_transfer_params, do_remote_prefill /
do_remote_decode, WAITING_FOR_REMOTE_KVS) and `p2p/p2p_nccl_connector.py`; DistServe (Zhong et al.,
OSDI 2024) and Splitwise (Patel et al., ISCA 2024) for the idea.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
import weakref
from collections import Counter as Tally
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ladder.metrics import Counter, Gauge

from .base import KVConnectorBase, block_bytes, read_block
from .config import KVTransferConfig
from .wire import (
    TransferError,
    block_payload,
    layout_mismatch,
    recv_block,
    recv_json,
    send_block,
    send_json,  # fmt: skip
)

log = logging.getLogger("ladder.kv_transfer")

OUTCOMES = ("received", "unreachable", "timeout", "cut", "corrupt", "refused", "missing")


def transfer_params(req) -> dict:
    """The request's kv_transfer_params (vLLM keeps them in SamplingParams.extra_args), or {}."""
    return (req.params.extra_args or {}).get("kv_transfer_params") or {}


# --- the producer's side: an outbox, served over TCP ----------------------------------------------


@dataclass
class Parcel:
    """One finished request's full prompt blocks, waiting for its consumer."""

    tokens: list[int]
    payloads: list[bytes]  # one per block: wire.block_payload
    created: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.payloads))


class Outbox:
    """transfer id -> Parcel, bounded in bytes and in age; thread-safe (the server's threads take)."""

    def __init__(self, max_bytes: int, ttl_s: float):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.parcels: OrderedDict[str, Parcel] = OrderedDict()  # oldest first
        self.lock = threading.Lock()
        self.dropped = 0  # parcels let go unfetched (too old, or room for newer ones)

    def put(self, transfer_id: str, parcel: Parcel) -> bool:
        with self.lock:
            self._expire()
            self.parcels.pop(transfer_id, None)
            if parcel.nbytes > self.max_bytes:
                self.dropped += 1
                return False
            while sum(p.nbytes for p in self.parcels.values()) + parcel.nbytes > self.max_bytes:
                self.parcels.popitem(last=False)
                self.dropped += 1
            self.parcels[transfer_id] = parcel
            return True

    def take(self, transfer_id: str) -> Parcel | None:
        with self.lock:
            self._expire()
            return self.parcels.pop(transfer_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        while self.parcels and now - next(iter(self.parcels.values())).created > self.ttl_s:
            self.parcels.popitem(last=False)
            self.dropped += 1

    def __len__(self) -> int:
        with self.lock:
            self._expire()
            return len(self.parcels)


class _Serve(socketserver.BaseRequestHandler):
    """One consumer's connection: its hello, then the parcel or a one-line refusal."""

    def handle(self) -> None:
        server: ProducerServer = self.server  # type: ignore[assignment]
        self.request.settimeout(server.timeout_s)
        try:
            hello = recv_json(self.request.makefile("rb"))
            wrong = layout_mismatch(hello.get("layout", {}), server.layout, "this consumer",
                                    f"producer {server.address}")  # fmt: skip
            if wrong:
                send_json(self.request, {"error": wrong})
                return
            parcel = server.outbox.take(str(hello.get("transfer_id")))
            if parcel is None:
                send_json(self.request, {"error": f"no transfer {hello.get('transfer_id')!r} at producer "
                                                  f"{server.address} (never made, fetched already, or expired)"})  # fmt: skip
                return
            send_json(self.request, {"num_blocks": len(parcel.payloads), "tokens": parcel.tokens,
                                     "block_bytes": server.block_bytes})  # fmt: skip
            for payload in parcel.payloads:
                send_block(self.request, payload, server.on_the_way)
            with server.outbox.lock:  # (several consumers' threads count at once)
                server.tally["sent"] += 1
                server.tally["bytes_sent"] += parcel.nbytes
        except (OSError, TransferError, ValueError) as e:
            log.warning("a KV transfer to %s failed: %s", self.client_address, e)


class ProducerServer(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a consumer that hangs never keeps the process alive
    allow_reuse_address = True

    def __init__(self, host: str, port: int, outbox: Outbox, layout: dict, block_bytes: int, timeout_s: float):
        super().__init__((host, port), _Serve)
        self.outbox, self.layout, self.block_bytes, self.timeout_s = outbox, layout, block_bytes, timeout_s
        self.address = f"{host}:{self.server_address[1]}"
        self.tally: Tally = Tally()
        self.on_the_way = lambda wire: wire  # what happens to a block's bytes on the wire (tests damage or delay them)


# --- the consumer's side: one fetch per request, on a thread -------------------------------------


class Fetch:
    """One request's blocks, being fetched on a thread: then `blocks` ([(k, v)], each [L, bs, Hkv, D])
    or `outcome` says why not."""

    def __init__(self, req, params: dict, layout: dict, shape: tuple, dtype, block_bytes: int, timeout_s: float):
        self.req = req  # (read by the engine's thread only)
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.tokens: list[int] = []
        self.outcome, self.seconds, self.nbytes, self.error = "", 0.0, 0, ""
        self.usable: int | None = None  # blocks of it this prompt can load, once it has arrived and been checked
        self.address = f"{params.get('remote_host')}:{params.get('remote_port')}"
        args = (params, layout, shape, dtype, block_bytes, timeout_s)
        self.thread = threading.Thread(target=self._run, args=args, daemon=True, name="kv-fetch")
        self.thread.start()

    def _run(self, params, layout, shape, dtype, block_bytes, timeout_s) -> None:
        t0 = time.perf_counter()
        try:
            with socket.create_connection((params["remote_host"], int(params["remote_port"])), timeout_s) as sock:
                stream = sock.makefile("rb")
                send_json(sock, {"transfer_id": params.get("transfer_id"), "layout": layout})
                head = recv_json(stream)
                if "error" in head:
                    raise TransferError("missing" if head["error"].startswith("no transfer") else "refused",
                                        head["error"])  # fmt: skip
                if head["block_bytes"] != block_bytes:
                    raise TransferError("refused", f"blocks of {head['block_bytes']} bytes (producer {self.address}) "
                                                   f"against {block_bytes} (this consumer)")  # fmt: skip
                blocks = [recv_block(stream, block_bytes, dtype, shape) for _ in range(head["num_blocks"])]
            self.blocks, self.tokens, self.nbytes = blocks, list(head["tokens"]), len(blocks) * block_bytes
            self.outcome = "received"
        except TransferError as e:
            self.outcome, self.error = e.reason, str(e)
        except socket.timeout as e:
            self.outcome, self.error = "timeout", f"no answer within {timeout_s} s ({e})"
        except (ConnectionResetError, BrokenPipeError) as e:  # it was there, and went away mid-transfer
            self.outcome, self.error = "cut", f"{type(e).__name__}: {e}"
        except OSError as e:
            self.outcome, self.error = "unreachable", f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - malformed params or answer: never a dead thread counted as received
            self.outcome, self.error = "refused", f"{type(e).__name__}: {e}"
        if self.outcome != "received":
            log.warning("KV transfer from producer %s failed (%s): %s; the prompt is computed here",
                        self.address, self.outcome, self.error)  # fmt: skip
        self.seconds = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()


# --- the connector ---------------------------------------------------------------------------------


class TCPConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, block_size: int, hash_fn, model: str = ""):
        extra = config.kv_connector_extra_config
        self.config, self.block_size, self.model = config, block_size, model
        self.role = config.kv_role
        self.timeout_s, self.ttl_s = float(extra.get("timeout_s", 10.0)), float(extra.get("ttl_s", 60.0))
        self.fetches: dict[int, Fetch] = {}  # consumer: seq_id -> its fetch, until its KV is loaded
        self.fetched: set[int] = set()  # consumer: seq_ids that have had their one fetch
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # consumer: (k, v, block id) to load
        self._meta = None
        self.tally: Tally = Tally()  # consumer: one per outcome, bytes_received, receive_seconds, tokens_loaded
        self.server: ProducerServer | None = None

    # --- set-up -------------------------------------------------------------------------------
    def register_kv_caches(self, cache) -> None:
        """The worker's paged cache: its layout is what both sides must agree on; a producer starts
        serving its outbox."""
        self.cache = cache
        _, bs, hkv, d = cache.k[0].shape
        self.shape, self.dtype = (len(cache.k), bs, hkv, d), cache.k[0].dtype
        self.block_bytes = block_bytes(cache)
        self.layout = {"model": self.model, "block_size": bs, "num_layers": len(cache.k), "num_kv_heads": hkv,
                       "head_dim": d, "dtype": str(self.dtype).removeprefix("torch.")}  # fmt: skip
        if self.role == "kv_producer":
            self.outbox = Outbox(self.config.kv_buffer_size, self.ttl_s)
            self.server = ProducerServer(self.config.kv_ip, self.config.kv_port, self.outbox, self.layout,
                                         self.block_bytes, self.timeout_s)  # fmt: skip
            self.thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True,
                                           name="kv-producer")  # fmt: skip
            self.thread.start()
            self._finalizer = weakref.finalize(self, _stop, self.server)
            log.info("KV producer serving blocks on %s", self.server.address)

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) a producer serves on, or None."""
        return None if self.server is None else (self.config.kv_ip, self.server.server_address[1])

    def response_params(self, params: dict, request_id: str) -> dict | None:
        """What a producer's answer to a request that asked `do_remote_decode` carries for its consumer."""
        if self.server is None or not params.get("do_remote_decode"):
            return None
        host, port = self.address
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": host, "remote_port": port,
                "transfer_id": str(params.get("transfer_id", request_id))}  # fmt: skip

    # --- scheduler side: the consumer ---------------------------------------------------------
    def is_receiving(self, req) -> bool:
        """True while the request's KV is on its way (the scheduler leaves it waiting, admits
        others); the first call starts its fetch. vLLM: WAITING_FOR_REMOTE_KVS."""
        if self.role != "kv_consumer" or req.index > 0 or not transfer_params(req).get("do_remote_prefill"):
            return False  # (samples 1.. of n fork from sample 0's blocks, or compute: one fetch per request)
        fetch = self.fetches.get(req.seq_id)
        if fetch is None:
            if req.seq_id in self.fetched:
                return False  # one fetch per request: a preempted one computes what it lost
            self.fetched.add(req.seq_id)
            self.fetches[req.seq_id] = Fetch(req, transfer_params(req), self.layout, self.shape, self.dtype,
                                             self.block_bytes, self.timeout_s)  # fmt: skip
            return True
        return fetch.usable is None  # (set by get_finished, at a step boundary)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Once per step, before scheduling: the fetches whose threads ended since the last call are
        checked (the tokens are this prompt's), counted, and from now on arrived -> (set(), their
        request ids). Between two calls nothing changes, whatever the threads do."""
        done = set()
        for fetch in self.fetches.values():
            if fetch.usable is not None or not fetch.done:
                continue
            req, bs = fetch.req, self.block_size
            fetch.usable = min(len(fetch.blocks), (req.num_tokens - 1) // bs)
            if fetch.outcome == "received" and fetch.tokens[: fetch.usable * bs] != req.token_slice(0, fetch.usable * bs):
                fetch.outcome, fetch.usable = "refused", 0
                log.warning("KV transfer from producer %s holds another prompt's tokens; computed here", fetch.address)
            self.tally[fetch.outcome] += 1
            self.tally["bytes_received"] += fetch.nbytes
            self.tally["receive_seconds"] += fetch.seconds
            done.add(req.request_id)
        return set(), done

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        """The fetched blocks past the device pool's hit (whole blocks; the prompt's last token is
        computed here: it gives the first token's logits)."""
        fetch = self.fetches.get(req.seq_id)
        if fetch is None or fetch.usable is None or fetch.outcome != "received":
            return 0
        return max(0, fetch.usable - num_computed_tokens // self.block_size) * self.block_size

    def update_state_after_alloc(self, req, blocks: list, num_external_tokens: int) -> None:
        """The admission stuck: its fresh `blocks` receive the fetched blocks after the pool's hit."""
        if not num_external_tokens:
            return  # (a failed admission keeps its fetch for the next try)
        fetch = self.fetches.pop(req.seq_id)
        first = fetch.usable - num_external_tokens // self.block_size  # the pool's hit covers the ones before
        for (k, v), block in zip(fetch.blocks[first: fetch.usable], blocks):
            self.pending.append((k, v, block.block_id))
        self.tally["tokens_loaded"] += num_external_tokens

    def build_connector_meta(self, sched) -> list:
        meta, self.pending = self.pending, []
        return meta

    def request_finished(self, req, block_ids: list[int]) -> None:
        """A consumer forgets its fetch; a producer keeps a prefilled request's full prompt blocks
        for its consumer (those whose tokens a consumer can load: all but the block holding the
        prompt's last token), copied from the cache before the blocks are freed."""
        self.fetches.pop(req.seq_id, None)
        if not req.is_finished:
            return  # preempted: it comes back (and a consumer's one fetch is spent)
        self.fetched.discard(req.seq_id)
        params = transfer_params(req)
        if self.role != "kv_producer" or not params.get("do_remote_decode") or not req.output_token_ids:
            return  # (no token sampled: an abort before the prompt was computed)
        n = min((len(req.prompt_token_ids) - 1) // self.block_size, len(block_ids))
        payloads = [block_payload(*read_block(self.cache, b)) for b in block_ids[:n]]
        tokens = list(req.prompt_token_ids[: n * self.block_size])
        self.outbox.put(str(params.get("transfer_id", req.request_id)), Parcel(tokens, payloads))

    # --- worker side: the consumer's loads ------------------------------------------------------
    @torch.inference_mode()
    def start_load_kv(self, cache) -> None:
        for k, v, b in self._meta or []:  # k, v: [L, bs, Hkv, D], one block of every layer
            for layer in range(len(cache.k)):
                cache.k[layer][b].copy_(k[layer])
                cache.v[layer][b].copy_(v[layer])

    # --- what the engine reports ----------------------------------------------------------------
    def stats(self) -> dict:
        if self.server is not None:
            t = self.server.tally
            return {"role": self.role, "address": self.server.address, "transfers_sent": t["sent"],
                    "bytes_sent": t["bytes_sent"], "parcels_waiting": len(self.outbox),
                    "parcels_dropped": self.outbox.dropped}  # fmt: skip
        t = self.tally
        return {"role": self.role, **{f"transfers_{o}": t[o] for o in OUTCOMES}, "bytes_received": t["bytes_received"],
                "receive_seconds": t["receive_seconds"], "tokens_loaded": t["tokens_loaded"]}  # fmt: skip

    def metrics(self) -> list:
        if self.server is not None:
            t = self.server.tally
            return [Counter("ladder:kv_transfer", {"role": "producer", "outcome": "sent"}, value=t["sent"]),
                    Counter("ladder:kv_transfer_bytes", {"direction": "sent"}, value=t["bytes_sent"]),
                    Gauge("ladder:kv_transfer_parcels_waiting", value=len(self.outbox))]  # fmt: skip
        t = self.tally
        return [Counter("ladder:kv_transfer", {"role": "consumer", "outcome": o}, value=t[o]) for o in OUTCOMES] + [
            Counter("ladder:kv_transfer_bytes", {"direction": "received"}, value=t["bytes_received"]),
            Counter("ladder:kv_transfer_seconds", value=t["receive_seconds"])]  # fmt: skip

    def reset(self) -> None:
        """`reset_prefix_cache`: nothing of a prefix cache lives here."""

    def close(self) -> None:
        """Stop serving (a producer); the port is free once this returns."""
        if self.server is not None:
            self._finalizer()


def _stop(server: ProducerServer) -> None:
    server.shutdown()
    server.server_close()


__all__ = ["TCPConnector", "Outbox", "Parcel", "ProducerServer", "Fetch", "transfer_params", "OUTCOMES"]
