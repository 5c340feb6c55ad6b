"""Load the Hawkeye strategy taxonomy (``kernels/taxonomy/<arch>.yaml``) and recognize strategies.

A taxonomy file lists, for one architecture, the optimization strategies that architecture really
has. Each strategy says what it exploits, when it pays, the precisions it applies to, the path of
its unit test, and how to recognize it in compiled code: ``recognize`` maps a compiler stage
(``ttir``, ``ttgir``, ``llir``, ``ptx``, ``amdgcn``) to regular expressions that must ALL match
that stage's text (and, if given, ``absent`` patterns that must not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from .compiled import ARCHS, STAGES

REQUIRED = ("name", "exploits", "pays_when", "recognize", "precisions", "test")


def taxonomy_dir() -> Path:
    """``kernels/taxonomy`` of the checkout this package lives in."""
    return Path(__file__).resolve().parents[3] / "kernels" / "taxonomy"


@dataclass(frozen=True)
class Strategy:
    name: str
    exploits: str
    pays_when: str
    recognize: dict
    precisions: tuple
    test: str
    absent: dict = field(default_factory=dict)

    def evidence(self, asm: dict[str, str]) -> list[str] | None:
        """The first match of every pattern (``stage: text``), or None when the strategy is absent."""
        found = []
        for stage, patterns in self.recognize.items():
            text = asm.get(stage)
            if text is None:
                return None
            for p in patterns:
                m = re.search(p, text, re.MULTILINE)
                if not m:
                    return None
                found.append(f"{stage}: {m.group(0)[:80]}")
        for stage, patterns in self.absent.items():
            text = asm.get(stage, "")
            if any(re.search(p, text, re.MULTILINE) for p in patterns):
                return None
        return found

    def present(self, asm: dict[str, str]) -> bool:
        return self.evidence(asm) is not None


@dataclass(frozen=True)
class Taxonomy:
    arch: str
    target: str
    strategies: tuple

    def __getitem__(self, name: str) -> Strategy:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(f"{self.arch} has no strategy {name!r}; it has: {', '.join(self.names)}")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.strategies]

    def found(self, asm: dict[str, str]) -> list[str]:
        """Names of the strategies recognized in one compiled kernel."""
        return [s.name for s in self.strategies if s.present(asm)]


def parse_taxonomy(data: dict, source: str = "<taxonomy>") -> Taxonomy:
    if not isinstance(data, dict) or "arch" not in data or "strategies" not in data:
        raise ValueError(f"{source}: a taxonomy needs 'arch' and 'strategies'")
    out, seen = [], set()
    for i, s in enumerate(data["strategies"]):
        missing = [k for k in REQUIRED if k not in s]
        if missing:
            raise ValueError(f"{source}: strategy #{i} ({s.get('name', '?')}) lacks {', '.join(missing)}")
        if s["name"] in seen:
            raise ValueError(f"{source}: strategy {s['name']!r} listed twice")
        seen.add(s["name"])
        for stage, pats in {**s["recognize"], **s.get("absent", {})}.items():
            if stage not in STAGES:
                raise ValueError(f"{source}: {s['name']}: unknown stage {stage!r} (known: {', '.join(STAGES)})")
            for p in pats:
                re.compile(p)
        out.append(Strategy(s["name"], s["exploits"], s["pays_when"], dict(s["recognize"]), tuple(s["precisions"]),
                            s["test"], dict(s.get("absent", {}))))
    return Taxonomy(data["arch"], str(data.get("target", "")), tuple(out))


@cache
def load_taxonomy(arch: str, root: str | None = None) -> Taxonomy:
    """The taxonomy of ``arch`` (ampere, hopper, blackwell, mi350)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    path = Path(root) if root else taxonomy_dir()
    path = path / f"{arch}.yaml"
    if not path.is_file():
        raise FileNotFoundError(path)
    tax = parse_taxonomy(yaml.safe_load(path.read_text()), str(path))
    if tax.arch != arch:
        raise ValueError(f"{path}: says arch {tax.arch!r}, expected {arch!r}")
    return tax
