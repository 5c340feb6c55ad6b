"""Results pages and the README's results table, generated from bench/results/*.json.

    .venv/bin/python bench/report.py           # write bench/results/<name>.md, bench/results/README.md, README block
    .venv/bin/python bench/report.py --check   # write nothing; exit 1 naming each file that differs from the JSON

Each committed ``bench/results/<name>.json`` gets a page: the command that produced it,
the findings stated from its figures (``report_specs.py`` says which, per bench), every
figure with its interval or spread, the run's settings and the plot when a PNG sits
beside it. ``README.md`` holds a table between ``<!-- results:start -->`` and
``<!-- results:end -->`` built from the same JSON; tests/test_readme_results.py fails
when a page or that block differs from what the JSON gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # appended: bench/select.py must not shadow the stdlib
    sys.path.append(str(Path(__file__).resolve().parent))
from report_specs import SPECS, Spec, fallback_spec

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"
MAX_ROWS = 160  # a page lists at most this many figures; the JSON holds the rest
_POINT_KEYS = ("value", "auroc", "mean", "rate", "accuracy")


def fmt(v) -> str:
    """One figure as text: 4 significant digits, so a rerun that moves a figure changes the page."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    if v is None:
        return "-"
    if isinstance(v, list):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return _clean(str(v))


def _clean(text: str) -> str:
    """Machine paths in recorded settings shown the way a reader of the repository would type them."""
    text = re.sub(r"\S*?/shared/data/", "../shared/data/", text)
    text = re.sub(r"/work/main/", "", text)
    return text.replace("/root/.cache/", "~/.cache/").replace("|", "\\|").replace("\n", " ")


def _interval(d: dict) -> str | None:
    """A dict that is one estimate with its interval or spread, as one cell; None when it is not one."""
    point = next((k for k in _POINT_KEYS if isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool)),
                 None)
    if point is None:
        return None
    if isinstance(d.get("low"), (int, float)) and isinstance(d.get("high"), (int, float)):
        return f"{fmt(d[point])} [{fmt(d['low'])}, {fmt(d['high'])}]"
    ci = d.get(f"{point}_ci95") or d.get("ci95")
    if isinstance(ci, list) and len(ci) == 2:
        return f"{fmt(d[point])} [{fmt(ci[0])}, {fmt(ci[1])}]"
    if isinstance(d.get("std"), (int, float)):
        n = f" (n={d['n']})" if "n" in d else ""
        return f"{fmt(d[point])} ± {fmt(d['std'])}{n}"
    return None


def _is_scalars(v) -> bool:
    return isinstance(v, list) and len(v) <= 8 and all(isinstance(x, (int, float, str)) or x is None for x in v)


def rows(obj, prefix: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """Flatten a JSON section into (figure, value) rows, with `X_ci95` / `X_std` merged into X's cell."""
    if isinstance(obj, dict):
        cell = _interval(obj)
        if cell is not None and prefix:
            return [(prefix, cell)]
    else:
        return [(prefix, fmt(obj))] if (not isinstance(obj, list) or _is_scalars(obj)) else []
    out: list[tuple[str, str]] = []
    for k, v in obj.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        base, _, suffix = str(k).rpartition("_")
        if suffix in ("ci95", "std") and base in obj:
            continue
        if isinstance(v, dict):
            if depth < 3:
                out += rows(v, key, depth + 1)
            continue
        if isinstance(v, str) and len(v) > 160:
            continue
        if isinstance(v, list) and not _is_scalars(v):
            continue
        cell = fmt(v)
        if isinstance(obj.get(f"{k}_ci95"), list) and len(obj[f"{k}_ci95"]) == 2:
            cell += f" [{fmt(obj[f'{k}_ci95'][0])}, {fmt(obj[f'{k}_ci95'][1])}]"
        elif isinstance(obj.get(f"{k}_std"), (int, float)):
            cell += f" ± {fmt(obj[f'{k}_std'])}"
        out.append((key, cell))
    return out


def _table(pairs: list[tuple[str, str]], head: tuple[str, str]) -> list[str]:
    lines = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in pairs[:MAX_ROWS]]
    if len(pairs) > MAX_ROWS:
        lines.append(f"| ... | {len(pairs) - MAX_ROWS} more figures in the JSON |")
    return lines


def render_page(name: str, data: dict, spec: Spec, has_png: bool, load) -> str:
    lines = [f"# {spec.title}", "", "<!-- generated by bench/report.py from this folder's JSON; do not edit -->", "",
             spec.about, "", f"Data: [`{name}.json`]({name}.json). Produced by:", "", "```bash", spec.command, "```", ""]
    findings = spec.findings(data, load) if spec.findings else []
    if findings:
        lines += ["## Findings", ""] + [f"- {f}" for f in findings] + [""]
    if has_png:
        lines += [f"![{name}]({name}.png)", ""]
    sections = spec.sections or (("figures",) if isinstance(data.get("figures"), dict) else
                                 tuple(k for k in data if k not in ("config", "runs")))
    pairs = [r for s in sections if s in data for r in rows(data[s], "" if s == "figures" else s)]
    lines += ["## Figures", ""] + _table(pairs, ("figure", "value")) + [""]
    config = data.get("config")
    if isinstance(config, dict):
        lines += ["## Settings", ""] + _table(rows(config), ("setting", "value")) + [""]
    return "\n".join(lines)


def committed_json(root: Path) -> list[Path]:
    """The results JSON git tracks (a run still being written is not a result yet); every one outside git."""
    res = root / "bench" / "results"
    out = subprocess.run(["git", "ls-files", "--", "bench/results/*.json"], cwd=root, capture_output=True,
                         text=True, check=False) if (root / ".git").exists() else None
    names = out.stdout.split() if out is not None and out.returncode == 0 else None
    if names is None:
        return sorted(res.glob("*.json"))
    return sorted(p for p in (root / n for n in names) if p.parent == res and p.is_file())


def render_all(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file's expected text, keyed by path, computed from the JSON alone."""
    res = root / "bench" / "results"
    cache: dict[str, dict] = {}

    def load(name: str) -> dict | None:
        if name not in cache:
            p = res / f"{name}.json"
            cache[name] = json.loads(p.read_text()) if p.is_file() else None
        return cache[name]

    out: dict[Path, str] = {}
    index = ["# Benchmark results", "", "<!-- generated by bench/report.py; do not edit -->", "",
             "One page per JSON in this folder, generated from it by `python bench/report.py`.", "",
             "| page | what it measures |", "|---|---|"]
    table = ["| benchmark | finding (generated from the JSON) | page |", "|---|---|---|"]
    for p in committed_json(root):
        name, data = p.stem, load(p.stem)
        spec = SPECS.get(name) or fallback_spec(name, data, root)
        if "_quick" in name and "quick" not in spec.title:
            spec = dataclasses.replace(spec, title=f"{spec.title} (quick run)")
        out[res / f"{name}.md"] = render_page(name, data, spec, (res / f"{name}.png").is_file(), load)
        index.append(f"| [{spec.title}]({name}.md) | {spec.about} |")
        if spec.headline:
            table.append(f"| {spec.title} | {spec.headline(data, load)} | [{name}](bench/results/{name}.md) |")
    out[res / "README.md"] = "\n".join(index) + "\n"
    readme = root / "README.md"
    out[readme] = splice(readme.read_text(), "\n".join(table))
    return out


def splice(text: str, block: str) -> str:
    """README text with the generated block between the markers replaced."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"README.md needs exactly one {START} ... {END} pair, in that order")
    head, rest = text.split(START)
    return head + START + "\n" + block + "\n" + END + rest.split(END, 1)[1]


def stale(root: Path = ROOT) -> list[Path]:
    """Generated files whose text on disk differs from what the JSON gives."""
    return [p for p, text in render_all(root).items() if not p.is_file() or p.read_text() != text]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = ap.parse_args()
    if args.check:
        bad = stale()
        for p in bad:
            print(f"stale: {p.relative_to(ROOT)} (run python bench/report.py)")
        return 1 if bad else 0
    for p, text in render_all().items():
        if not p.is_file() or p.read_text() != text:
            p.write_text(text)
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
