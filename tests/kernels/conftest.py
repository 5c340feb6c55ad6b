"""One pool of sandboxed verifier runs for the kernel tests, shared by both files.

Each ``verify`` starts its own sandboxed process (a fresh torch + triton import, then Triton's interpreter);
that isolation is what the tests check, so it is kept. What is shared: the pool (three runs at a time, the
same for every file, so one file's runs never stack on another's), and a run asked for twice with the same
arguments (the good softmax, which both files verify), which runs once. The tests that use it are one xdist
group (``kernel_verifier``), so under ``make test`` they share one worker and therefore these runs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest


class VerifyRuns:
    """``submit(ref, candidate, arch, precision, **verify_kwargs)``: a Future of ``verify``'s result, run once
    per distinct set of arguments."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool, self._lock, self._runs = pool, threading.Lock(), {}

    def submit(self, ref: Path, candidate: Path, arch: str, precision: str, **kwargs) -> Future:
        from llmkit.kernels.workbench.verify import verify

        key = (str(ref), str(candidate), arch, precision, tuple(sorted(kwargs.items())))
        with self._lock:
            if key not in self._runs:
                self._runs[key] = self._pool.submit(verify, ref, candidate, arch, precision, **kwargs)
            return self._runs[key]

    def __call__(self, *args, **kwargs) -> dict:
        return self.submit(*args, **kwargs).result()


@pytest.fixture(scope="session")
def verify_runs():
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield VerifyRuns(pool)
