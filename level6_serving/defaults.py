"""The server's default limits, in one place (no imports, so `--help` reads them without loading
a web framework or torch). `__main__.py` makes them flags; `api_server.py` uses them when
the app or server is built in code (the tests, the docs, `ServerThread`)."""

MAX_REQUEST_BODY_BYTES = 8 << 20  # 8 MiB: a prompt of a million words or so; far more than any context here
# Idle seconds before the server closes a kept-alive connection: above common clients' own expiry
# (httpx, and so the openai client: 5 s), so the client always closes first, never under a request.
KEEP_ALIVE_S = 30.0
