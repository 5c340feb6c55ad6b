"""The layout rule (DESIGN.md): importable code only in llmkit/; the top-level script folders are not packages."""

from __future__ import annotations

import tomllib

SCRIPT_DIRS = ["recipes", "kernels", "evals", "bench"]


def test_script_folders_hold_no_package(repo_root):
    offenders = []
    for d in SCRIPT_DIRS:
        base = repo_root / d
        assert base.is_dir(), f"top-level folder {d}/ is missing"
        offenders += [str(p.relative_to(repo_root)) for p in base.rglob("__init__.py")]
    assert offenders == [], f"these make a shadowing package: {offenders}"


def test_only_llmkit_is_packaged(repo_root):
    top_packages = sorted(
        p.parent.name for p in repo_root.glob("*/__init__.py") if not p.parent.name.startswith(".")
    )
    assert top_packages == ["llmkit"]
    cfg = tomllib.loads((repo_root / "pyproject.toml").read_text())
    assert cfg["tool"]["setuptools"]["packages"]["find"]["include"] == ["llmkit*"]
    assert cfg["project"]["scripts"]["llmkit"] == "llmkit.cli:main"


def test_no_top_level_python_modules(repo_root):
    stray = [p.name for p in repo_root.glob("*.py")]
    assert stray == [], f"top-level .py files would be importable from the repo root: {stray}"
