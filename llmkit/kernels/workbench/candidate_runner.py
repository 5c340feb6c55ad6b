"""The candidate's side of the kernel verifier: a program run inside the sandbox, never given the reference.

:func:`.verify.verify` starts it with :func:`llmkit.tools.sandbox.spawn_python` as
``python candidate_runner.py <input folder> <result fd>``. The input folder (read-only) holds
``config.json``, ``candidate.py`` and ``init.pt`` (the constructor arguments and the reference's
parameters, nothing that computes). The verifier then writes ``req<k>.pt`` (one trial's inputs,
already cast) and sends a line on stdin; each answer is one frame on the result pipe: an 8-byte
big-endian length and a ``torch.save``'d dict of plain values and tensors.

- ``run <k>``: call ``ModelNew.forward`` on the inputs of ``req<k>.pt`` inside :func:`.compiled.capture`
  and answer with the outputs, the inputs as they are afterwards (so the verifier sees a change),
  which outputs share storage with an input, the Triton launches, and what the fallback detectors saw;
- ``compile <arch,...>``: the code of the first launch of every kernel compiled for those targets;
- ``time <k>``: on a GPU, the candidate's median time per call (CUDA events), then one more call's outputs;
- ``exit``.

Everything this process reports is observed inside the candidate's own process, which the candidate
controls, so the verifier treats it as best-effort: torch-fallback detection, the launch record,
input mutation and aliasing, the compiled code, GPU timing. Correctness is decided outside.

Torch-fallback detection (what a forward may do outside a kernel: allocate, view, copy) uses two
detectors a candidate would have to defeat together: a ``TorchDispatchMode`` and the autograd
profiler (a C++ record that popping dispatch modes or ``_DisableTorchDispatch`` does not hide).
Neither trusts the recorder's ``in_launch`` flag: a compute op is a fallback inside a launch too
(Triton's interpreter itself only allocates and copies), and the flag being set with no launch
running is reported as tampering, as is a changed recorder or a dispatch mode popped during the
forward. Moving tensor data out of torch (``.numpy()``, ``__array__``, ``.tolist()``) outside a
launch is flagged as well.
"""

from __future__ import annotations

import io
import json
import os
import struct
import sys

_INTERPRETER_ATEN = {"set_", "set", "to"}  # what Triton's interpreter and .to() add around a launch


def _frame(write, obj) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    write(struct.pack(">Q", len(data)) + data)


def _setup(folder: str):
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    import resource

    if cfg.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
    import site

    for p in cfg["sys_path"]:
        sys.path.insert(0, p)
    for p in cfg["site"]:
        site.addsitedir(p)
    return cfg


def main(folder: str, result_fd: int) -> None:
    cfg = _setup(folder)
    out = os.fdopen(result_fd, "wb", buffering=0)

    def send(obj):
        _frame(out.write, obj)

    import importlib.util

    import torch
    import torch.utils._python_dispatch as pyd
    from torch.utils._python_dispatch import TorchDispatchMode

    from llmkit.kernels.workbench import compiled as C
    from llmkit.kernels.workbench.verify import ALLOWED_ATEN, _flat

    device = cfg["device"]
    dtype = getattr(torch, cfg["dtype"]) if cfg["dtype"] else None
    # what the candidate could switch off, fixed before its code runs
    launch_code = C._patched_run.__code__
    pristine = {"compiled._patched_run": (C, "_patched_run", C._patched_run),
                "compiled._patched_irun": (C, "_patched_irun", C._patched_irun),
                "compiled.capture": (C, "capture", C.capture), "compiled._rec": (C, "_rec", C._rec),
                "compiled.run_interpreted": (C, "run_interpreted", C.run_interpreted)}
    state = {"forward": False, "notes": set(), "ops": set(), "escapes": set()}

    def in_launch() -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code is launch_code:
                return True
            f = f.f_back
        return False

    def note_pop(what):
        def wrap(fn):
            def popped(*a, **k):
                if state["forward"]:
                    state["notes"].add(f"{what} during the forward")
                return fn(*a, **k)
            return popped
        return wrap

    # every Python-level way to take a dispatch mode off the stack (pyd holds its own references)
    for owner, names in ((torch._C, ("_pop_torch_dispatch_stack", "_unset_dispatch_mode")),
                         (pyd, ("_pop_mode", "_pop_torch_dispatch_stack", "_unset_infra_mode"))):
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, note_pop("popped a dispatch mode")(getattr(owner, name)))
    disable = torch._C._DisableTorchDispatch

    class _Disable(disable):  # a subclass keeps isinstance() and the context-manager protocol
        def __enter__(self):
            if state["forward"]:
                state["notes"].add("disabled torch dispatch during the forward")
            return super().__enter__()

    torch._C._DisableTorchDispatch = _Disable
    for name in ("numpy", "__array__", "tolist"):
        orig = getattr(torch.Tensor, name)

        def escape(self, *a, _orig=orig, _name=name, **k):
            if state["forward"] and not in_launch():
                state["escapes"].add(_name)
            return _orig(self, *a, **k)

        setattr(torch.Tensor, name, escape)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = getattr(func, "overloadpacket", None)
            base = packet.__name__ if packet is not None else str(func)
            if base not in ALLOWED_ATEN and base.rstrip("_") not in ALLOWED_ATEN and base not in _INTERPRETER_ATEN:
                state["ops"].add(base)
            if C._rec.in_launch and not in_launch():
                state["notes"].add("set the recorder's in_launch flag outside a kernel launch")
            return func(*args, **(kwargs or {}))

    def tampered() -> list[str]:
        bad = [k for k, (obj, attr, v) in pristine.items() if getattr(obj, attr, None) is not v]
        if C._patched_run.__code__ is not launch_code:
            bad.append("compiled._patched_run code")
        return [f"changed the verifier's {k}" for k in bad]

    try:
        spec = importlib.util.spec_from_file_location("candidate", os.path.join(folder, "candidate.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["candidate"] = mod
        spec.loader.exec_module(mod)
        init = torch.load(os.path.join(folder, "init.pt"), weights_only=True)
        torch.manual_seed(0)
        new = mod.ModelNew(*init["init"]).to(device).eval()
        sd = init["state"]
        if sd and set(sd) == set(new.state_dict()):
            new.load_state_dict(sd)
        if dtype is not None:
            new = new.to(dtype)
    except BaseException as e:  # noqa: BLE001 - any failure of the candidate is its result
        send({"error": f"{type(e).__name__}: {str(e)[-400:]}", "stage": "load"})
        return
    send({"ready": True, "tampered": tampered()})
    launches_by_kernel: dict = {}

    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "exit":
            return
        if cmd == "compile":
            send(_compile(C, launches_by_kernel, arg.split(",")))
            continue
        if cmd not in ("run", "time"):
            send({"error": f"unknown command {cmd!r}"})
            continue
        inputs = [x.to(device) if isinstance(x, torch.Tensor) else x
                  for x in torch.load(os.path.join(folder, f"req{arg}.pt"), weights_only=True)]
        reply = {}
        if cmd == "time":
            from llmkit.kernels.workbench.timing import time_gpu

            try:
                with torch.no_grad():
                    reply["ms"] = time_gpu(lambda inputs=inputs: new(*inputs))
            except Exception as e:  # noqa: BLE001
                send({"error": f"{type(e).__name__}: {str(e)[-400:]}", "stage": "time"})
                continue
        state.update(notes=set(), ops=set(), escapes=set())
        watch = Watch()
        try:
            with (C.capture(interpret=cfg["interpret"]) as launches, torch.no_grad(),
                  torch.autograd.profiler.profile(use_cpu=True) as prof, watch):
                state["forward"] = True
                try:
                    result = new(*inputs)
                    if watch not in pyd._get_current_dispatch_mode_stack():
                        state["notes"].add("removed the verifier's dispatch mode")
                finally:
                    state["forward"] = False
        except BaseException as e:  # noqa: BLE001
            send({"error": f"{type(e).__name__}: {str(e)[-400:]}", "stage": "forward"})
            continue
        try:
            profiled = {ev.name[len("aten::"):] for ev in prof.function_events if ev.name.startswith("aten::")}
        except Exception as e:  # noqa: BLE001 - a profiler the candidate stopped or replaced
            profiled = set()
            state["notes"].add(f"the profiler's record is unreadable ({type(e).__name__})")
        ops = state["ops"] | {n for n in profiled if n not in ALLOWED_ATEN and n.rstrip("_") not in ALLOWED_ATEN
                              and n not in _INTERPRETER_ATEN}
        outs = _flat(result)
        in_tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        aliases = [i for i, o in enumerate(outs) if any(_overlap(o, x) for x in in_tensors)]
        for L in launches:
            launches_by_kernel.setdefault(L.name, L)
        reply.update(outputs=[o.detach().to("cpu", copy=True).contiguous() for o in outs],
                     inputs_after=[x.detach().to("cpu", copy=True) for x in in_tensors], aliases=aliases,
                     launched=[L.name for L in launches], fallback_ops=sorted(ops),
                     escapes=sorted(state["escapes"]), tampered=sorted(state["notes"]) + tampered())
        send(reply)


def _overlap(a, b) -> bool:
    """Do two tensors share memory (same storage, overlapping byte ranges)?"""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.device != sb.device or sa.nbytes() == 0 or sb.nbytes() == 0:
        return False
    pa, pb = sa.data_ptr(), sb.data_ptr()
    return pa < pb + sb.nbytes() and pb < pa + sa.nbytes()


def _compile(C, launches_by_kernel: dict, archs: list[str]) -> dict:
    asm, errors = {}, {}
    for arch in archs:
        asm[arch] = {}
        for name, L in launches_by_kernel.items():
            try:
                asm[arch][name] = C.compile_launch(L, arch)
            except Exception as e:  # noqa: BLE001 - reported by the verifier
                errors.setdefault(arch, {})[name] = f"{type(e).__name__}: {str(e)[-300:]}"
    return {"asm": asm, "errors": errors}


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
