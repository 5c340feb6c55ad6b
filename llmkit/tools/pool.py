"""The tool pool: verified tools with provenance, in a folder (one JSON file per tool) or a SQLite file.

``ToolPool("runs/x/pool")`` keeps ``<family>/<name>-<fingerprint>.json``; ``ToolPool("pool.sqlite")`` (a path
ending in ``.sqlite``/``.db``) keeps one table. Each entry holds the :class:`~llmkit.tools.spec.ToolSpec` and its
provenance: ``family``, ``score`` (verification accuracy on fresh instances), ``step`` (training step; -1 outside
training), ``source`` (who wrote it: a model name, ``policy``, ``reference``), ``created`` (unix time). Adding
the same tool (same fingerprint) for a family twice keeps the better score. ``best(family)`` is the highest score,
ties broken by the earliest step.

Reads are cached. Every ``add`` appends one line to the pool's journal (``<folder>/journal.log``, or
``<file>.log`` beside a SQLite pool) after the tool is stored, so the journal's size grows with every add, from any
process: a read first stats the journal and reloads (glob + JSON, or one query) only when its size differs from the
cached one. Ranks of one run that share the pool folder each see the others' tools on their next read, and a read
of an unchanged pool costs one ``stat``. Tools dropped into the folder by hand, without ``add``, are seen after the
next ``add`` (or by a new ``ToolPool``).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from llmkit.tools.spec import ToolSpec


@dataclass
class PoolEntry:
    spec: ToolSpec
    family: str
    score: float
    step: int = -1
    source: str = ""
    created: float = 0.0

    @property
    def id(self) -> str:
        return f"{self.family}/{self.spec.name}-{self.spec.fingerprint()}"

    def to_dict(self) -> dict:
        return {"tool": self.spec.to_dict(), "family": self.family, "score": self.score, "step": self.step,
                "source": self.source, "created": self.created}

    @classmethod
    def from_dict(cls, d: dict) -> PoolEntry:
        return cls(ToolSpec.from_dict(d["tool"]), d["family"], float(d["score"]), int(d.get("step", -1)),
                   str(d.get("source", "")), float(d.get("created", 0.0)))


class ToolPool:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.sqlite = self.path.suffix in (".sqlite", ".db")
        self.journal = self.path.with_name(self.path.name + ".log") if self.sqlite else self.path / "journal.log"
        self._cached: tuple[int, list[PoolEntry], dict[str, PoolEntry]] | None = None
        if self.sqlite:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._db() as db:
                db.execute("CREATE TABLE IF NOT EXISTS tools (id TEXT PRIMARY KEY, family TEXT, score REAL, "
                           "step INTEGER, source TEXT, created REAL, tool TEXT)")
        else:
            self.path.mkdir(parents=True, exist_ok=True)

    def _db(self):
        return sqlite3.connect(self.path)

    # ------------------------------------------------------------------ write
    def add(self, spec: ToolSpec, family: str, score: float, *, step: int = -1, source: str = "") -> PoolEntry:
        entry = PoolEntry(spec, family, float(score), int(step), source, time.time())
        old = self.get(entry.id)
        if old is not None and old.score >= entry.score:
            return old
        if self.sqlite:
            with self._db() as db:
                db.execute("INSERT OR REPLACE INTO tools VALUES (?,?,?,?,?,?,?)",
                           (entry.id, family, entry.score, entry.step, source, entry.created,
                            json.dumps(spec.to_dict())))
        else:
            f = self.path / f"{entry.id}.json"
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_suffix(f".{os.getpid()}.tmp")  # per process: ranks of one run may add the same tool
            tmp.write_text(json.dumps(entry.to_dict(), indent=1))
            tmp.replace(f)
        # after the tool is stored, so a reader that sees the longer journal also sees the tool; O_APPEND keeps
        # concurrent one-line appends of several ranks whole
        with open(self.journal, "a") as j:
            j.write(f"{entry.id} {entry.score} {entry.step}\n")
        self._cached = None
        return entry

    # ------------------------------------------------------------------ read
    def _journal_size(self) -> int:
        try:
            return self.journal.stat().st_size
        except FileNotFoundError:
            return -1

    def _load(self) -> tuple[list[PoolEntry], dict[str, PoolEntry]]:
        size = self._journal_size()
        if self._cached is None or self._cached[0] != size:
            es = self._read()
            self._cached = (size, es, {e.id: e for e in es})
        return self._cached[1], self._cached[2]

    def get(self, entry_id: str) -> PoolEntry | None:
        return self._load()[1].get(entry_id)

    def entries(self, family: str | None = None) -> list[PoolEntry]:
        es = self._load()[0]
        return [e for e in es if e.family == family] if family is not None else list(es)

    def _read(self) -> list[PoolEntry]:
        out = []
        if self.sqlite:
            with self._db() as db:
                rows = db.execute("SELECT family, score, step, source, created, tool FROM tools").fetchall()
            for fam, score, step, source, created, tool in rows:
                out.append(PoolEntry(ToolSpec.from_dict(json.loads(tool)), fam, score, step, source, created))
        else:
            for f in sorted(self.path.glob("*/*.json")):
                try:
                    out.append(PoolEntry.from_dict(json.loads(f.read_text())))
                except (json.JSONDecodeError, KeyError, ValueError):
                    continue  # a partial or foreign file; never fatal
        return sorted(out, key=lambda e: (e.family, -e.score, e.step, e.created))

    def best(self, family: str, before_step: int | None = None) -> PoolEntry | None:
        """The best entry for ``family``; with ``before_step``, among those added before that training step only
        (the pool as every rank saw it when the step began, whatever other ranks add meanwhile)."""
        es = [e for e in self.entries(family) if before_step is None or e.step < before_step]
        return es[0] if es else None

    def families(self, before_step: int | None = None) -> list[str]:
        return sorted({e.family for e in self.entries() if before_step is None or e.step < before_step})

    def __len__(self) -> int:
        return len(self.entries())

    def growth(self) -> list[tuple[int, int]]:
        """(step, pool size after that step) for every step where a tool was added."""
        steps = sorted(e.step for e in self.entries())
        return [(s, i + 1) for i, s in enumerate(steps)]
