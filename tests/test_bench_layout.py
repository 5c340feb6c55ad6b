"""bench/ scripts run with bench/ as sys.path[0]; bench/select.py must not shadow the stdlib's `select` there."""

from __future__ import annotations

import subprocess
import sys


def test_bench_folder_on_the_path_keeps_the_stdlib_select(repo_root):
    code = ("import sys; sys.path.insert(0, 'bench'); import subprocess, selectors, select; "
            "assert hasattr(select, 'select') and hasattr(selectors, 'SelectSelector'), select; "
            "print(subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True, text=True).stdout)")
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"


def test_bench_folder_on_the_path_keeps_asyncio_importable(repo_root):
    """asyncio -> socket -> selectors -> select, with subprocess not yet imported (what bench/serving.py meets)."""
    code = ("import sys; sys.path.insert(0, 'bench'); import asyncio, subprocess, select; "
            "assert hasattr(select, 'select'), select; print(2)")
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "2"


def test_bench_select_still_runs_as_a_script(repo_root):
    out = subprocess.run([sys.executable, "bench/select.py", "--help"], check=False, cwd=repo_root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--quick" in out.stdout
