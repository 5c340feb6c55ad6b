"""Data sources for ``llmkit train hgms``: parse the ``sources`` config, load each, and build the bench mixture.

* ``parse_sources(spec)``: ``[{name, path, [split, config, limit]}]`` dicts (the YAML form) or
  ``name=path`` strings (the ``--sources`` command-line form) -> ``Source`` objects, names unique.
* ``shuffled_answers(records, seed)``: the same questions with the answers permuted across questions
  (a derangement: no row keeps its own answer). The result reads like GSM8K but teaches nothing about
  solving the question it follows -- a source that should lose weight.
* ``random_word_answers(records, seed)``: the same questions, each answer replaced by as many words
  drawn at random from the pooled words of all answers (same vocabulary, no structure, no arithmetic):
  a corrupted source.
* ``gsm8k_noisy_mixture(gsm8k_train, out_dir, ...)``: disjoint slices of GSM8K train -> a clean source,
  a shuffled-answers source, and a validation (target) file, written as JSONL under ``out_dir``.
  Built at run time from a local GSM8K train file or the hub's ``openai/gsm8k``; nothing is copied into
  the repository.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    split: str = "train"
    config: str | None = None
    limit: int | None = None


def parse_sources(spec) -> list[Source]:
    if not spec:
        raise ValueError("sources: give at least one {name, path} entry")
    out: list[Source] = []
    for i, item in enumerate(spec):
        if isinstance(item, str):
            if "=" not in item:
                raise ValueError(f"sources[{i}]: expected 'name=path', got {item!r}")
            name, path = item.split("=", 1)
            item = {"name": name, "path": path}
        if not isinstance(item, dict) or "path" not in item:
            raise ValueError(f"sources[{i}]: expected a mapping with 'name' and 'path', got {item!r}")
        unknown = set(item) - {"name", "path", "split", "config", "limit"}
        if unknown:
            raise ValueError(f"sources[{i}]: unknown keys {sorted(unknown)} (allowed: name, path, split, config, limit)")
        name = str(item.get("name") or Path(str(item["path"])).stem)
        out.append(Source(name=name, path=str(item["path"]), split=str(item.get("split", "train")),
                          config=item.get("config"), limit=item.get("limit")))
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"sources: duplicate names {dup}")
    return out


def load_sources(sources: list[Source], max_per_source: int | None = None) -> list[list[dict]]:
    from llmkit.train.common import DataError, load_records

    rows = []
    for s in sources:
        limit = min(x for x in (s.limit, max_per_source) if x is not None) if (s.limit or max_per_source) else None
        r = load_records(s.path, s.split, s.config, limit)
        if not r:
            raise DataError(f"source {s.name!r}: no rows in {s.path}")
        rows.append(r)
    return rows


def shuffled_answers(records: list[dict], seed: int = 0, fields: tuple[str, str] = ("question", "answer")) -> list[dict]:
    """Answers permuted across questions with no fixed point (a random cyclic shift of a random order)."""
    q, a = fields
    n = len(records)
    if n < 2:
        raise ValueError("shuffled_answers needs at least two rows")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    shift = random.Random(seed + 1).randrange(1, n)
    src = {order[i]: order[(i + shift) % n] for i in range(n)}
    return [{q: records[i][q], a: records[src[i]][a]} for i in range(n)]


def random_word_answers(records: list[dict], seed: int = 0, fields: tuple[str, str] = ("question", "answer"),
                        words: list[str] | None = None) -> list[dict]:
    """Each answer replaced by the same number of words drawn uniformly from ``words`` (default: all the
    answers' words, so the corrupted source keeps the clean one's vocabulary and loses its structure)."""
    q, a = fields
    pool = list(words) if words is not None else [w for r in records for w in str(r[a]).split()]
    if not pool:
        raise ValueError("random_word_answers: the answers hold no words")
    rng = random.Random(seed)
    return [{q: r[q], a: " ".join(rng.choice(pool) for _ in range(max(len(str(r[a]).split()), 1)))}
            for r in records]


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def gsm8k_noisy_mixture(gsm8k_train: str | Path, out_dir: str | Path, n_clean: int = 256, n_noisy: int = 256,
                        n_target: int = 64, seed: int = 0, corruption: str = "shuffled") -> dict[str, Path]:
    """Clean GSM8K rows, a disjoint slice with corrupted answers (``shuffled`` across questions, or
    ``random_words``), and a disjoint validation slice (the target)."""
    if corruption not in ("shuffled", "random_words"):
        raise ValueError(f"corruption must be 'shuffled' or 'random_words', got {corruption!r}")
    from llmkit.train.common import load_records

    rows = load_records(str(gsm8k_train), "train", "main" if str(gsm8k_train) == "openai/gsm8k" else None)
    need = n_clean + n_noisy + n_target
    if len(rows) < need:
        raise ValueError(f"{gsm8k_train}: {len(rows)} rows, need {need}")
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    pick = [rows[i] for i in idx[:need]]
    clean, noisy, target = pick[:n_clean], pick[n_clean:n_clean + n_noisy], pick[n_clean + n_noisy:]
    out = Path(out_dir)
    return {"gsm8k": write_jsonl(clean, out / "gsm8k_clean.jsonl"),
            "noisy": write_jsonl(shuffled_answers(noisy, seed), out / "gsm8k_shuffled_answers.jsonl")
            if corruption == "shuffled" else write_jsonl(random_word_answers(noisy, seed), out / "gsm8k_random_words.jsonl"),
            "target": write_jsonl(target, out / "gsm8k_validation.jsonl")}
