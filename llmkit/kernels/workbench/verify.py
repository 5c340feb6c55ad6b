"""Verify a candidate Triton kernel against a PyTorch reference, KernelBench style, hardened.

Convention (KernelBench): the reference defines ``Model`` (an ``nn.Module``), ``get_inputs()`` and
``get_init_inputs()``; the candidate ``ModelNew`` (same constructor) and at least one ``@triton.jit`` kernel.

Trust split (after KernelBench's revamped eval and gpu-mode's pygpubench, whose exploit suites showed
verifiers fooled from inside the candidate's process): **the verdict is computed here, outside the candidate's
process**. This process loads the reference, draws the inputs (fresh seeds per trial, shapes the candidate
cannot know in advance), runs the reference, compares and writes the result. The candidate runs in a separate
process inside the sandbox SMITH's tools use (:func:`llmkit.tools.sandbox.spawn_python`: bubblewrap, no
network, no host files but the Python packages and llmkit's own source, read-only; cleared environment;
rlimits; the whole group killed at the timeout; on a GPU host its NVIDIA/ROCm device nodes and nothing else).
It receives copies of the inputs in files of its read-only input folder and returns outputs over a pipe
(:mod:`.candidate_runner`); the reference module is never loaded there. Without a working sandbox
:func:`verify` refuses unless ``unsafe=True`` (``--unsafe-no-sandbox``).

What :func:`verify` checks, each a way kernel benchmarks were fooled. Decided here (``checks.outside``):

- **static check** of the candidate's source: no ``torch`` compute calls or ``@`` outside the Triton kernels,
  no use of the reference (``Model``, its file, ``import`` of it), no ``exec``, no ``getattr(torch, <name
  built at run time>)``;
- **several trials on fresh random inputs of several shapes**: the example shape from ``get_inputs()`` and
  variants drawn at random around the module-level integer sizes that ``get_inputs`` reads (so a kernel
  hard-wired to the example shape fails);
- **dtype-aware tolerances**: ``|out - ref| <= atol + rtol * |ref|`` with ``rtol`` a couple of ULPs of the
  precision (looser for FP8/FP4) and ``atol = rtol * mean|ref|`` (sums of many terms cancel); ``max_rel_err``
  is ``max |out - ref| / (|ref| + atol)``; a non-finite output where the reference is finite (NaN fills), zero
  or constant outputs where the reference is not, and an output that does not change when the inputs do
  (cached) are rejected;
- **a timeout** for the whole run (an infinite loop or a crash cannot take the caller down).

Observed inside the candidate's process, so best-effort (``checks.best_effort``): torch-fallback detection (a
dispatch mode and the profiler, both hardened against the known switches; see :mod:`.candidate_runner`), at
least one Triton launch, inputs left unchanged and outputs that do not alias them (a candidate doing either is
rejected), the strategies found in its compiled code (every kernel is compiled for ``--arch`` and matched
against the taxonomy; one that does not compile fails), and the GPU timing: the candidate times itself with
CUDA events, the reference (eager and ``torch.compile``, cast to the inputs' dtype) is timed here, the outputs
after the timed calls are checked, and a speedup > 10x is flagged (``flags``), not trusted. Without a GPU the
kernels run under Triton's interpreter (slow: keep reference shapes small) and ``speedup`` is ``null``; so it
is when timing fails, with the error in ``timing_error``.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import select
import struct
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

PRECISIONS = {
    # precision: (torch dtype the inputs/params are cast to or None, rtol = ~2 ULPs)
    "fp32": (None, 1e-4),
    "tf32": (None, 5e-3),
    "fp16": ("float16", 2e-3),
    "bf16": ("bfloat16", 1.6e-2),
    "fp8": (None, 0.25),  # e4m3: 3 mantissa bits
    "mxfp8": (None, 0.25),
    "fp4": (None, 1.0),  # e2m1: 1 mantissa bit
    "mxfp4": (None, 1.0),
    "nvfp4": (None, 1.0),
    "int8": (None, 1e-2),
}

# torch.* names a candidate may use outside kernels: allocation, dtypes, devices, module plumbing
ALLOWED_TORCH = {
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "full", "full_like", "ones", "ones_like",
    "arange", "tensor", "as_tensor", "device", "dtype", "Size", "Tensor", "nn", "no_grad", "inference_mode",
    "manual_seed", "Generator", "finfo", "iinfo", "cuda", "float32", "float16", "bfloat16", "float8_e4m3fn",
    "float8_e5m2", "int8", "uint8", "int16", "int32", "int64", "bool", "float", "half", "long", "int",
    "float64", "is_tensor",
}
ALLOWED_NN = {"Module", "Parameter", "init", "Linear", "Conv2d", "Embedding", "LayerNorm", "RMSNorm", "ModuleList",
              "functional"}
# tensor methods that compute (a call of one outside a kernel is a torch fallback)
COMPUTE_METHODS = {
    "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "sum", "mean", "softmax", "log_softmax", "exp", "log",
    "relu", "gelu", "silu", "sigmoid", "tanh", "max", "min", "amax", "amin", "argmax", "norm", "var", "std",
    "cumsum", "prod", "sqrt", "rsqrt", "pow", "mul", "add", "sub", "div", "addcmul", "where", "clamp", "abs",
    "conv2d", "linear", "layer_norm", "scaled_dot_product_attention", "topk", "sort",
}
# ATen ops allowed in forward outside Triton launches: allocation, views, metadata, copies for layout
ALLOWED_ATEN = {
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "zero_", "fill_", "full", "full_like", "new_empty",
    "new_zeros", "new_empty_strided", "view", "_unsafe_view", "reshape", "as_strided", "expand", "permute",
    "transpose", "t", "contiguous", "clone", "copy_", "_to_copy", "detach", "alias", "slice", "select",
    "unsqueeze", "squeeze", "flatten", "split", "chunk", "unbind", "lift_fresh", "sym_size", "sym_stride",
    "sym_numel", "is_contiguous", "stride", "size", "numel", "dim", "arange", "ones", "ones_like", "lift_fresh_copy",
    "view_as", "narrow", "_reshape_alias", "unsafe_view",
}


class VerifyInputError(ValueError):
    """The reference or the arguments are unusable (exit code 2 on the command line)."""


# ---------------------------------------------------------------------------- static checks


_PARSE_LOCK = threading.Lock()


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse`` under one lock: CPython 3.11 keeps the AST conversion's recursion check in state shared by
    all threads, so two threads parsing at once (``run_exploits(parallel=...)``, or verify runs in a thread
    pool) can fail with "SystemError: AST constructor recursion depth mismatch"."""
    with _PARSE_LOCK:
        return ast.parse(source, filename=filename)


def check_reference_source(path: Path) -> None:
    try:
        tree = parse_source(path.read_text(), filename=str(path))
    except SyntaxError as e:
        raise VerifyInputError(f"reference {path}: syntax error: {e}") from e
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    missing = [n for n in ("Model", "get_inputs", "get_init_inputs") if n not in names]
    if missing:
        raise VerifyInputError(f"reference {path} must define Model, get_inputs() and get_init_inputs(); "
                               f"missing: {', '.join(missing)}")


def _is_triton_jit(dec) -> bool:
    node = dec.func if isinstance(dec, ast.Call) else dec
    return (isinstance(node, ast.Attribute) and node.attr in ("jit", "autotune", "heuristics")) or (
        isinstance(node, ast.Name) and node.id == "jit")


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def static_check(source: str, ref_path: Path | None = None) -> tuple[list[str], list[str]]:
    """(problems, kernel names) of a candidate's source. Problems make the candidate fail."""
    try:
        tree = parse_source(source)
    except SyntaxError as e:
        return [f"candidate does not parse: {e}"], []
    problems, kernels = [], []
    top = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    if "ModelNew" not in top or not isinstance(top["ModelNew"], ast.ClassDef):
        problems.append("candidate defines no class ModelNew")
    jit_nodes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
            kernels.append(node.name)
            jit_nodes.append(node)
    if not kernels:
        # a kernel may come from a library module (the project's own kernels do): then the dynamic
        # check decides (a Triton launch must happen); with no import to get one from, it is fatal
        imported = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
                    and not n.module.split(".")[0] in ("torch", "triton", "math", "typing", "__future__")]
        if not imported:
            problems.append("candidate has no @triton.jit kernel")
    inside_kernel = set()
    for k in jit_nodes:
        inside_kernel |= {id(n) for n in ast.walk(k)}
    # aliases of torch.nn.functional and of torch
    torch_names, fn_names = {"torch"}, {"F"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch":
                    torch_names.add(a.asname or "torch")
                if a.name == "torch.nn.functional":
                    fn_names.add(a.asname or "torch.nn.functional")
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod == "torch.nn" and any(a.name == "functional" for a in node.names):
                fn_names |= {a.asname or a.name for a in node.names if a.name == "functional"}
            if mod.startswith(("torch.nn.functional", "torch._")):
                problems.append(f"imports from {mod} (torch compute outside the kernels)")
            if mod == "torch":
                bad = [a.name for a in node.names if a.name not in ALLOWED_TORCH]
                if bad:
                    problems.append(f"imports torch compute functions: {', '.join(bad)}")
    ref_stem = ref_path.stem if ref_path else None
    for node in ast.walk(tree):
        if id(node) in inside_kernel:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if ref_stem and any(m and m.split(".")[-1] == ref_stem for m in mods):
                problems.append(f"imports the reference module {ref_stem!r}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            problems.append(f"line {node.lineno}: '@' matrix product outside the Triton kernels")
        elif isinstance(node, ast.Name) and node.id in ("Model", "get_inputs", "exec", "eval", "__import__"):
            problems.append(f"line {node.lineno}: uses {node.id!r} (the reference, or dynamic code)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ref_path is not None:
            if ref_path.name in node.value:
                problems.append(f"line {node.lineno}: mentions the reference file {ref_path.name!r}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, rest = name.partition(".")
            target = _dotted(node.args[0]).split(".")[0] if node.args else ""
            if name in ("getattr", "vars") and target in torch_names | fn_names and (
                    name == "vars" or len(node.args) < 2 or not isinstance(node.args[1], ast.Constant)):
                # a torch function picked by a name built at run time hides from the checks below
                problems.append(f"line {node.lineno}: {name}() on {_dotted(node.args[0])} with a name built at run time")
            elif head in torch_names and rest:
                first = rest.split(".")[0]
                if first == "nn":
                    sub = rest.split(".")[1] if "." in rest else ""
                    if sub == "functional":
                        problems.append(f"line {node.lineno}: calls {name} (torch compute outside the kernels)")
                    elif sub and sub not in ALLOWED_NN:
                        problems.append(f"line {node.lineno}: calls {name}")
                elif first in ("ops", "_C", "compile", "_dynamo", "_inductor", "library"):
                    problems.append(f"line {node.lineno}: calls {name}")
                elif first not in ALLOWED_TORCH:
                    problems.append(f"line {node.lineno}: calls {name} (torch compute outside the kernels)")
            elif head in fn_names and rest:
                problems.append(f"line {node.lineno}: calls {name} (torch compute outside the kernels)")
            elif (isinstance(node.func, ast.Attribute) and node.func.attr in COMPUTE_METHODS
                  and not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("tl", "triton", "math"))):
                problems.append(f"line {node.lineno}: calls .{node.func.attr}() (torch compute outside the kernels)")
    return sorted(set(problems)), kernels


# ---------------------------------------------------------------------------- the public entry

# the verdict's checks: decided in the verifier's own process, or observed inside the candidate's (best-effort)
CHECKS_OUTSIDE = ("static_source_check", "values_match_reference_on_fresh_inputs_and_unannounced_shapes",
                  "finite_outputs", "not_constant_or_zero", "not_cached_across_calls", "timeout")
CHECKS_BEST_EFFORT = ("no_torch_fallback", "triton_kernel_launched", "inputs_unmodified", "outputs_do_not_alias_inputs",
                      "verifier_not_tampered_with", "compiles_for_arch", "strategies", "speedup")
FRAME_CAP = 256 * 1024 * 1024  # bytes one answer of the candidate's process may take
_RNG_LOCK = threading.Lock()  # verify() runs in threads (generate, bench): seeding and drawing stay paired


class _Stop(Exception):
    """The candidate's process timed out, died or broke the protocol (the message says which)."""

    def __init__(self, msg: str, timed_out: bool = False):
        super().__init__(msg)
        self.timed_out = timed_out


def verify(ref: str | Path, candidate: str | Path, arch: str = "hopper", precision: str = "bf16", *,
           trials: int = 2, timeout: float = 300.0, timing: bool = True,
           strategies_for: tuple[str, ...] = (), unsafe: bool = False) -> dict:
    """Verify ``candidate`` (defines ``ModelNew`` + Triton kernels) against ``ref`` (defines ``Model``).

    Returns ``{"compiled", "correct", "max_abs_err", "max_rel_err", "strategies", "speedup",
    "reasons", "checks", "sandboxed", "flags", ...}``. Raises :class:`VerifyInputError` when the
    reference or arguments are unusable, and :class:`llmkit.tools.sandbox.SandboxUnavailable` when
    the sandbox cannot run here and ``unsafe`` is not set; every problem of the candidate (syntax,
    torch fallback, wrong, slow, hangs, escapes) is a result. ``strategies_for``: more
    architectures to compile for; their findings go to ``strategies_by_arch``.
    """
    from llmkit.tools import sandbox

    from .compiled import ARCHS

    ref, candidate = Path(ref), Path(candidate)
    if arch not in ARCHS:
        raise VerifyInputError(f"unknown --arch {arch!r}; known: {', '.join(ARCHS)}")
    if precision not in PRECISIONS:
        raise VerifyInputError(f"unknown --precision {precision!r}; known: {', '.join(PRECISIONS)}")
    for p, what in ((ref, "reference"), (candidate, "candidate")):
        if not p.is_file():
            raise VerifyInputError(f"{what} file not found: {p}")
    check_reference_source(ref)
    if not unsafe:
        sandbox.require(what="a candidate kernel")
    result = _empty_result(arch, precision)
    result["sandboxed"] = not unsafe
    if unsafe:
        result["flags"].append("unsandboxed")
    problems, kernels = static_check(candidate.read_text(), ref)
    result["kernels"] = kernels
    if problems:
        result["reasons"] += [f"static check: {p}" for p in problems]
        # a candidate that does not parse or has no kernel cannot be run meaningfully
        if any(p.startswith(("candidate does not parse", "candidate defines no", "candidate has no")) for p in problems):
            return result
    _Trial(ref, candidate, result, trials=trials, timeout=timeout, timing=timing,
           extra_archs=[a for a in strategies_for if a != arch], unsafe=unsafe).run()
    if problems:
        result["correct"] = False
    result["reasons"] = list(dict.fromkeys(result["reasons"]))  # de-duplicated, order kept
    return result


def _empty_result(arch, precision) -> dict:
    return {"compiled": False, "correct": False, "max_abs_err": None, "max_rel_err": None, "strategies": [],
            "speedup": None, "reasons": [], "arch": arch, "precision": precision, "speedup_vs_compile": None,
            "shapes_checked": 0, "launched": [], "sandboxed": True, "flags": [],
            "checks": {"outside": list(CHECKS_OUTSIDE), "best_effort": list(CHECKS_BEST_EFFORT)}}


# ---------------------------------------------------------------------------- the trusted side


def _load(path: Path):
    """The reference as a fresh module object (not left in sys.modules: verify() may run in threads)."""
    import importlib.util

    name = f"_llmkit_reference_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and the like look their module up while it executes
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the user's reference is unusable, whatever the reason
        raise VerifyInputError(f"reference {path} failed to import: {type(e).__name__}: {e}") from e
    finally:
        sys.modules.pop(name, None)
    return mod


def _shape_variants(ref_mod, rng) -> list[dict]:
    """Module-level int sizes that get_inputs() reads, and variants of them the candidate cannot know in
    advance: the example, then each size s drawn afresh from [s//2 + 1, s - 1] and from [s + 1, s + s//4 + 3]."""
    code = ref_mod.get_inputs.__code__
    fixed = set(ref_mod.get_init_inputs.__code__.co_names)  # sizes that shape the model stay
    sizes = {n: getattr(ref_mod, n) for n in code.co_names if n not in fixed
             and isinstance(getattr(ref_mod, n, None), int) and not isinstance(getattr(ref_mod, n), bool)}
    variants = [{}]
    if sizes:
        variants.append({n: rng.randint(v // 2 + 1, v - 1) if v > 2 else v - 1 for n, v in sizes.items() if v > 1})
        variants.append({n: rng.randint(v + 1, v + v // 4 + 3) for n, v in sizes.items() if v > 1})
    return variants


def _cast(x, dtype):
    import torch

    if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def _timing_reference(model, dtype):
    """The reference as it is timed: a copy cast to the candidate's input dtype.

    Timing feeds both models the same ``dtype`` inputs; the reference kept for correctness stays
    fp32 (it is fed fp32 copies), and an fp32 ``nn.Linear`` would reject bf16 inputs. Casting a copy
    times eager PyTorch at the precision the candidate runs at, and leaves the original untouched.
    """
    import copy

    if dtype is None:
        return model
    return copy.deepcopy(model).to(dtype)


def _timed(candidate_ms, model, inputs, dtype, speedups_fn) -> dict:
    """Result fields of the speedup measurement (``speedup``, ``speedup_vs_compile``, ``timing``).

    ``candidate_ms`` was measured in the candidate's process; the reference is timed here. A failure
    while timing (the reference, ``torch.compile``, a CUDA error) does not undo the verdict on
    correctness: it is recorded as ``timing_error`` with ``speedup`` null, never raised.
    """
    try:
        sp = speedups_fn(candidate_ms, _timing_reference(model, dtype), [_cast(x, dtype) for x in inputs])
    except Exception as e:  # noqa: BLE001 - reported in the result, the verification itself ran
        return {"speedup": None, "speedup_vs_compile": None, "timing_error": f"{type(e).__name__}: {str(e)[-300:]}"}
    return {"speedup": sp["speedup"], "speedup_vs_compile": sp["speedup_vs_compile"], "timing": sp}


def _flat(out):
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _same_bits(a, b) -> bool:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def compare(outs: list, refs: list, rtol: float, where: str = "example") -> tuple[list[str], float, float]:
    """(problems, max abs err, max rel err) of candidate outputs against the reference's, in this process.

    ``|out - ref| <= atol + rtol * |ref|`` with ``atol = rtol * mean|ref|``; a non-finite output where
    the reference is finite (NaN fills), a non-finite reference value not matched exactly, all-zero
    or constant outputs where the reference varies are problems.
    """
    import torch

    problems, max_abs, max_rel = [], 0.0, 0.0
    if len(outs) != len(refs) or any(not isinstance(o, torch.Tensor) or o.shape != r.shape for o, r in zip(outs, refs)):
        shapes = [tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outs]
        return [f"output shapes {shapes} != reference {[tuple(r.shape) for r in refs]} on shape {where}"], max_abs, max_rel
    for o, r in zip(outs, refs):
        o, r = o.detach().float().cpu(), r.detach().float().cpu()
        fin = torch.isfinite(r)
        if bool((~torch.isfinite(o) & fin).any()):
            problems.append(f"non-finite output where the reference is finite on shape {where}")
            continue
        if not bool((fin | (o == r) | (o.isnan() & r.isnan())).all()):
            problems.append(f"non-finite reference values not matched on shape {where}")
            continue
        o, r = torch.where(fin, o, 0.0), torch.where(fin, r, 0.0)
        atol = rtol * float(r.abs().mean()) + 1e-6 if r.numel() else 1e-6
        diff = (o - r).abs()
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float((diff / (r.abs() + atol)).max()))
        if r.numel() > 1 and float(r.std()) > 0:
            if float(o.abs().max()) == 0.0:
                problems.append("output is all zeros where the reference is not")
            elif float(o.std()) == 0.0:
                problems.append("output is constant where the reference is not")
        outside = diff > atol + rtol * r.abs()
        if bool(outside.any()):
            problems.append(f"wrong result on shape {where}: {int(outside.sum())} of {diff.numel()} elements outside "
                            f"tolerance (max abs err {float(diff.max()):.3g})")
    return problems, max_abs, max_rel


class _Trial:
    """One verification: the candidate's sandboxed process on one side, the reference and the judging here."""

    def __init__(self, ref: Path, candidate: Path, result: dict, *, trials, timeout, timing, extra_archs, unsafe):
        self.ref, self.candidate, self.res = ref, candidate, result
        self.trials, self.timeout, self.timing, self.extra_archs, self.unsafe = (trials, timeout, timing,
                                                                                extra_archs, unsafe)
        self.deadline = time.monotonic() + timeout
        self.k = 0

    # -- the channel to the candidate's process
    def _send(self, line: str):
        try:
            self.proc.proc.stdin.write((line + "\n").encode())
            self.proc.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise _Stop(f"the candidate's process stopped reading ({type(e).__name__})") from e

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        fd = self.proc.results.fileno()
        while len(buf) < n:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Stop(f"timed out after {self.timeout:g} s (infinite loop or far too slow); killed", True)
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                self.proc.proc.wait()  # closed: the process ended, its exit status says how
                rc = self.proc.proc.returncode
                how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit {rc}"
                raise _Stop(f"worker crashed ({how}): " + " | ".join(self.proc.log_tail()))
            buf += chunk
        return bytes(buf)

    def _recv(self) -> dict:
        import io

        import torch

        (n,) = struct.unpack(">Q", self._read(8))
        if n > FRAME_CAP:
            raise _Stop(f"the candidate's process sent {n} bytes (more than {FRAME_CAP}): rejected")
        try:
            msg = torch.load(io.BytesIO(self._read(n)), weights_only=True)
        except Exception as e:  # anything but plain tensors and values is refused
            raise _Stop(f"unreadable answer from the candidate's process ({type(e).__name__})") from e
        if not isinstance(msg, dict):
            raise _Stop("unreadable answer from the candidate's process (not a dict)")
        return msg

    def _request(self, cmd: str, inputs: list) -> dict:
        import torch

        path = self.indir / f"req{self.k}.pt"
        torch.save([x.cpu() if isinstance(x, torch.Tensor) else x for x in inputs], path)
        os.chmod(path, 0o644)
        self._send(f"{cmd} {self.k}")
        self.k += 1
        return self._recv()

    # -- the run
    def run(self) -> None:
        import torch

        from llmkit.tools import sandbox

        dtype_name, self.rtol = PRECISIONS[self.res["precision"]]
        self.dtype = getattr(torch, dtype_name) if dtype_name else None
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.ref_mod = _load(self.ref)
        init = self.ref_mod.get_init_inputs()
        with _RNG_LOCK:
            torch.manual_seed(0)
            self.model = self.ref_mod.Model(*init).to(self.device).eval()
        with tempfile.TemporaryDirectory(prefix="llmkit-verify-") as tmp:
            self.indir = Path(tmp) / "in"
            self.indir.mkdir()
            (self.indir / "candidate.py").write_text(self.candidate.read_text())
            torch.save({"init": list(init), "state": {k: v.detach().cpu() for k, v in self.model.state_dict().items()}},
                       self.indir / "init.pt")
            site = sorted({p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)})
            (self.indir / "config.json").write_text(json.dumps({
                "sys_path": [str(_REPO)], "site": site, "nproc": 256, "device": self.device,
                "interpret": self.device == "cpu", "dtype": dtype_name}))
            for f in self.indir.iterdir():
                os.chmod(f, 0o644)
            gpu = sandbox.gpu_device_nodes() if self.device == "cuda" else []
            # torch + triton need room: address space (none on a GPU: CUDA reserves huge ranges), threads, files
            limits = sandbox.Limits(timeout=self.timeout, memory_mb=None if gpu else 16384, nproc=256,
                                    cpu_seconds=int(self.timeout * 2) + 10, fsize_mb=64, disk_mb=512, nofile=1024)
            env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TRITON_DEFAULT_FP_FUSION": "1",
                   "TRITON_CACHE_DIR": "{work}/triton", "HOME": "{work}"}
            binds = [str(_REPO / "llmkit"), *site]
            libcuda = _libcuda_dir() if gpu else None
            if libcuda:  # Triton finds libcuda through ldconfig's cache, which the sandbox does not have
                env["TRITON_LIBCUDA_PATH"] = libcuda
                binds += [] if libcuda.startswith("/usr/") else [libcuda]
            runner = str(Path(__file__).with_name("candidate_runner.py"))
            self.proc = sandbox.spawn_python(runner, ["{in}", "{result_fd}"], str(self.indir), limits,
                                             ro_binds=binds, devices=gpu, env=env, unsafe=self.unsafe)
            with self.proc:
                try:
                    self._drive()
                except _Stop as e:
                    self.res["reasons"].append(str(e))
                    self.res["correct"] = False
                    if e.timed_out:
                        self.res["timed_out"] = True
                finally:
                    try:
                        self.proc.proc.stdin.write(b"exit\n")
                        self.proc.proc.stdin.flush()
                    except OSError:
                        pass

    def _drive(self) -> None:
        import random

        import torch

        from .taxonomy import load_taxonomy

        res, reasons = self.res, self.res["reasons"]
        hello = self._recv()
        if "error" in hello:
            reasons.append(f"candidate failed to load (import or ModelNew(*get_init_inputs())): {hello['error']}")
            return
        tamper = list(hello.get("tampered") or [])
        rng = random.SystemRandom()
        variants = _shape_variants(self.ref_mod, rng)
        originals = {n: getattr(self.ref_mod, n) for v in variants for n in v}
        ok, n_checked, fallback, escapes, launched, shapes = True, 0, set(), set(), [], []
        max_abs = max_rel = 0.0
        prev = None
        try:
            for vi, variant in enumerate(variants):
                for n, v in variant.items():
                    setattr(self.ref_mod, n, v)
                where = ", ".join(f"{n}={v}" for n, v in variant.items()) or "example"
                # the example shape always gets two calls on different inputs: a result cached per shape shows
                for t in range(max(self.trials, 2) if vi == 0 else self.trials):
                    try:
                        with _RNG_LOCK:
                            torch.manual_seed(secrets.randbits(62))
                            inputs = [x.to(self.device) if isinstance(x, torch.Tensor) else x
                                      for x in self.ref_mod.get_inputs()]
                    except Exception as e:  # noqa: BLE001 - the reference cannot make this variant: skip it
                        reasons.append(f"shape variant {where} skipped: get_inputs failed ({e})")
                        break
                    cand_in = [_cast(x.clone(), self.dtype) if isinstance(x, torch.Tensor) else x for x in inputs]
                    try:
                        with torch.no_grad():  # the reference runs here, on its own copies
                            refs = [r.detach().float().cpu() for r in _flat(self.model(*[
                                _cast(x.clone(), self.dtype).float() if isinstance(x, torch.Tensor) and self.dtype
                                else x for x in inputs]))]
                    except Exception as e:  # noqa: BLE001 - the reference itself cannot run this variant
                        reasons.append(f"shape variant {where} skipped: the reference failed ({e})")
                        break
                    reply = self._request("run", cand_in)
                    if "error" in reply:
                        reasons.append(f"ModelNew failed on shape {where}: {reply['error']}")
                        ok = False
                        break
                    n_checked += 1
                    shapes.append(where)
                    outs = list(reply.get("outputs") or [])
                    problems, a, r = compare(outs, refs, self.rtol, where)
                    max_abs, max_rel = max(max_abs, a), max(max_rel, r)
                    after = list(reply.get("inputs_after") or [])
                    sent = [x.cpu() for x in cand_in if isinstance(x, torch.Tensor)]
                    if len(after) != len(sent) or not all(_same_bits(x, y) for x, y in zip(sent, after)):
                        problems.append("modified its inputs (inputs are handed over as copies and must stay unchanged)")
                    if reply.get("aliases"):
                        problems.append(f"output(s) {list(reply['aliases'])} alias an input (a kernel must write its "
                                        "own output buffer)")
                    if prev is not None and len(prev[0]) == len(outs) == len(refs):
                        same_out = all(_same_bits(x, y) for x, y in zip(prev[0], outs))
                        same_ref = all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(prev[1], refs))
                        if same_out and not same_ref:
                            problems.append("output did not change when the inputs did (cached result)")
                    prev = (outs, refs)
                    fallback |= set(reply.get("fallback_ops") or [])
                    escapes |= set(reply.get("escapes") or [])
                    tamper += list(reply.get("tampered") or [])
                    launched += list(reply.get("launched") or [])
                    if problems:
                        reasons.extend(problems)
                        ok = False
        finally:
            for n, v in originals.items():
                setattr(self.ref_mod, n, v)
        res["shapes_checked"], res["shapes"] = n_checked, shapes
        res["max_abs_err"], res["max_rel_err"] = max_abs, max_rel
        if fallback:
            reasons.append("torch fallback: ModelNew.forward computes with torch ops " + ", ".join(sorted(fallback)))
        if escapes:
            reasons.append("torch fallback: ModelNew.forward moves tensor data out of torch (" +
                           ", ".join(sorted(escapes)) + ")")
        if tamper:
            reasons.append("tampering with the verifier: " + "; ".join(sorted(set(tamper))))
        if not launched:
            reasons.append("no Triton kernel was launched")
        res["launched"] = sorted(set(launched))
        ok = ok and not (fallback or escapes or tamper) and bool(launched) and n_checked > 0
        # compile the first launch of every kernel for the targets (in the candidate's process: its code)
        compiled_ok = bool(launched)
        res["strategies_by_arch"] = {}
        if launched:
            archs = [res["arch"], *self.extra_archs]
            self._send("compile " + ",".join(archs))
            got = self._recv()
            asm, errors = got.get("asm") or {}, got.get("errors") or {}
            for a in archs:
                tax = load_taxonomy(a)
                found = set()
                for kernel_asm in (asm.get(a) or {}).values():
                    if isinstance(kernel_asm, dict):
                        found |= set(tax.found({k: v for k, v in kernel_asm.items() if isinstance(v, str)}))
                res["strategies_by_arch"][a] = sorted(found)
                for name, err in (errors.get(a) or {}).items():
                    if a == res["arch"]:
                        compiled_ok = False
                        reasons.append(f"{name} does not compile for {a}: {err}")
                    else:
                        res.setdefault("compile_errors", {})[a] = f"{name}: {err}"
        res["compiled"] = compiled_ok
        res["strategies"] = res["strategies_by_arch"].get(res["arch"], [])
        res["correct"] = bool(ok and compiled_ok)
        if self.timing and res["correct"] and self.device == "cuda":
            self._time()
        elif self.device == "cpu":
            res["timing_note"] = "no GPU: correctness ran under Triton's interpreter; speedup needs a GPU"

    def _time(self) -> None:
        """Speedup on a GPU: the candidate times itself in its process (best-effort), the reference is timed
        here; the outputs after the timed calls are checked too (a candidate that skips work when timed fails)."""
        import torch

        from .timing import SUSPICIOUS, speedups

        res = self.res
        with _RNG_LOCK:
            torch.manual_seed(secrets.randbits(62))
            inputs = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self.ref_mod.get_inputs()]
        t0 = time.monotonic()
        reply = self._request("time", [_cast(x.clone(), self.dtype) if isinstance(x, torch.Tensor) else x
                                       for x in inputs])
        wall_ms = (time.monotonic() - t0) * 1000
        ms = reply.get("ms")
        if "error" in reply or not isinstance(ms, float) or not 0 < ms < wall_ms:
            res["timing_error"] = reply.get("error") or f"implausible time reported by the candidate's process: {ms!r}"
            return
        with torch.no_grad():
            refs = [r.detach().float().cpu() for r in _flat(self.model(*[
                _cast(x.clone(), self.dtype).float() if isinstance(x, torch.Tensor) and self.dtype else x
                for x in inputs]))]
        problems, _, _ = compare(list(reply.get("outputs") or []), refs, self.rtol, "example (after timing)")
        if problems:
            res["reasons"] += problems
            res["correct"] = False
            return
        res.update(_timed(ms, self.model, inputs, self.dtype, speedups))
        if res.get("timing", {}).get("suspicious"):
            res["flags"].append("suspicious_speedup")
            res["reasons"].append(f"suspicious speedup {res['speedup']:.1f}x > {SUSPICIOUS:g}x: flagged, not trusted")


def _libcuda_dir() -> str | None:
    """The folder holding the host's libcuda.so.1 (from ldconfig's cache), or None."""
    import subprocess

    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in out.splitlines():
            if "libcuda.so.1" in line and "=>" in line:
                return os.path.dirname(os.path.realpath(line.split("=>")[-1].strip()))
    return None


_REPO = Path(__file__).resolve().parents[3]
