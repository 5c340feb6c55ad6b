"""Compile-and-inspect: run Triton kernels on CPU and see what each GPU target would get.

Two facts make the Hawkeye workbench testable without a GPU (DESIGN.md): ``TRITON_INTERPRET``
runs ``@triton.jit`` kernels on CPU tensors, and ``triton.compile`` produces PTX/cubin for
``GPUTarget("cuda", 80|90|100, 32)`` and AMDGCN for ``GPUTarget("hip", "gfx950", 64)`` on a
machine with no GPU.

:func:`capture` is the bridge. Inside it every launch ``kernel[grid](*args, **kw)`` of a plain
``JITFunction``

1. is recorded as a :class:`Launch` (kernel + its arguments, bound by Triton's own binder, so the
   signature, constexprs, pointer/int divisibility attributes and options are exactly those the
   JIT would compile for that call), and
2. runs: natively when a GPU is present, otherwise under Triton's interpreter. The interpreter is
   chosen per launch (``InterpretedFunction`` over the kernel's Python function, with the
   ``@triton.jit`` helpers it calls swapped for interpreted twins while it runs), so the same
   module-level kernels can also be compiled for GPU targets in the same process; setting
   ``TRITON_INTERPRET=1`` at import would make them uncompilable.

:func:`compile_launch` then compiles a recorded launch for an architecture and returns the text
of every stage (``ttir``, ``ttgir``, ``llir``, ``ptx`` or ``amdgcn``); results are cached per
(kernel source, signature, constexprs, attrs, options, target) for the life of the process, which
keeps a strategy suite that compiles for four targets to a few seconds per kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("ampere", "hopper", "blackwell", "mi350")
# arch -> (backend, arch, warp size) as triton's GPUTarget takes it
TARGETS = {
    "ampere": ("cuda", 80, 32),
    "hopper": ("cuda", 90, 32),
    "blackwell": ("cuda", 100, 32),
    "mi350": ("hip", "gfx950", 64),
}
STAGES = ("ttir", "ttgir", "llir", "ptx", "amdgcn")


def gpu_target(arch: str):
    from triton.backends.compiler import GPUTarget

    if arch not in TARGETS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    return GPUTarget(*TARGETS[arch])


def native_arch() -> str | None:
    """The workbench name of the GPU in this machine, or None (no GPU, or one we have no taxonomy for)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        if getattr(torch.version, "hip", None):
            name = torch.cuda.get_device_properties(0).gcnArchName
            return "mi350" if name.startswith("gfx950") else None
        major, _ = torch.cuda.get_device_capability()
    except Exception:  # noqa: BLE001 - broken driver: treat as no GPU
        return None
    return {8: "ampere", 9: "hopper", 10: "blackwell"}.get(major)


@dataclass
class Launch:
    """One recorded kernel launch: enough to compile it for any target later."""

    kernel: Any  # triton JITFunction
    args: tuple
    kwargs: dict
    grid: Any = None
    specs: dict = field(default_factory=dict)  # arch -> (signature, constexprs, attrs, options)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def module(self) -> str:
        return getattr(self.kernel.fn, "__module__", "")


class _Recorder(threading.local):
    def __init__(self):
        self.stack: list[list[Launch]] = []
        self.interpret = True
        self.in_launch = False  # True while a captured kernel runs (the verifier ignores its torch ops)


_rec = _Recorder()
_patch_lock = threading.Lock()
_patch_depth = 0
_orig_run = None
_orig_irun = None


def _bind(launch: Launch, arch: str):
    """Triton's own binder for ``arch``: signature, constexprs, attrs, options of this call."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = as_jit(launch.kernel)
    backend = make_backend(gpu_target(arch))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    bound_args, specialization, _ = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, {})
    opts = {k: v for k, v in kwargs.items() if k not in signature and k in options.__dict__}
    return signature, constexprs, attrs, opts


def _is_kernel_fn(obj) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(obj, (JITFunction, InterpretedFunction))


def _reachable(fn, seen: dict) -> None:
    """(globals dict, name, function) for every @triton.jit function reachable from ``fn``'s globals."""
    g = fn.__globals__
    for name in fn.__code__.co_names:
        obj = g.get(name)
        if _is_kernel_fn(obj) and (id(g), name) not in seen:
            seen[(id(g), name)] = (g, name, obj)
            _reachable(obj.fn, seen)


def _language_functions(seen: dict) -> None:
    """triton.language's own @jit functions (tl.zeros, tl.sum, tl.cdiv, ...) in every language module."""
    import sys

    for modname, mod in list(sys.modules.items()):
        if mod is None or not modname.startswith("triton.language"):
            continue
        g = vars(mod)
        for name, obj in list(g.items()):
            if _is_kernel_fn(obj) and (id(g), name) not in seen:
                seen[(id(g), name)] = (g, name, obj)


_JIT_TWINS: dict = {}
_INTERP_TWINS: dict = {}


def as_jit(obj):
    """The compilable JITFunction for a @triton.jit function, whatever mode it was decorated in."""
    from triton.runtime.jit import JITFunction

    if isinstance(obj, JITFunction):
        return obj
    fn = obj.fn
    if fn not in _JIT_TWINS:
        _JIT_TWINS[fn] = JITFunction(fn)
    return _JIT_TWINS[fn]


def _as_interp(obj):
    fn = obj.fn
    if fn not in _INTERP_TWINS:
        _INTERP_TWINS[fn] = _twin_class()(fn)
    return _INTERP_TWINS[fn]


@contextlib.contextmanager
def _mode(kernel_fn, mode: str):
    """Make every @jit function reachable from ``kernel_fn`` compilable (``"jit"``) or interpreted
    (``"interp"``) for the duration of the block.

    Triton decides at decoration time (``TRITON_INTERPRET``) which of the two a ``@triton.jit``
    function is; the workbench needs both in one process (run on CPU, compile for GPU targets),
    whichever way the kernels were decorated.
    """
    seen: dict = {}
    _language_functions(seen)
    _reachable(kernel_fn, seen)
    make = as_jit if mode == "jit" else _as_interp
    for g, name, obj in seen.values():
        g[name] = make(obj)
    try:
        yield
    finally:
        for g, name, obj in seen.values():
            g[name] = obj


_TWIN = None


def _fix_interpreter_dot():
    """Two bugs of Triton 3.9's interpreter with bf16 (stored as uint16 bits, numpy has no bf16):
    ``tl.dot`` multiplies the raw bits, and integer -> bf16 casts store the integer as bits. Widen
    dot operands to float32 first (exact) and cast integers via float32. Returns the undo function."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    orig = InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16 or h.dtype == tl.bfloat16:
            if h.data.dtype == np.uint16:  # bf16 bits
                return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return TensorHandle(h.data.astype(np.float32), tl.float32)  # already widened values
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    orig_cast = InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        # integer -> bf16 is cast as integer values into the uint16 storage (garbage bits): go via fp32
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar.is_int():
            return orig_cast(self, orig_cast(self, src, tl.float32), dst_type)
        return orig_cast(self, src, dst_type)

    InterpreterBuilder.create_dot = create_dot
    InterpreterBuilder.cast_impl = cast_impl

    def undo():
        InterpreterBuilder.create_dot = orig
        InterpreterBuilder.cast_impl = orig_cast

    return undo


def _twin_class():
    """InterpretedFunction whose device calls undo their patching of triton.language on return.

    (Triton's own leaves ``tl`` patched after a helper call, which is harmless when the whole
    process interprets but breaks compiling for a GPU target afterwards.)
    """
    global _TWIN
    if _TWIN is None:
        from triton.runtime.errors import InterpreterError
        from triton.runtime.interpreter import InterpretedFunction, _patch_lang

        class _Twin(InterpretedFunction):
            def __call__(self, *args, **kwargs):
                scope = _patch_lang(self.fn)
                try:
                    return self.rewrite()(*args, **kwargs)
                except InterpreterError:
                    raise
                except Exception as e:
                    raise InterpreterError(repr(e)) from e
                finally:
                    scope.restore()

        _TWIN = _Twin
    return _TWIN


def run_interpreted(kernel, grid, *args, **kwargs):
    """Run a @triton.jit kernel under Triton's interpreter on CPU tensors."""
    import os

    from triton import knobs

    prev, env = knobs.runtime.interpret, os.environ.get("TRITON_INTERPRET")
    knobs.runtime.interpret = True
    undo = _fix_interpreter_dot()
    try:
        with _mode(kernel.fn, "interp"):
            kw = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
            return _twin_class()(kernel.fn)[grid](*args, **kw)
    finally:
        undo()
        knobs.runtime.interpret = prev
        if env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env


def _patched_irun(self, *args, grid, warmup, **kwargs):
    """InterpretedFunction.run inside capture (a process that imported kernels with TRITON_INTERPRET=1)."""
    if not _rec.stack or isinstance(self, _twin_class()):
        return _orig_irun(self, *args, grid=grid, warmup=warmup, **kwargs)
    return _patched_run(as_jit(self), *args, grid=grid, warmup=warmup, **kwargs)


def _patched_run(self, *args, grid, warmup, **kwargs):
    if not _rec.stack:  # another thread or outside capture: behave as Triton does
        return _orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    launch = Launch(self, args, {k: v for k, v in kwargs.items()}, grid)
    for frame in _rec.stack:
        frame.append(launch)
    # bind for the recorded call now, while the tensors still hold their data pointers
    for arch in ARCHS:
        try:
            launch.specs[arch] = _bind(launch, arch)
        except Exception as e:  # noqa: BLE001 - recorded, reported when compiling
            launch.specs[arch] = e
    if warmup:
        return None
    prev, _rec.in_launch = _rec.in_launch, True
    try:
        if _rec.interpret:
            return run_interpreted(self, grid, *args, **kwargs)
        return _orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    finally:
        _rec.in_launch = prev


def launch_device() -> str:
    """Where a kernel launched now runs, hence where its tensors must live: ``"cpu"`` or ``"cuda"``.

    Inside :func:`capture` it follows the capture's mode (interpreter: CPU tensors; native: the
    GPU, ``cuda`` for CUDA and ROCm alike). Outside one, a plain launch runs natively when a GPU is
    present and Triton's interpreter is off.
    """
    if _rec.stack:
        return "cpu" if _rec.interpret else "cuda"
    import torch
    from triton import knobs

    return "cuda" if torch.cuda.is_available() and not knobs.runtime.interpret else "cpu"


@contextlib.contextmanager
def capture(interpret: bool | None = None):
    """Record (and run) every JIT launch inside the block; yields the list of :class:`Launch`.

    ``interpret=None`` runs natively when a CUDA/ROCm device is present, else on the interpreter.
    """
    global _patch_depth, _orig_run, _orig_irun
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if interpret is None:
        import torch

        interpret = not torch.cuda.is_available()
    with _patch_lock:
        if _patch_depth == 0:
            _orig_run, _orig_irun = JITFunction.run, InterpretedFunction.run
            JITFunction.run = _patched_run
            InterpretedFunction.run = _patched_irun
        _patch_depth += 1
    launches: list[Launch] = []
    _rec.stack.append(launches)
    prev, _rec.interpret = _rec.interpret, interpret
    try:
        yield launches
    finally:
        _rec.stack.pop()
        _rec.interpret = prev
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                JITFunction.run = _orig_run
                InterpretedFunction.run = _orig_irun


_cache: dict[str, dict[str, str]] = {}


def _key(launch: Launch, arch: str, spec) -> str:
    sig, constexprs, attrs, opts = spec
    h = hashlib.sha256()
    for part in (as_jit(launch.kernel).cache_key, arch, sig, sorted(constexprs.items(), key=str), sorted(attrs.items()),
                 sorted(opts.items())):
        h.update(repr(part).encode())
    return h.hexdigest()


def compile_launch(launch: Launch, arch: str) -> dict[str, str]:
    """Compile a recorded launch for ``arch``; returns {stage: text} (ttir, ttgir, llir, ptx|amdgcn).

    Raises what Triton raises when the kernel does not compile for that target.
    """
    import triton
    from triton.compiler import ASTSource

    spec = launch.specs.get(arch)
    if spec is None:
        spec = launch.specs[arch] = _bind(launch, arch)
    if isinstance(spec, Exception):
        raise spec
    key = _key(launch, arch, spec)
    if key not in _cache:
        sig, constexprs, attrs, opts = spec
        kernel = as_jit(launch.kernel)
        with _mode(kernel.fn, "jit"):
            src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
            k = triton.compile(src, target=gpu_target(arch), options=dict(opts))
        _cache[key] = {s: k.asm[s] for s in STAGES if isinstance(k.asm.get(s), str)}
    return _cache[key]


def compile_kernel(kernel, arch: str, *args, **kwargs) -> dict[str, str]:
    """Compile ``kernel`` for ``arch`` as a launch with these arguments would be, without running it."""
    launch = Launch(as_jit(kernel), args, kwargs)
    return compile_launch(launch, arch)
