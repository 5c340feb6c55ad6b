"""What ``bench/kernels.py`` measures, as library functions (tested through the bench and the tests).

- :func:`run_strategy_suite`: runs ``kernels/strategies`` with pytest (a subprocess, JUnit XML) and
  counts, per architecture, the strategies whose tests all pass (correct under the interpreter,
  present in the compiled code, broken twin caught).
- :data:`BAD_CANDIDATES` / :data:`GOOD_CANDIDATES` / :data:`PROJECT_KERNELS`: the verifier's
  fixture sets (``fixtures/``), and :func:`verify_set` to run one in parallel.
- :func:`run_exploits`: the verifier against adversarial candidates (a folder of them, each
  written against ``fixtures/ref_softmax.py``), judged from outside as well: a folder on the
  host's ``/tmp`` that no candidate may write into, a port listening on the host's 127.0.0.1 that
  none may reach, an environment variable and a host file none may read.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parents[3]

# (name, reference, candidate, precision)
BAD_CANDIDATES = [
    ("wrong on a non-example shape", "ref_softmax", "bad_example_shape", "bf16"),
    ("zero output", "ref_softmax", "bad_zero", "bf16"),
    ("cached output", "ref_softmax", "bad_cached", "bf16"),
    ("torch fallback", "ref_softmax", "bad_torch_fallback", "bf16"),
    ("infinite loop", "ref_softmax", "bad_infinite_loop", "bf16"),
]
GOOD_CANDIDATES = [
    ("row softmax", "ref_softmax", "good_softmax", "bf16"),
    ("linear + bias + GELU", "ref_linear_gelu", "good_linear_gelu", "bf16"),
]
PROJECT_KERNELS = [
    ("InQuant quantize+pack", "ref_inquant_quant", "cand_inquant_quant", "fp32"),
    ("InQuant unpack+dequantize", "ref_inquant_dequant", "cand_inquant_dequant", "fp32"),
    ("ZO low-rank Rademacher perturbation", "ref_zo_perturb", "cand_zo_perturb", "fp32"),
]


def verify_set(items, arch: str = "hopper", *, trials: int = 1, timeout: float = 300.0, parallel: int = 3,
               strategies_for=()) -> dict:
    """{name: verify result} for (name, ref, candidate, precision) items, ``parallel`` subprocesses at a time."""
    from .verify import verify

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futs = {name: pool.submit(verify, FIXTURES / f"{ref}.py", FIXTURES / f"{cand}.py", arch, prec,
                                  trials=trials, timeout=timeout, strategies_for=tuple(strategies_for))
                for name, ref, cand, prec in items}
        return {k: f.result() for k, f in futs.items()}


CANARY_ENV = "LLMKIT_EXPLOIT_CANARY"  # stands for an API key in the caller's environment


@contextlib.contextmanager
def _host_listener():
    """A TCP port on the host's 127.0.0.1 that answers ``host`` and records what each connection sent."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    got: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    got.append(conn.recv(64))
                    conn.sendall(b"host")
                except OSError:
                    got.append(b"?")
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], got
    finally:
        stop.set()
        t.join(5)
        srv.close()


def run_exploits(folder, arch: str = "hopper", *, trials: int = 1, timeout: float = 300.0, parallel: int = 3,
                 unsafe: bool = False, verify_fn=None) -> dict:
    """{name: {"rejected", "contained", "handled", "reasons"}} for every ``*.py`` candidate in ``folder``.

    A line ``# __KERNELS__`` in a candidate is replaced by ``folder/_kernels.py`` (its docstring
    dropped), the helper kernels they share; files starting with ``_`` are not candidates. In each candidate ``__HOST_DIR__`` becomes a fresh folder in the host's ``/tmp`` (holding a
    ``marker`` file and a ``secret.txt``) and ``__PORT__`` a port listening on the host's loopback;
    :data:`CANARY_ENV` is set in this process's environment while they run. ``contained``: nothing
    appeared in the host folder and no connection reached the port; ``handled``: rejected and contained.
    """
    if verify_fn is None:
        from .verify import verify

        def verify_fn(ref, cand):
            return verify(ref, cand, arch, "bf16", trials=trials, timeout=timeout, unsafe=unsafe)
    files = sorted(f for f in Path(folder).glob("*.py") if not f.name.startswith("_"))
    if not files:
        raise FileNotFoundError(f"no exploit candidates (*.py) in {folder}")
    shared = Path(folder) / "_kernels.py"  # helpers the candidates share, spliced in at their KERNELS line
    if shared.is_file():
        import ast

        from .verify import parse_source

        text = shared.read_text()
        tree = parse_source(text)
        doc_end = tree.body[0].end_lineno if ast.get_docstring(tree) else 0
        shared_code = "\n".join(text.splitlines()[doc_end:]) + "\n"
    else:
        shared_code = ""
    prev = os.environ.get(CANARY_ENV)
    with tempfile.TemporaryDirectory(prefix="llmkit-exploits-") as tmp, _host_listener() as (port, got):
        host = Path(tmp) / "host"
        host.mkdir()
        (host / "marker").write_text("this folder is on the host")
        (host / "secret.txt").write_text("s3cret")
        cands = Path(tmp) / "candidates"
        cands.mkdir()
        for f in files:
            src = "".join(shared_code if line.startswith("# __KERNELS__") else line
                          for line in f.read_text().splitlines(keepends=True))
            (cands / f.name).write_text(src.replace("__HOST_DIR__", str(host)).replace("__PORT__", str(port)))
        os.environ[CANARY_ENV] = "sk-not-a-real-key"
        try:
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                futs = {f.stem: pool.submit(verify_fn, FIXTURES / "ref_softmax.py", cands / f.name) for f in files}
                results = {k: fut.result() for k, fut in futs.items()}
        finally:
            if prev is None:
                os.environ.pop(CANARY_ENV, None)
            else:
                os.environ[CANARY_ENV] = prev
        written = {p.name for p in host.iterdir()} - {"marker", "secret.txt"}
        reached = list(got)
    sent = [g.decode(errors="replace") for g in reached]
    stray = [w for w in written if not any(w == f"pwned-{n}" for n in results)] + [g for g in sent if g not in results]
    out = {}
    for name, r in results.items():
        escaped = ([f"wrote pwned-{name} into the host's /tmp"] if f"pwned-{name}" in written else []) + (
            ["connected to the host's loopback port"] if name in sent else []) + (
            [f"something escaped that no candidate owns: {stray}"] if stray else [])
        out[name] = {"rejected": not r["correct"], "contained": not escaped, "escaped": escaped,
                     "handled": not r["correct"] and not escaped, "reasons": r["reasons"][:4]}
    return out


def run_strategy_suite(timeout: float = 1800.0) -> dict:
    """Run every strategy test; returns {"per_arch": {arch: {"passed", "total", "failed": [...]}}, "passed", "total"}.

    A strategy counts as passed when all the tests in its file pass.
    """
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
        env.pop("TRITON_INTERPRET", None)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                        f"--junitxml={xml}", str(REPO / "kernels" / "strategies")], check=False, cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
        per_file: dict[str, bool] = {}
        if xml.is_file():
            for case in ET.parse(xml).getroot().iter("testcase"):
                f = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
                ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
                per_file[f] = per_file.get(f, True) and ok
    from .compiled import ARCHS
    from .taxonomy import load_taxonomy

    per_arch = {}
    for arch in ARCHS:
        names = load_taxonomy(arch).names
        passed = [n for n in names if any(k.endswith((f"{arch}/test_{n}.py", f"{arch}.test_{n}", f"{arch}/test_{n}"))
                                          for k, v in per_file.items() if v)]
        per_arch[arch] = {"passed": len(passed), "total": len(names), "failed": sorted(set(names) - set(passed))}
    return {"per_arch": per_arch, "passed": sum(a["passed"] for a in per_arch.values()),
            "total": sum(a["total"] for a in per_arch.values())}
