"""``llmkit serve`` as a subprocess, for the doctor's serving check and ``bench/gpu.py``.

The server is started exactly as a user starts it (``python -m llmkit.cli serve ...``), so the check
covers argument parsing, engine construction and the HTTP layer; its log goes to a file whose tail
is quoted when it dies or never becomes healthy.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``with ServeProcess(["--engine", "vllm", "--model", m]) as srv: srv.url ...``"""

    def __init__(self, args: list[str], timeout: float = 600.0, env: dict | None = None):
        self.args, self.timeout = list(args), timeout
        self.env = dict(os.environ, **(env or {}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.log = None

    def log_tail(self, n: int = 6) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            lines = [x.rstrip() for x in f.read().splitlines() if x.strip()]
        return " | ".join(lines[-n:])

    def __enter__(self) -> ServeProcess:  # noqa: PYI034 - not subclassed
        import httpx

        self.log = tempfile.NamedTemporaryFile("w+", prefix="llmkit-doctor-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "llmkit.cli", "serve", "--port", str(self.port), "--log-level", "warning",
               *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmkit serve exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llmkit serve was not healthy after {self.timeout:g} s: {self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:  # engine worker processes share the session: kill them all
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.log is not None:
            self.log.close()
            if exc[0] is None:
                os.unlink(self.log.name)
