import json
import math
import multiprocessing as mp
import time

import pytest

from llmkit.experiments import harness


def test_result_store_resumes_only_matching_config(tmp_path):
    calls = []
    store = harness.ResultStore(tmp_path, {"steps": 10})
    assert store.memo("a", lambda: calls.append(1) or {"loss": 1.0}) == {"loss": 1.0}
    assert harness.ResultStore(tmp_path, {"steps": 10}).memo("a", lambda: calls.append(2) or {}) == {"loss": 1.0}
    assert calls == [1]  # the rerun read the saved part
    assert harness.ResultStore(tmp_path, {"steps": 11}).load("a") is None  # another config: not reused
    assert harness.ResultStore(tmp_path, {"steps": 10}, fresh=True).load("a") is None
    (tmp_path / "broken.json").write_text("{half")
    assert harness.ResultStore(tmp_path, {"steps": 10}).merge() == {"a": {"loss": 1.0}}


def _fill(path, arm, items):
    c = harness.KeyedCache(path, {"k": 1}, chunk=1)
    c.get(arm, items, lambda xs: [x.upper() for x in xs])


def test_keyed_cache_merges_processes_and_makes_only_missing(tmp_path):
    path = tmp_path / "cache.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_fill, args=(path, "arm", [f"p{i}" for i in range(j, 12, 3)])) for j in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    made = []
    c = harness.KeyedCache(path, {"k": 1})
    out = c.get("arm", [f"p{i}" for i in range(12)], lambda xs: made.extend(xs) or [x for x in xs])
    assert out == [f"P{i}" for i in range(12)] and made == []  # all three shards' values survived
    assert harness.KeyedCache(path, {"k": 2}).data == {}  # another key starts empty
    assert json.loads(path.read_text())["version"] == 2


def test_lr_sweep_picks_finite_minimum_and_flags_edge():
    out = harness.lr_sweep(lambda lr: {1e-4: 3.0, 1e-3: 2.0, 1e-2: float("nan")}[lr], [1e-2, 1e-4, 1e-3])
    assert out["best_lr"] == 1e-3 and out["at_edge"] is False and math.isnan(out["scores"][1e-2])
    assert harness.lr_sweep(lambda lr: lr, [1.0, 2.0])["at_edge"] is True
    with pytest.raises(ValueError, match="diverged"):
        harness.lr_sweep(lambda lr: float("inf"), [1.0])


def test_peak_memory_sees_a_transient_allocation():
    import numpy as np

    def alloc():
        x = np.ones(64 * 2**20 // 8)  # 64 MiB, touched, then freed
        return float(x.sum())

    out = harness.peak_memory_during(alloc)
    assert out["result"] == 64 * 2**20 // 8
    assert out["peak"] - out["base"] > 48 * 2**20


_FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = sys.argv[2].encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
try:
    srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
except OSError as e:
    print(e, flush=True)  # "[Errno 98] Address already in use"
    sys.exit(1)
srv.serve_forever()
"""


def test_serve_process_is_not_fooled_by_another_server_on_its_port(monkeypatch):
    """Under xdist another test's server can take the port free_port() gave us (seen in a fresh-clone run: lm-eval
    talked to a tiny-model server that then went away). ServeProcess accepts /health only from a socket its own
    process listens on, and moves to a new port when its server could not bind."""
    import subprocess
    import sys

    import httpx

    from llmkit.experiments import harness

    taken = harness.free_port()
    impostor = subprocess.Popen([sys.executable, "-c", _FAKE_SERVER, str(taken), "impostor"])
    try:
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{taken}/health", timeout=1).text == "impostor":
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        ports = iter([taken])
        real_free_port = harness.free_port
        monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or real_free_port())
        with harness.ServeProcess([], timeout=60, command=lambda port: [sys.executable, "-c", _FAKE_SERVER, str(port),
                                                                          "ours"]) as srv:
            assert srv.port != taken
            assert httpx.get(srv.url + "/health", timeout=5).text == "ours"
    finally:
        impostor.terminate()
        impostor.wait(10)


def test_serve_process_retries_a_port_collision_once_and_not_a_later_unrelated_exit(tmp_path):
    """Each attempt has its own log: after one attempt that could not bind, an attempt that fails for another
    reason ends the start with that reason instead of spending the retries left on the old "in use"."""
    import sys

    from llmkit.experiments import harness

    calls = []

    def command(port):
        calls.append(port)
        msg = "[Errno 98] address already in use" if len(calls) == 1 else "model folder is broken"
        return [sys.executable, "-c", f"import sys; print({msg!r}); sys.exit(1)"]

    with pytest.raises(RuntimeError, match="model folder is broken") as err, \
            harness.ServeProcess([], timeout=60, command=command):
        pass
    assert len(calls) == 2 and "in use" not in str(err.value)
