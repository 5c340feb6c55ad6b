"""Compare saved eval runs: a table of each run's metrics and a grouped bar chart of the primary ones."""

from __future__ import annotations

import json
from pathlib import Path

from llmkit.evals.data import DataError


def load_runs(dirs: list[str | Path]) -> dict[str, dict]:
    runs = {}
    for d in dirs:
        p = Path(d) / "summary.json"
        if not p.is_file():
            raise DataError(f"no summary.json in {d} (is it an `llmkit eval --output` folder?)")
        try:
            name = str(d)
            while name in runs:  # the same folder twice still gets two columns
                name += "'"
            runs[name] = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from None
    return runs


def compare_table(runs: dict[str, dict]) -> list[str]:
    """Markdown rows: one per (task, metric), one column per run."""
    names = list(runs)
    keys = []
    for s in runs.values():
        for task, summ in s.items():
            for m in summ.get("metrics", {}):
                if (task, m) not in keys:
                    keys.append((task, m))
    lines = ["| task | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for task, m in keys:
        cells = []
        for n in names:
            v = runs[n].get(task, {}).get("metrics", {}).get(m)
            cells.append(f"{100 * v:.2f}" if isinstance(v, (int, float)) else "-")
        lines.append(f"| {task} | {m} | " + " | ".join(cells) + " |")
    return lines


def compare_plot(runs: dict[str, dict], path: str | Path) -> Path:
    """Grouped bars: the primary metric of each task, one bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = []
    for s in runs.values():
        tasks += [t for t in s if t not in tasks]
    width = 0.8 / max(1, len(runs))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(tasks) * max(1, len(runs)) / 2), 4))
    for i, (name, s) in enumerate(runs.items()):
        vals = [100 * (s.get(t, {}).get("accuracy") or 0.0) for t in tasks]
        ax.bar([j + i * width for j in range(len(tasks))], vals, width, label=Path(name).name or name)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(tasks))])
    ax.set_xticklabels([f"{t}\n({next((s[t]['primary'] for s in runs.values() if t in s), '')})" for t in tasks])
    ax.set_ylabel("score (%)")
    ax.set_title("llmkit eval compare")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
