"""Training prompts and contrastive questions for VSPO runs (GSM8K-style records through ``llmkit.evals``)."""

from __future__ import annotations

import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def resolve_data_path(path: str) -> str:
    """A local path as given, else relative to the repository root; anything else (a hub id) unchanged."""
    p = Path(path).expanduser()
    if p.exists():
        return str(p)
    if not p.is_absolute() and (REPO_ROOT / p).exists():
        return str(REPO_ROOT / p)
    if "/" in path and not path.startswith((".", "/")) and not p.suffix:
        return path  # looks like a hub id (owner/name)
    from llmkit.cli import UserError

    raise UserError(f"no such data file: {path}")


def load_records(path: str, limit: int | None, split: str = "train", task_name: str = "gsm8k",
                 config: str | None = None) -> list[dict]:
    from llmkit.evals.tasks import get_task

    task = get_task(task_name)
    task.split = split
    resolved = resolve_data_path(path)
    if Path(resolved).exists():
        return task.load(resolved, limit=limit)
    task.hub_id = resolved  # a hub id: the task's own hub loader (needs network or a warm cache)
    if config is not None:
        task.hub_config = config
    return task.load(None, limit=limit)


def build_rows(records: list[dict], behavior: str, hint_seed: int = 0, task_name: str = "gsm8k") -> list[dict]:
    """Conversational GRPO rows: ``prompt`` (chat messages), ``answer``, ``question`` and, for the robustness
    behaviour, a misleading ``hint`` injected into the question."""
    from llmkit.evals.tasks import get_task
    from llmkit.rewards.behaviors import get_behavior, inject_hint

    task = get_task(task_name)
    b = get_behavior(behavior)
    rng = random.Random(hint_seed)
    rows = []
    for r in records:
        sample = {k: v for k, v in r.items() if not k.startswith("_")}
        row = {"answer": sample["answer"], "question": sample["question"]}
        if b.needs_hint:
            sample["question"], row["hint"] = inject_hint(sample["question"], task.gold(sample), rng)
        row["prompt"] = task.build_prompt(sample)
        rows.append(row)
    return rows
