"""The sandbox's attack set: hostile tool code plus a host-side check that nothing leaked.

Each attack plants something on the host (a secret file under the host's /tmp and under ``$HOME``, a secret
environment variable, a process with a secret on its command line, a listener on 127.0.0.1), runs hostile code
through :func:`llmkit.tools.sandbox.run_function`, and then checks from the host: the secret is not in anything
the call returned, no file outside appeared or changed, the listener accepted nothing, no process the code
started is still alive, and the call came back within its timeout plus a margin (on a loaded host,
plus what a call doing nothing takes then: see :func:`_allowed_s`). ``tests/tools/test_sandbox.py``
runs every attack; ``bench/smith.py`` counts escapes (must be 0).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from llmkit.tools.sandbox import Limits, Result, run_function

MARGIN_S = 3.0  # allowed beyond the timeout: sandbox start, kill, namespace teardown (on an idle host)


@dataclass
class Outcome:
    name: str
    contained: bool
    detail: str
    wall_s: float
    result: Result
    allowed_s: float = 0.0  # the wall time the call was held to (see run_attacks)


class _Host:
    """Host-side bait: secrets, a listener, a secret process. Cleaned up by ``close``."""

    def __init__(self):
        self.token = "LLMKIT-SECRET-" + secrets.token_hex(8)
        self.tmp = Path(tempfile.mkdtemp(prefix="llmkit-attack-"))
        self.tmp_secret = self.tmp / "secret.txt"
        self.tmp_secret.write_text(self.token)
        self.home_secret = Path.home() / f".llmkit-attack-{secrets.token_hex(4)}"
        self.home_secret.write_text(self.token)
        self.outside_target = self.tmp / "written_by_sandbox.txt"
        self.env_key = "LLMKIT_ATTACK_SECRET"
        os.environ[self.env_key] = self.token
        self.proc = subprocess.Popen(["sh", "-c", "sleep 600", "sh", self.token], stdout=subprocess.DEVNULL,
                                     env={**os.environ, self.env_key: self.token})
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.received: list[bytes] = []
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.child_marker = f"{time.time_ns() % 10**6}.{secrets.randbelow(10**6)}"

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.server.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.settimeout(0.5)
            try:
                self.received.append(conn.recv(4096))
            except OSError:
                pass
            conn.close()

    def leaked(self, r: Result) -> bool:
        blob = json.dumps(r.to_json(), default=str)
        return self.token in blob

    def close(self):
        self._stop = True
        self._thread.join(timeout=2)
        self.server.close()
        self.proc.kill()
        self.proc.wait()
        os.environ.pop(self.env_key, None)
        self.home_secret.unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(int(d))
    return found


def _attacks(h: _Host) -> list[tuple[str, str, dict, callable]]:
    """(name, code defining f, kwargs, extra host check returning an error string or '')."""
    none = lambda r: ""
    return [
        ("read_host_tmp", """
def f(paths):
    out = []
    for p in paths:
        try:
            out.append(open(p).read())
        except Exception as e:
            out.append(type(e).__name__)
    return out
""", {"paths": [str(h.tmp_secret), str(h.home_secret), "/proc/1/root" + str(h.tmp_secret),
                 "/proc/self/root" + str(h.home_secret)]}, none),
        ("list_host_dirs", """
import os
def f(dirs):
    out = {}
    for d in dirs:
        try:
            out[d] = os.listdir(d)
        except Exception as e:
            out[d] = type(e).__name__
    return out
""", {"dirs": [str(h.tmp), str(Path.home()), "/tmp", "/root", "/home", "/etc", "/work"]},
         lambda r: "saw the secret file's name" if h.tmp_secret.name in json.dumps(r.value)
         and h.tmp.name in json.dumps(r.value) else ""),
        ("read_env", """
import os
def f():
    return dict(os.environ), open('/proc/self/environ', 'rb').read().decode(errors='replace')
""", {}, none),
        ("read_other_proc", """
import os
def f(pid):
    out = []
    for d in os.listdir('/proc'):
        if d.isdigit():
            for what in ('cmdline', 'environ'):
                try:
                    out.append(open(f'/proc/{d}/{what}', 'rb').read().decode(errors='replace'))
                except Exception as e:
                    out.append(type(e).__name__)
    try:
        out.append(open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace'))
    except Exception as e:
        out.append(type(e).__name__)
    return out
""", {"pid": h.proc.pid}, none),
        ("write_outside", """
import os
def f(target, home):
    out = []
    for p in (target, home + '/.llmkit-written', '/tmp/llmkit-written', '/usr/llmkit-written'):
        try:
            with open(p, 'w') as fh:
                fh.write('pwned')
            out.append('wrote ' + p)
        except Exception as e:
            out.append(type(e).__name__)
    return out
""", {"target": str(h.outside_target), "home": str(Path.home())},
         lambda r: "; ".join(f"{p} exists on the host" for p in (
             h.outside_target, Path.home() / ".llmkit-written", Path("/usr/llmkit-written"))
             if p.exists())),
        ("fill_disk", """
import os
def f():
    n = 0
    chunk = b'x' * (1 << 20)
    try:
        with open('big.bin', 'wb') as fh:
            while n < 100000:
                fh.write(chunk); n += 1
    except Exception as e:
        return [n, type(e).__name__]
    return [n, None]
""", {}, none),
        ("socket_localhost", """
import socket
def f(port):
    out = []
    for host in ('127.0.0.1', 'localhost', '10.0.2.2', '8.8.8.8'):
        try:
            s = socket.create_connection((host, port), timeout=1)
            s.sendall(b'LEAK')
            out.append('connected ' + host)
        except Exception as e:
            out.append(type(e).__name__)
    return out
""", {"port": h.port}, lambda r: f"listener accepted {h.accepted} connection(s)" if h.accepted else ""),
        ("fork_bomb", """
import os
def f():
    while True:
        try:
            os.fork()
        except OSError:
            pass
""", {}, none),
        ("memory_bomb", """
def f():
    blocks = []
    while True:
        blocks.append(bytearray(64 << 20))
""", {}, none),
        ("infinite_loop", """
def f():
    while True:
        pass
""", {}, none),
        ("gigabytes_of_output", """
import os, sys
def f():
    chunk = 'y' * (1 << 20)
    for _ in range(2048):
        sys.stdout.write(chunk)
    for _ in range(2048):
        os.write(1, chunk.encode())
    return 'done'
""", {}, lambda r: f"stdout kept {len(r.stdout)} chars" if len(r.stdout) > 200_000 else ""),
        ("child_outlives", f"""
import os, subprocess
def f():
    subprocess.Popen(['sleep', '{h.child_marker}'], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv('/usr/bin/sleep', ['sleep', '{h.child_marker}'])
        os._exit(0)
    return 'spawned'
""", {}, lambda r: _wait_gone(h.child_marker)),
    ]


def _wait_gone(marker: str) -> str:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if not _host_processes_with(marker):
            return ""
        time.sleep(0.05)
    left = _host_processes_with(marker)
    for pid in left:  # clean up what escaped, then report it
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return f"processes still alive after the call: {left}"


_IDLE = "def f():\n    return None\n"


def _allowed_s(wall: float, limits: Limits, unsafe: bool) -> float:
    """The wall time an attack's call may take: its timeout plus :data:`MARGIN_S`, plus, only when it took
    longer than that, what a call that does nothing costs right now (the slower of two).

    Starting and tearing down a sandbox (fork, namespaces, Python's start-up) happens before the attack's code
    is loaded or after it is killed, so the code cannot stretch it; on a loaded host it alone takes seconds.
    Measured only past the idle-host bound, so on an idle host the bound stays tight, and a call the sandbox
    failed to cut short still overruns: a wait on a process nobody killed is not in an idle call's time.
    """
    allowed = limits.timeout + MARGIN_S
    if wall <= allowed:
        return allowed
    idle = []
    for _ in range(2):
        t0 = time.perf_counter()
        run_function(_IDLE, "f", {}, limits, unsafe=unsafe)
        idle.append(time.perf_counter() - t0)
    return allowed + max(idle)


ATTACK_NAMES = ("read_host_tmp", "list_host_dirs", "read_env", "read_other_proc", "write_outside", "fill_disk",
                "socket_localhost", "fork_bomb", "memory_bomb", "infinite_loop", "gigabytes_of_output",
                "child_outlives")


def run_attacks(names: tuple[str, ...] | None = None, limits: Limits | None = None, *,
                unsafe: bool = False) -> list[Outcome]:
    """Run the attack set (or the named attacks); one :class:`Outcome` per attack."""
    limits = limits or Limits(timeout=2.0, memory_mb=256)
    h = _Host()
    out = []
    try:
        for name, code, kwargs, check in _attacks(h):
            if names and name not in names:
                continue
            before = set(os.listdir(tempfile.gettempdir()))
            t0 = time.perf_counter()
            r = run_function(code, "f", kwargs, limits, unsafe=unsafe)
            wall = time.perf_counter() - t0
            problems = []
            if h.leaked(r):
                problems.append("the secret came back in the result")
            allowed = _allowed_s(wall, limits, unsafe)
            if wall > allowed:
                problems.append(f"took {wall:.1f}s (timeout {limits.timeout}s, allowed {allowed:.1f}s)")
            extra = check(r)
            if extra:
                problems.append(extra)
            if h.tmp_secret.read_text() != h.token or h.home_secret.read_text() != h.token:
                problems.append("a host secret file was changed")
            new = {p for p in set(os.listdir(tempfile.gettempdir())) - before
                   if p.startswith("llmkit-written")}
            if new:
                problems.append(f"new files in the host's /tmp: {sorted(new)}")
            out.append(Outcome(name, not problems, "; ".join(problems) or "contained", wall, r, allowed))
    finally:
        h.close()
    return out
