"""`ServerProcess`: `python -m level6_serving` in a child process, up, used, and gone afterwards.

What it is: what the demo, the tests and `benchmarks.serving` share to run the server as
a user does, in its own process (its own GIL: a benchmark client in the same process
would slow the server down). It picks a free port (`--port 0`, read back from the log),
waits for `/health`, and on exit sends SIGTERM (the server drains) and kills the process
if it has not gone after a timeout. The log goes to `log=PATH` if given (and stays there);
otherwise to a temporary folder of this ServerProcess's own, removed when it stops (its
last lines stay readable through `tail()`, and a server that fails to start puts them in
the error). The server runs in a session of its own, so a kill
(after a drain that did not end) reaches the ranks a parallel engine spawned as well. And it
goes with the process that started it: told that process's id (LADDER_PARENT_PID), the server
watches it (`exit_with_parent`) and stops, draining, once it is gone, even after a SIGKILL
that left no time to stop anything (a data-parallel router killed so leaves no replica).

    with ServerProcess(["--model", "tiny-shakespeare"]) as server:
        httpx.get(server.url + "/health")
    server.returncode  # 0: drained and exited cleanly

What it is not: a supervisor (no restarts) or a way to run servers on other machines.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ladder.models import REPO

PARENT_ENV = "LADDER_PARENT_PID"  # set by ServerProcess for its server: the process it goes with


class ServerProcess:
    def __init__(self, args: list[str], log: Path | None = None, startup_timeout: float = 120.0,
                 cpus: set[int] | None = None):  # fmt: skip
        """`cpus`: the cores the server (all its threads) may run on, or None for any."""
        self.args, self.startup_timeout, self.cpus = list(args), startup_timeout, cpus
        # A scratch log nobody asked for is removed with its folder in stop(); a given path is the caller's.
        self._scratch = None if log else tempfile.TemporaryDirectory(prefix="level6-server-")
        self.log = Path(log) if log else Path(self._scratch.name) / "server.log"
        self._last_tail = ""  # what tail() answers once the scratch log is gone
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.returncode: int | None = None

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "level6_serving", "--port", "0", *self.args]
        # The repository on the path, so the package is found even when it is not installed.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PARENT_ENV: str(os.getpid())}  # fmt: skip
        with open(self.log, "w") as out:  # its own session: a kill reaches the ranks it spawns (level 5) too
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                         start_new_session=True)  # fmt: skip
        if self.cpus is not None:  # at once, while it is still one thread (later threads inherit the mask)
            os.sched_setaffinity(self.proc.pid, self.cpus)
        self.url = self._wait_until_up()
        return self

    def _wait_until_up(self) -> str:
        import httpx

        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self.tail()}")
            m = re.search(r" on (http://[\d.]+:\d+)", self.log.read_text())
            if m:
                try:
                    if httpx.get(m[1] + "/health", timeout=5).status_code == 200:
                        return m[1]
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        self.stop(timeout=5)
        raise RuntimeError(f"the server did not come up in {self.startup_timeout:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else self._last_tail[-chars:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains), then wait; kill it if it is still there after `timeout`."""
        if self.proc is not None:
            self.signal(signal.SIGTERM)
            try:
                self.returncode = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the server and every process it started
                self.proc.wait()
                self.returncode = None
        self._remove_scratch()
        return self.returncode

    def _remove_scratch(self) -> None:
        """Keep the log's tail in memory, then delete the scratch folder (no-op for a given log)."""
        if self._scratch is not None:
            self._last_tail = self.tail(chars=20_000)
            self._scratch.cleanup()
            self._scratch = None

    def __enter__(self) -> ServerProcess:
        try:
            return self.start()
        except BaseException:
            self.stop(timeout=5)
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def exit_with_parent(poll: float = 0.5) -> None:
    """In a server ServerProcess started: SIGTERM to itself once the process that started it has gone
    (it was re-parented): a drain, then exit, or, if that happens while the model still loads, the
    default end. Polling, because Linux's PR_SET_PDEATHSIG fires when the *thread* that started a
    child ends, and a data-parallel router starts its replicas from a pool's threads. No-op for a
    server a person started (no LADDER_PARENT_PID)."""
    parent = int(os.environ.pop(PARENT_ENV, 0))  # popped: what this server starts is told its own id
    if not parent:
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(poll)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
