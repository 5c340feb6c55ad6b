"""The edge cache: past queries (raw, they never leave the device), their embeddings,
the responses the upstream gave to their perturbed versions, and accuracy estimates.

Persisted in SQLite (WAL, written through on every change) and mirrored in memory
per user for the similarity search. Each user has their own namespace: sharing
entries across users would let one user's private queries steer another user's
(observable) hit/miss pattern. A capacity limit per user is enforced on insert by
an eviction policy (:mod:`.eviction`). A logical clock (queries seen) drives
recency, so behaviour does not depend on wall time. Per user it also keeps the count
and accuracy sum of every entry ever inserted (one per cloud call), for the scheduler's
E[accuracy | cloud call] (:meth:`CacheStore.cloud_accuracy`).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .eviction import EntryView, LRUPolicy

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    user TEXT NOT NULL,
    query TEXT NOT NULL,
    embedding BLOB NOT NULL,
    response TEXT NOT NULL,
    accuracy REAL NOT NULL,
    created INTEGER NOT NULL,
    last_used INTEGER NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_user ON entries(user);
CREATE TABLE IF NOT EXISTS clocks (user TEXT PRIMARY KEY, now INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS cloud_calls (user TEXT PRIMARY KEY, n INTEGER NOT NULL, total REAL NOT NULL);
"""


@dataclass
class Entry:
    id: int
    query: str
    response: str
    accuracy: float
    created: int
    last_used: int
    hits: int


class _UserCache:
    def __init__(self, dim: int):
        self.entries: list[Entry] = []
        self.emb = np.zeros((0, dim), np.float32)
        self.now = 0
        self.calls = 0  # entries ever inserted (= cloud calls cached), evicted ones included
        self.accuracy_total = 0.0  # sum of their accuracy estimates


class CacheStore:
    """Capacity-limited per-user cache with SQLite (WAL) persistence."""

    def __init__(self, path: str | Path = ":memory:", capacity: int = 256, policy=None, dim: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.policy = policy or LRUPolicy()
        self.dim = dim
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._users: dict[str, _UserCache] = {}
        self._lock = threading.RLock()
        self.evictions = 0

    def close(self) -> None:
        self._db.close()

    def _user(self, user: str) -> _UserCache:
        uc = self._users.get(user)
        if uc is not None:
            return uc
        rows = self._db.execute("SELECT id, query, response, accuracy, created, last_used, hits, embedding "
                                "FROM entries WHERE user=? ORDER BY id", (user,)).fetchall()
        dim = self.dim or (len(rows[0][7]) // 4 if rows else 0)
        uc = _UserCache(dim)
        uc.entries = [Entry(*r[:7]) for r in rows]
        if rows:
            uc.emb = np.stack([np.frombuffer(r[7], np.float32) for r in rows])
        row = self._db.execute("SELECT now FROM clocks WHERE user=?", (user,)).fetchone()
        uc.now = row[0] if row else 0
        row = self._db.execute("SELECT n, total FROM cloud_calls WHERE user=?", (user,)).fetchone()
        if row:
            uc.calls, uc.accuracy_total = row
        else:  # a cache written before this table existed: start from the entries it holds
            uc.calls, uc.accuracy_total = len(uc.entries), float(sum(e.accuracy for e in uc.entries))
        self._users[user] = uc
        return uc

    def tick(self, user: str) -> int:
        """Advance the user's logical clock by one query."""
        with self._lock:
            uc = self._user(user)
            uc.now += 1
            self._db.execute("INSERT INTO clocks(user, now) VALUES (?, ?) "
                             "ON CONFLICT(user) DO UPDATE SET now=excluded.now", (user, uc.now))
            return uc.now

    def size(self, user: str) -> int:
        with self._lock:
            return len(self._user(user).entries)

    def entries(self, user: str) -> list[Entry]:
        with self._lock:
            return list(self._user(user).entries)

    def cloud_accuracy(self, user: str) -> float | None:
        """Mean accuracy estimate over every entry ever inserted for the user (None before the first).

        This is the scheduler's E[accuracy | cloud call]. It counts evicted entries too: the
        entries that survive eviction are a selected sample (a policy that keeps accurate
        entries would inflate the mean and so raise the bar for every later hit).
        """
        with self._lock:
            uc = self._user(user)
            return uc.accuracy_total / uc.calls if uc.calls else None

    def nearest(self, user: str, embedding: np.ndarray) -> tuple[Entry | None, float]:
        """The most similar cached entry and its cosine similarity ((None, -1) when empty)."""
        with self._lock:
            uc = self._user(user)
            if not uc.entries:
                return None, -1.0
            sims = uc.emb @ np.asarray(embedding, np.float32)
            i = int(np.argmax(sims))
            return uc.entries[i], float(sims[i])

    def best_for_reuse(self, user: str, embedding: np.ndarray) -> tuple[Entry | None, float]:
        """The entry with the highest expected reuse accuracy (accuracy x similarity), and its similarity.

        With several entries for one topic, the most similar may be a garbled one; the
        best answer to reuse is the one most likely right.
        """
        with self._lock:
            uc = self._user(user)
            if not uc.entries:
                return None, -1.0
            sims = uc.emb @ np.asarray(embedding, np.float32)
            acc = np.array([e.accuracy for e in uc.entries], np.float32)
            i = int(np.argmax(acc * np.maximum(sims, 0.0)))
            return uc.entries[i], float(sims[i])

    def touch(self, user: str, entry_id: int) -> None:
        """A hit: the entry was used now."""
        with self._lock:
            uc = self._user(user)
            for e in uc.entries:
                if e.id == entry_id:
                    e.last_used, e.hits = uc.now, e.hits + 1
                    self._db.execute("UPDATE entries SET last_used=?, hits=? WHERE id=?",
                                     (e.last_used, e.hits, e.id))
                    return
            raise KeyError(entry_id)

    def add(self, user: str, query: str, embedding: np.ndarray, response: str, accuracy: float) -> list[int]:
        """Insert an entry; evict per the policy while over capacity. Returns the evicted ids.

        The insert, the call count and the evictions are one transaction, and memory follows
        only after it commits: a crash or an error midway leaves the cache as it was.
        """
        emb = np.asarray(embedding, np.float32).reshape(-1)
        with self._lock:
            uc = self._user(user)
            calls, total = uc.calls + 1, uc.accuracy_total + float(accuracy)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    "INSERT INTO entries(user, query, embedding, response, accuracy, created, last_used) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", (user, query, emb.tobytes(), response, float(accuracy),
                                                     uc.now, uc.now))
                self._db.execute("INSERT INTO cloud_calls(user, n, total) VALUES (?, ?, ?) "
                                 "ON CONFLICT(user) DO UPDATE SET n=excluded.n, total=excluded.total",
                                 (user, calls, total))
                entries = [*uc.entries, Entry(cur.lastrowid, query, response, float(accuracy), uc.now, uc.now, 0)]
                embs = np.concatenate([uc.emb.reshape(-1, emb.shape[0]), emb[None]], 0)
                evicted = []
                while len(entries) > self.capacity:
                    view = EntryView(embs, np.array([e.accuracy for e in entries]),
                                     np.array([e.last_used for e in entries], float),
                                     np.array([e.created for e in entries], float), uc.now,
                                     np.array([e.hits for e in entries], float))
                    i = self.policy.victim(view, newest=len(entries) - 1)
                    victim = entries.pop(i)
                    embs = np.delete(embs, i, axis=0)
                    self._db.execute("DELETE FROM entries WHERE id=?", (victim.id,))
                    evicted.append(victim.id)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            uc.entries, uc.emb, uc.calls, uc.accuracy_total = entries, embs, calls, total
            self.evictions += len(evicted)
            return evicted
