"""The Hawkeye generation loop: ask a model for Triton kernels, verify each, feed failures back.

Paper: "Hawkeye: Hardware-Aware Kernel Optimization" (NeurIPS 2026).
A coding model writes fast kernels when grounded in what the architecture offers: the prompt
carries the reference, the architecture's strategy taxonomy and the matching strategy tests (with
their expert kernels) as worked examples; test-time compute is scaled by sampling several
candidates per round (in parallel) over several refinement rounds, each round seeing what went
wrong before (compile error, wrong result, missing strategy, slower than PyTorch).

Works with any OpenAI-compatible endpoint (``llmkit serve`` included). Everything is saved under
``out_dir``: ``candidates/r<round>_c<i>.py`` (each reply's code), ``trajectory.jsonl`` (one line
per candidate: reply, verification, feedback, errors), ``best.py`` (the best candidate that
verified correct with nothing flagged, if any) and ``summary.json``. Candidates are ranked by
trust before speed: clean (correct, verified in the sandbox, nothing flagged), then correct but
verified without the sandbox, then correct but flagged (a suspicious speedup is not trusted and
never counts), then the rest; only a speedup that is trusted orders candidates within a tier.

Deviation from the paper: the paper's agent edits and reruns in a sandbox with a GPU; here each
candidate is one whole file verified by :func:`.verify.verify` (which also runs without a GPU,
under Triton's interpreter, with timing left to machines that have one).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .taxonomy import load_taxonomy, taxonomy_dir
from .verify import verify

SYSTEM = """You are an expert GPU kernel engineer. You write Triton kernels for {arch} ({target}).
Rules: answer with ONE complete Python file in a ```python block. It defines `class ModelNew(nn.Module)` with the
same constructor arguments as the reference `Model`, and at least one `@triton.jit` kernel that does the
computation. `forward` may only allocate outputs, reshape, and launch kernels: no torch math (no torch.matmul,
torch.softmax, F.*, `@`, .sum() ...) outside the kernels, never call or import the reference. Handle any input
shape (mask the edges); do not cache results."""

GEMM_WORDS = ("matmul", "linear", "bmm", "mm(", "conv", "einsum", "@", "attention")


@dataclass
class Candidate:
    round: int
    index: int
    code: str | None
    reply: str | None
    result: dict | None
    error: str | None = None

    @property
    def tier(self) -> int:
        """3 clean (correct, sandboxed, nothing flagged), 2 correct but verified without the sandbox,
        1 correct but flagged (a figure not trusted, e.g. a suspicious speedup), 0 not correct or not verified."""
        r = self.result or {}
        if not r.get("correct"):
            return 0
        flags = set(r.get("flags") or []) | ({"unsandboxed"} if r.get("sandboxed") is False else set())
        if flags - {"unsandboxed"}:
            return 1
        return 2 if flags else 3

    @property
    def score(self) -> tuple:
        """Ranking key: the tier first, so no flagged or unverified candidate outranks a clean one; the speedup
        counts only where it is trusted."""
        r = self.result or {}
        return (self.tier, (r.get("speedup") or 0.0) if self.tier >= 2 else 0.0, len(r.get("strategies") or []),
                -(r.get("max_abs_err") if r.get("max_abs_err") is not None else float("inf")))


def extract_code(reply: str) -> str | None:
    """The Python file in a reply: the last fenced block holding ModelNew (else the last block, else a block
    cut off by the token limit, else the reply itself when it defines ModelNew)."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", reply or "", re.DOTALL)
    for b in reversed(blocks):
        if "ModelNew" in b:
            return b.strip() + "\n"
    if blocks:
        return blocks[-1].strip() + "\n"
    opened = re.search(r"```(?:python|py)?\s*\n(.*)$", reply or "", re.DOTALL)  # cut off before its closing fence
    if opened:
        return opened.group(1).strip() + "\n"
    if reply and "class ModelNew" in reply:
        return reply.strip() + "\n"
    return None


def _examples_for(arch: str, ref_source: str, max_examples: int) -> list[tuple[str, str]]:
    """(name, text) of the strategy tests to show, with the expert kernels they launch."""
    from . import examples

    tax = load_taxonomy(arch)
    gemm = any(w in ref_source for w in GEMM_WORDS)
    preferred = [s for s in tax.strategies if ("mma" in s.name or s.name in ("epilogue_fusion", "tma", "mfma",
                                                                              "wgmma", "software_pipelining"))]
    other = [s for s in tax.strategies if s not in preferred]
    order = (preferred + other) if gemm else (other + preferred)
    root = taxonomy_dir().parent.parent
    out = []
    for s in order[:max_examples]:
        path = root / s.test
        if not path.is_file():
            continue
        text = path.read_text()
        used = sorted(set(re.findall(r"ex\.(\w+)\(", text)))
        srcs = []
        for name in used:
            fn = getattr(examples, name, None)
            if fn is None:
                continue
            srcs.append(inspect.getsource(fn))
            # the kernels a runner launches
            for k in re.findall(r"(\w+_kernel)\[", inspect.getsource(fn)):
                kfn = getattr(examples, k, None)
                if kfn is not None:
                    srcs.append(inspect.getsource(kfn.fn))
        out.append((s.name, text + "\n# --- kernels it launches (llmkit/kernels/workbench/examples.py) ---\n"
                    + "\n".join(dict.fromkeys(srcs))))
    return out


def build_prompt(ref_source: str, arch: str, *, max_examples: int = 2, feedback: list[str] | None = None,
                 previous: str | None = None) -> list[dict]:
    tax = load_taxonomy(arch)
    lines = [f"Reference (KernelBench convention):\n```python\n{ref_source.strip()}\n```", "",
             f"Optimization strategies available on {arch} (from its taxonomy):"]
    for s in tax.strategies:
        lines.append(f"- {s.name} [{', '.join(s.precisions)}]: {s.exploits} Pays when: {s.pays_when}")
    ex = _examples_for(arch, ref_source, max_examples)
    if ex:
        lines += ["", "Worked examples (the expert-written unit tests of some strategies):"]
        for name, text in ex:
            lines.append(f"### {name}\n```python\n{text.strip()}\n```")
    if previous:
        lines += ["", f"Your previous attempt:\n```python\n{previous.strip()}\n```"]
    if feedback:
        lines += ["", "What went wrong so far (fix these):"] + [f"- {f}" for f in feedback]
    lines += ["", "Write ModelNew now."]
    return [{"role": "system", "content": SYSTEM.format(arch=arch, target=tax.target)},
            {"role": "user", "content": "\n".join(lines)}]


def feedback_for(result: dict | None, error: str | None) -> list[str]:
    """Short lines a model can act on: compile error, wrong result, missing strategy, slower."""
    if error:
        return [error]
    if result is None:
        return ["no code found in the reply: answer with one ```python block defining ModelNew"]
    out = list(result.get("reasons") or [])[:6]
    if result.get("correct") and set(result.get("flags") or []) - {"unsandboxed"}:
        out.append(f"flagged ({', '.join(result['flags'])}): not ranked as a verified kernel")
    if result.get("correct") and not result.get("strategies"):
        out.append(f"correct, but no {result.get('arch')} strategy was found in the compiled code")
    if result.get("speedup") is not None and result["speedup"] < 1.0:
        out.append(f"slower than eager PyTorch (speedup {result['speedup']:.2f}x)")
    return out


def _chat(endpoint: str, model: str, messages: list[dict], *, temperature: float, max_tokens: int,
          timeout: float) -> str:
    import httpx

    url = endpoint.rstrip("/")
    if not url.endswith("/chat/completions"):
        url += "/chat/completions"
    r = httpx.post(url, json={"model": model, "messages": messages, "temperature": temperature,
                              "max_tokens": max_tokens}, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"endpoint answered HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]["message"]["content"] or ""


def generate(ref: str | Path, arch: str, endpoint: str, model: str, out_dir: str | Path, *, budget: int = 4,
             candidates: int = 2, parallel: int = 2, precision: str = "bf16", temperature: float = 0.7,
             max_tokens: int = 2048, max_examples: int = 2, verify_timeout: float = 300.0, trials: int = 2,
             request_timeout: float = 600.0, progress: bool = True, unsafe: bool = False) -> dict:
    """Run the loop; returns the summary (also written to ``out_dir/summary.json``).

    ``budget`` candidates in total, ``candidates`` per refinement round (so ``ceil(budget/candidates)``
    rounds), requested and verified ``parallel`` at a time. ``best.py`` is the best candidate that
    verified correct with nothing flagged (:attr:`Candidate.tier` >= 2). Raises
    :class:`llmkit.tools.sandbox.SandboxUnavailable` before asking for anything when the sandbox
    cannot run here, unless ``unsafe``.
    """
    from tqdm import tqdm

    from llmkit.tools import sandbox

    if not unsafe:
        sandbox.require(what="model-written kernels")

    ref = Path(ref)
    ref_source = ref.read_text()
    out = Path(out_dir)
    (out / "candidates").mkdir(parents=True, exist_ok=True)
    traj = out / "trajectory.jsonl"
    traj.write_text("")
    lock = threading.Lock()
    done: list[Candidate] = []
    feedback: list[str] = []
    previous = None
    bar = tqdm(total=budget, desc=f"kernels generate ({arch})", disable=not progress)

    def one(rnd: int, idx: int, messages: list[dict]) -> Candidate:
        try:
            reply = _chat(endpoint, model, messages, temperature=temperature, max_tokens=max_tokens,
                          timeout=request_timeout)
        except Exception as e:  # noqa: BLE001 - a failing endpoint is recorded, the loop goes on
            return Candidate(rnd, idx, None, None, None, f"request failed: {type(e).__name__}: {e}")
        code = extract_code(reply)
        if code is None:
            return Candidate(rnd, idx, None, reply, None, "no code found in the reply (expected a ```python "
                                                            "block defining ModelNew)")
        path = out / "candidates" / f"r{rnd}_c{idx}.py"
        path.write_text(code)
        try:
            res = verify(ref, path, arch, precision, trials=trials, timeout=verify_timeout, unsafe=unsafe)
        except Exception as e:  # noqa: BLE001
            return Candidate(rnd, idx, code, reply, None, f"verification failed: {type(e).__name__}: {e}")
        return Candidate(rnd, idx, code, reply, res)

    rnd = 0
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        while len(done) < budget:
            n = min(candidates, budget - len(done))
            messages = build_prompt(ref_source, arch, max_examples=max_examples, feedback=feedback[-8:] or None,
                                    previous=previous)
            futures = [pool.submit(one, rnd, i, messages) for i in range(n)]
            round_cands = []
            for f in futures:
                c = f.result()
                round_cands.append(c)
                fb = feedback_for(c.result, c.error)
                with lock:
                    done.append(c)
                    with traj.open("a") as fh:
                        fh.write(json.dumps({"round": c.round, "index": c.index, "error": c.error,
                                             "reply": c.reply, "code_path": f"candidates/r{c.round}_c{c.index}.py"
                                             if c.code else None, "verification": c.result,
                                             "feedback": fb}) + "\n")
                bar.update(1)
                bar.set_postfix(correct=sum(bool(d.result and d.result.get("correct")) for d in done))
            # refine from the best of this round; its problems become the next prompt's feedback
            best_round = max(round_cands, key=lambda c: c.score)
            previous = best_round.code or previous
            feedback = []
            for c in round_cands:
                feedback += [f"(round {c.round}, candidate {c.index}) {x}" for x in feedback_for(c.result, c.error)]
            rnd += 1
    bar.close()
    best = max(done, key=lambda c: c.score) if done else None
    ok = best is not None and best.tier >= 2
    if ok:
        (out / "best.py").write_text(best.code)
    summary = {
        "reference": str(ref), "arch": arch, "model": model, "endpoint": endpoint, "budget": budget,
        "candidates_per_round": candidates, "rounds": rnd, "n_candidates": len(done),
        "n_correct": sum(bool(c.result and c.result.get("correct")) for c in done),
        "n_errors": sum(c.error is not None for c in done),
        "n_flagged": sum(c.tier == 1 for c in done),
        "best": None if not ok else {"round": best.round, "index": best.index, "path": "best.py",
                                     "verification": best.result},
        "errors": sorted({(c.error or "")[:200] for c in done if c.error}),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------ a scripted endpoint


@contextlib.contextmanager
def scripted_endpoint(replies: list[str]):
    """A local OpenAI-compatible chat endpoint answering with ``replies`` in turn (the last repeats).

    For tests and the benchmark: the loop is exercised end to end without a model. Yields the base
    URL; the requests it received are in ``url.requests``.
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"i": 0, "requests": []}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with lock:
                state["requests"].append(body)
                text = replies[min(state["i"], len(replies) - 1)]
                state["i"] += 1
            payload = json.dumps({"id": "scripted", "object": "chat.completion", "model": body.get("model", ""),
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()

    class _URL(str):
        requests = state["requests"]

    try:
        yield _URL(f"http://127.0.0.1:{server.server_address[1]}/v1")
    finally:
        server.shutdown()
        server.server_close()
