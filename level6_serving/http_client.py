"""A bare HTTP/1.1 POST on asyncio's streams, for the two relays of streamed tokens on one machine.

What it is: the data-parallel router's call to a replica (`router.py`) and the serving benchmark's
client (`benchmarks/serving_client.py`): one connection per request (`Connection: close`), http or https;
it yields the status, then the headers (lower-cased names), then the body's pieces as they arrive,
de-chunked (whatever has arrived, at once: a reader that falls behind gets fewer, larger pieces).
It parses only the framing. Both are hot paths, one piece per streamed token, and httpx spends
about ten times the CPU per piece (about 120 us a chunk), CPU that the servers on the same 2-core
machine need; vLLM's benchmark uses aiohttp's C parser for the same reason.

Raises OSError when the server cannot be reached, and asyncio.IncompleteReadError (or OSError)
when it goes away mid-answer.

What it is not: a general client: no keep-alive, redirects, proxies or retries.
"""

from __future__ import annotations

import asyncio
import urllib.parse


async def post(url: str, body: bytes, headers: dict):
    """POST `body` to `url` (scheme://host:port/path); yields the status, the headers, then the body's pieces."""
    u = urllib.parse.urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    reader, writer = await asyncio.open_connection(u.hostname, port, ssl=True if u.scheme == "https" else None)
    try:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"POST {u.path or '/'} HTTP/1.1\r\nHost: {u.netloc}\r\n{head}Content-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)  # fmt: skip
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection without answering")
        yield int(status_line.split()[1])
        got = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            got[k.strip().lower()] = v.strip()
        yield got
        if got.get("transfer-encoding", "").lower() == "chunked":
            buf = b""
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    raise asyncio.IncompleteReadError(buf, None)  # the server went away mid-answer
                buf += data
                pieces, done = [], False
                while (eol := buf.find(b"\r\n")) >= 0:  # each chunk: its size in hex, CRLF, the bytes, CRLF
                    size = int(buf[:eol].split(b";")[0], 16)
                    if size == 0:
                        done = True
                        break
                    if len(buf) < eol + 2 + size + 2:
                        break  # the rest of this chunk has not arrived yet
                    pieces.append(buf[eol + 2 : eol + 2 + size])
                    buf = buf[eol + 2 + size + 2 :]
                if pieces:
                    yield b"".join(pieces)
                if done:
                    return
        elif "content-length" in got:
            yield await reader.readexactly(int(got["content-length"]))
        else:
            while data := await reader.read(1 << 16):
                yield data
    finally:
        writer.close()
