"""The KV transfer's wire format: one request's blocks over a TCP connection, each with a checksum.

What it is: the few functions both sides of the TCP connector (tcp.py) speak, so the format
reads in one place. The consumer (the decode instance) connects to the producer (the prefill
instance) and asks for one transfer; the producer answers with the blocks' tokens, then each
block's bytes:

    consumer                                               producer
      hello  {"transfer_id": "...", "layout": {...}}\\n  ──>
                                                      <──  {"error": "..."}\\n            (refused), or
                                                      <──  {"num_blocks": n, "block_bytes": B,
                                                            "tokens": [the blocks' token ids]}\\n
                                                      <──  n x ( !II header: nbytes, crc32 | payload )

A block's payload is its K for every layer, then its V ([L, block_size, Hkv, D] each, the
cache's dtype, raw bytes). The layout ({model, block_size, num_layers, num_kv_heads, head_dim,
dtype}) is checked at the hello: two instances that disagree on any of it are refused with a
line naming both values. The tokens let the consumer check that the producer computed this
prompt (a transfer id used twice, a different tokenizer); the CRC-32 of each block catches a
payload damaged on the way (TCP's own 16-bit checksum misses some errors, and a bug in either
side's framing would otherwise load garbage silently).

What it is not: fast (a GPU engine moves KV with RDMA or NCCL into the consumer's memory, as
vLLM's NixlConnector and P2pNcclConnector do, without a host copy), or encrypted.
"""

from __future__ import annotations

import json
import struct
import zlib

import torch

HEADER = struct.Struct("!II")  # payload bytes, CRC-32 of the payload


class TransferError(Exception):
    """A transfer that did not arrive whole: `reason` is one of the counters' outcomes."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def send_json(sock, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def recv_json(stream) -> dict:
    """One JSON line from a socket's file (`sock.makefile("rb")`)."""
    line = stream.readline(1 << 24)
    if not line.endswith(b"\n"):
        raise TransferError("cut", "the connection closed before a whole message arrived")
    return json.loads(line)


def block_payload(k: torch.Tensor, v: torch.Tensor) -> bytes:
    """One block's K and V, [L, bs, Hkv, D] each, as raw bytes (K first)."""
    return k.contiguous().view(torch.uint8).numpy().tobytes() + v.contiguous().view(torch.uint8).numpy().tobytes()


def send_block(sock, payload: bytes, on_the_way=lambda wire: wire) -> None:
    """The header and the payload; `on_the_way` may change the bytes after the checksum is taken (tests)."""
    sock.sendall(on_the_way(HEADER.pack(len(payload), zlib.crc32(payload)) + payload))


def recv_block(stream, block_bytes: int, dtype: torch.dtype, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """One block from the stream, checked -> (k, v), each `shape` in `dtype`, or TransferError."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise TransferError("cut", "the connection closed in the middle of the blocks")
    nbytes, crc = HEADER.unpack(header)
    if nbytes != block_bytes:
        raise TransferError("corrupt", f"a block of {nbytes} bytes where {block_bytes} were expected")
    payload = stream.read(nbytes)
    if len(payload) < nbytes:
        raise TransferError("cut", "the connection closed in the middle of a block")
    if zlib.crc32(payload) != crc:
        raise TransferError("corrupt", "a block's checksum does not match its bytes")
    kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)  # K's elements, then V's
    half = kv.numel() // 2
    return kv[:half].view(shape), kv[half:].view(shape)


def layout_mismatch(mine: dict, theirs: dict, me: str, them: str) -> str | None:
    """None if the layouts agree, else one line naming each differing field's two values."""
    diffs = [f"{key} {theirs.get(key)!r} ({them}) against {mine.get(key)!r} ({me})"
             for key in dict.fromkeys([*theirs, *mine]) if mine.get(key) != theirs.get(key)]  # fmt: skip
    return None if not diffs else "KV layouts differ: " + "; ".join(diffs)


__all__ = ["TransferError", "send_json", "recv_json", "block_payload", "send_block", "recv_block",
           "layout_mismatch", "HEADER"]  # fmt: skip
