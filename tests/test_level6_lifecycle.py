"""The level-6 server's lifecycle as a user meets it in a terminal: `python -m level6_serving` in a process.

What it is:
  - a second Ctrl-C while a non-streaming answer is still being generated: that request gets a 503
    in OpenAI's error shape ("the server is shutting down"), not uvicorn's plain-text 500, and the
    process exits 130 at once, with no `nanobind: leaked ...` lines from Triton at exit
    (api_server.freeze_startup_heap unfreezes at exit; a clean SIGTERM exit is checked on a replica
    in test_level6_dp.py);
  - a port already in use: one line that names the port and the flag, exit status 2, no traceback.

What it is not: the drain itself (test_level6.py) or the data-parallel router's replicas dying
(test_level6_dp.py).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from level6_helpers import ENGINE, LONG_CONTEXT, NAME, wait_for

from ladder.models import REPO
from level6_serving.process import ServerProcess

pytestmark = pytest.mark.level6


def engine_flags(ckpt, max_model_len: int = ENGINE["max_model_len"]) -> list[str]:
    return ["--model", str(ckpt), "--served-model-name", NAME, "--dtype", ENGINE["dtype"], "--max-model-len",
            str(max_model_len), "--kv-cache-memory", str(ENGINE["kv_cache_memory"]), "--seed", "0"]  # fmt: skip


def test_a_second_ctrl_c_answers_a_waiting_request_with_a_json_503(long_ckpt):
    """The answer (8,000 tokens of long_ckpt, about 8 s here, longer on a busy machine) is still being
    generated when the two signals come, a fraction of a second apart: the request cannot end first."""
    with ServerProcess(engine_flags(long_ckpt, LONG_CONTEXT)) as s:
        body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": LONG_CONTEXT - 192, "ignore_eos": True}
        got = {}
        asker = threading.Thread(target=lambda: got.update(r=httpx.post(s.url + "/v1/completions", json=body,
                                                                         timeout=120)))  # fmt: skip
        asker.start()
        wait_for(lambda: "num_requests_running" in (m := httpx.get(s.url + "/metrics").text)
                 and 'vllm:num_requests_running{model_name="tiny"} 1.0' in m, 30, "the request running")  # fmt: skip
        s.signal(signal.SIGINT)
        wait_for(lambda: "draining:" in s.tail(), 30, "the first Ctrl-C starting the drain")
        s.signal(signal.SIGINT)  # the second: quit now
        asker.join(60)
        code = s.proc.wait(timeout=60)
        log = s.tail(20_000)
        assert code == 130, log[-3000:]
    r = got["r"]
    assert r.status_code == 503, (r.status_code, r.text)
    err = r.json()["error"]
    assert "shutting down" in err["message"] and err["type"] == "server_error", err
    assert "nanobind" not in log, log[-3000:]


def test_a_port_in_use_is_one_line_that_names_it(ckpt):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "level6_serving", *engine_flags(ckpt), "--port", str(port)],
                             cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert f"port {port}" in last and "in use" in last and "--port" in last, run.stderr[-3000:]
