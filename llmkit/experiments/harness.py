"""What every long experiment needs, once: ``llmkit serve`` as a subprocess, a resumable result store that
several processes can fill, a peak-memory probe and a learning-rate sweep.

``ServeProcess`` starts the server exactly as a user does (``python -m llmkit.cli serve ...``), so what it
measures covers argument parsing, engine construction and the HTTP layer; its log goes to a file whose
tail is quoted when it dies or never becomes healthy.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``with ServeProcess(["--engine", "vllm", "--model", m]) as srv: srv.url ...``

    ``command(port) -> argv`` runs another OpenAI server (vLLM's own, say) under the same life cycle."""

    def __init__(self, args: list[str], timeout: float = 600.0, env: dict | None = None,
                 cwd: str | Path | None = None, log_level: str = "warning",
                 command: Callable[[int], list[str]] | None = None):
        self.args, self.timeout, self.cwd, self.log_level = list(args), timeout, cwd, log_level
        self.command = command
        self.env = dict(os.environ, **(env or {}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.log = None

    @property
    def name(self) -> str:
        return "the server" if self.command else "llmkit serve"

    def log_tail(self, n: int = 6) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            lines = [x.rstrip() for x in f.read().splitlines() if x.strip()]
        return " | ".join(lines[-n:])

    def __enter__(self) -> ServeProcess:  # noqa: PYI034 - not subclassed
        import httpx

        self._launch()
        deadline = time.monotonic() + self.timeout
        retries = 3
        while True:
            if self.proc.poll() is not None:
                # another process took the port between free_port() and our bind: try a new port
                if retries and "in use" in self.log_tail(20).lower():
                    retries -= 1
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    self._launch()
                    continue
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                # a server of someone else's on the same port would answer /health in our place
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and self._listens():
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} was not healthy after {self.timeout:g} s: {self.log_tail()}")
            time.sleep(0.5)

    def _launch(self) -> None:
        # one log per attempt: an earlier attempt's "in use" must not make a later, unrelated exit look like one
        if self.log is not None:
            self.log.close()
            os.unlink(self.log.name)
        # (no context manager: the log lives as long as the server)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llmkit-serve-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = self.command(self.port) if self.command else [
            sys.executable, "-m", "llmkit.cli", "serve", "--port", str(self.port), "--log-level", self.log_level,
            *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                     start_new_session=True)

    def _listens(self) -> bool:
        """Whether our process, or one of its children, is the one listening on the port."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for p in procs:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                       for c in p.net_connections("tcp")):
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return False

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


# ----------------------------------------------------------------------------- resumable results


@contextmanager
def locked(path: Path):
    """An exclusive ``fcntl`` lock on ``<path>.lock`` for the body (several processes fill one store)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_json(path: Path, body) -> None:
    """Atomic: a reader never sees half a file, a run killed mid-write leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1, default=float) + "\n")
    os.replace(tmp, path)


class ResultStore:
    """A directory of JSON parts, each saved with the configuration that produced it.

    ``store.memo(name, make)`` returns the saved part when its configuration matches (a rerun of the
    same command continues where the last one stopped) and otherwise runs ``make()`` and saves it.
    ``fresh=True`` ignores what is saved. ``merge()`` gives every matching part by name.
    """

    def __init__(self, root: str | Path, config: dict, fresh: bool = False):
        self.root, self.config, self.fresh = Path(root), config, fresh

    def path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def load(self, name: str, config: dict | None = None):
        f = self.path(name)
        if self.fresh or not f.is_file():
            return None
        try:
            part = json.loads(f.read_text())
        except json.JSONDecodeError:
            return None
        return part.get("value") if part.get("config") == (self.config if config is None else config) else None

    def save(self, name: str, value, config: dict | None = None):
        with locked(self.path(name)):
            write_json(self.path(name), {"config": self.config if config is None else config, "value": value})
        return value

    def memo(self, name: str, make: Callable[[], object], config: dict | None = None):
        value = self.load(name, config)
        if value is None:
            value = self.save(name, make(), config)
        return value

    def merge(self) -> dict:
        out = {}
        for f in sorted(self.root.glob("*.json")):
            value = self.load(f.stem)
            if value is not None:
                out[f.stem] = value
        return out


class KeyedCache:
    """Values per (arm, item) in one JSON file, keyed by the configuration: resumable, only new items are
    made, and several processes (shards) can fill one file (merged under an exclusive lock every
    ``chunk`` items, so a run cut short keeps what it made)."""

    def __init__(self, path: str | Path | None, key: dict, chunk: int = 48):
        self.path, self.key, self.chunk = (Path(path) if path else None), key, chunk
        self.data: dict[str, dict[str, object]] = self._read()

    def _read(self) -> dict:
        if self.path and self.path.is_file() and self.path.stat().st_size:
            stored = json.loads(self.path.read_text())
            if stored.get("key") == self.key and stored.get("version") == 2:
                return stored.get("arms", {})
        return {}

    def _save(self) -> None:
        with locked(self.path):
            for arm, values in self._read().items():  # what other processes stored meanwhile
                for h, v in values.items():
                    self.data.setdefault(arm, {}).setdefault(h, v)
            write_json(self.path, {"key": self.key, "version": 2, "arms": self.data})

    @staticmethod
    def _hash(item: str) -> str:
        return hashlib.sha256(item.encode()).hexdigest()

    def count_missing(self, arm: str, items: list[str]) -> int:
        store = self.data.get(arm, {})
        return sum(1 for h in {self._hash(p) for p in items} if h not in store)

    def get(self, arm: str, items: list[str], make: Callable[[list[str]], Iterable]) -> list:
        """Values for ``items``; ``make(missing_items)`` produces those not stored yet (shortest first)."""
        store = self.data.setdefault(arm, {})
        hs = [self._hash(p) for p in items]
        missing = sorted({h: p for h, p in zip(hs, items) if h not in store}.items(), key=lambda hp: len(hp[1]))
        if len(missing) < len(items):
            print(f"# {arm}: {len(items) - len(missing)} of {len(items)} read from {self.path}", flush=True)
        step = self.chunk if self.path else max(1, len(missing))
        for start in range(0, len(missing), step):
            part = missing[start : start + step]
            for (h, _), v in zip(part, make([p for _, p in part])):
                store[h] = v
            if self.path:
                self._save()
                print(f"# {arm}: {min(start + step, len(missing))} of {len(missing)} new values stored", flush=True)
        return [store[h] for h in hs]


# ----------------------------------------------------------------------------- memory and sweeps


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc), so the next peak starts from a floor."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def peak_memory_during(fn: Callable[[], object], interval: float = 0.002) -> dict:
    """Run ``fn()``; return ``{peak, base, result}`` in bytes (CUDA: max allocated; CPU: RSS sampled every
    ``interval`` seconds in a thread)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return {"peak": torch.cuda.max_memory_allocated(), "base": base, "result": result}
    trim()
    base = _rss()
    peak = [base]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(interval)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        stop.set()
        t.join()
    peak[0] = max(peak[0], _rss())
    return {"peak": peak[0], "base": base, "result": result}


def lr_sweep(score: Callable[[float], float], lrs: Iterable[float]) -> dict:
    """Score every lr (lower is better; NaN/inf = diverged). ``{best_lr, scores, at_edge}``: ``at_edge`` says
    the best lr is the smallest or largest tried, i.e. the sweep may not bracket the optimum."""
    lrs = sorted(float(x) for x in lrs)
    if not lrs:
        raise ValueError("lr_sweep needs at least one learning rate")
    scores = {lr: float(score(lr)) for lr in lrs}
    finite = {lr: s for lr, s in scores.items() if math.isfinite(s)}
    if not finite:
        raise ValueError(f"every learning rate diverged: {scores}")
    best = min(finite, key=finite.get)
    return {"best_lr": best, "scores": scores, "at_edge": len(lrs) > 1 and best in (lrs[0], lrs[-1])}


# ----------------------------------------------------------------------------- presets


def preset_parser(description: str, full: dict, quick: dict, quick_help: str, choices: dict | None = None):
    """A bench's parser: ``--quick`` (the quick preset) and a ``--<key>`` flag per preset setting, typed by the
    full preset's value, default None (= the preset's)."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for k, v in full.items():
        parser.add_argument(f"--{k}", type=type(v), help=f"override the preset (full: {v}, quick: {quick[k]})",
                            **({"choices": choices[k]} if choices and k in choices else {}))
    return parser


def resolve_preset(full: dict, quick: dict, use_quick: bool, overrides) -> dict:
    """The preset with every override that is not None; ``overrides`` is a dict or an argparse namespace."""
    if not isinstance(overrides, dict):
        overrides = {k: getattr(overrides, k, None) for k in full}
    cfg = dict(quick if use_quick else full)
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: {', '.join(cfg)}")
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg
