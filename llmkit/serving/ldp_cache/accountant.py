"""Per-user privacy accountant with a crash-safe SQLite (WAL) ledger.

Composition: every release (a perturbed query sent upstream, a randomized-response
scheduler bit) is pure eps_i-LDP, so by sequential composition a user's total loss
is sum(eps_i). Which mechanisms run is chosen adaptively from already-released
outputs only (the randomized bit, never the private one), and for pure DP the
basic-composition privacy filter of Rogers et al. (2016) keeps the total within
the budget under such adaptive choices as long as each charge is checked first.

Crash safety: the charge is written (``reserve``) and committed *before* anything
leaves the device; the caller later ``settle``s it to the amount actually used
(<= reserved) or, only when provably nothing was released, ``release``s it. A
crash between the two leaves the reservation in place, and reservations count as
spent: the ledger can over-count after a crash, never under-count. The budget
check and the insert run in one ``BEGIN IMMEDIATE`` transaction, so concurrent
processes cannot both pass the check. Amounts are stored as integer
micro-epsilons, rounded up (budgets rounded down), so comparisons are exact.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_UNIT = 1_000_000  # micro-epsilon


def _up(eps: float) -> int:
    return math.ceil(eps * _UNIT - 1e-6)  # the 1e-6 absorbs float noise like 2.0000000000000004


def _down(eps: float) -> int:
    return math.floor(eps * _UNIT + 1e-6)


class BudgetExceeded(Exception):
    """The next query could exceed the user's privacy budget; nothing was released."""

    def __init__(self, user: str, budget: float, spent: float, needed: float):
        self.user, self.budget, self.spent, self.needed = user, budget, spent, needed
        super().__init__(
            f"privacy budget would be exceeded for user '{user}': spent {spent:.6g} of epsilon {budget:.6g}, "
            f"the next query needs up to {needed:.6g} (remaining {max(budget - spent, 0.0):.6g})")


@dataclass(frozen=True)
class Reservation:
    id: int
    user: str
    amount: float


_SCHEMA = """
CREATE TABLE IF NOT EXISTS budgets (user TEXT PRIMARY KEY, budget_micro INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS charges (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    user TEXT NOT NULL,
    micro INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('reserved', 'spent', 'released')),
    purpose TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS charges_user ON charges(user, state);
"""


class PrivacyLedger:
    """Budgets and charges per user; safe across processes and crashes (see module docstring)."""

    def __init__(self, path: str | Path, default_budget: float):
        if not (default_budget >= 0 and math.isfinite(default_budget)):
            raise ValueError(f"budget must be a finite number >= 0, got {default_budget}")
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.default_budget = float(default_budget)
        # ":memory:" (tests, benchmarks) has one shared connection, so it is serialized by a lock
        self._mem = (sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
                     if self.path == ":memory:" else None)
        self._mem_lock = threading.RLock()
        with self._conn() as c:
            c.execute("PRAGMA journal_mode=WAL")
            c.executescript(_SCHEMA)

    @contextmanager
    def _conn(self):
        # a fresh connection per operation: no state survives a crash except what was committed
        if self._mem is not None:
            with self._mem_lock:
                yield self._mem
            return
        c = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        try:
            c.execute("PRAGMA synchronous=FULL")  # a committed reservation survives power loss too
            yield c
        finally:
            c.close()

    def _fault(self, stage: str) -> None:
        """Fault-injection point for crash tests (a no-op in normal use)."""

    def _budget_micro(self, c, user: str) -> int:
        row = c.execute("SELECT budget_micro FROM budgets WHERE user=?", (user,)).fetchone()
        return row[0] if row else _down(self.default_budget)

    @staticmethod
    def _used_micro(c, user: str) -> int:
        row = c.execute("SELECT COALESCE(SUM(micro), 0) FROM charges WHERE user=? AND state != 'released'",
                        (user,)).fetchone()
        return int(row[0])

    def set_budget(self, user: str, budget: float) -> None:
        if not (budget >= 0 and math.isfinite(budget)):
            raise ValueError(f"budget must be a finite number >= 0, got {budget}")
        with self._conn() as c:
            c.execute("INSERT INTO budgets(user, budget_micro) VALUES (?, ?) "
                      "ON CONFLICT(user) DO UPDATE SET budget_micro=excluded.budget_micro", (user, _down(budget)))

    def budget(self, user: str) -> float:
        with self._conn() as c:
            return self._budget_micro(c, user) / _UNIT

    def spent(self, user: str) -> float:
        """Spent plus reserved: what a crash right now would leave on the books."""
        with self._conn() as c:
            return self._used_micro(c, user) / _UNIT

    def remaining(self, user: str) -> float:
        with self._conn() as c:
            return max(self._budget_micro(c, user) - self._used_micro(c, user), 0) / _UNIT

    def reserve(self, user: str, amount: float, purpose: str = "") -> Reservation:
        """Write the charge before the release; raises BudgetExceeded (writing nothing) if it does not fit."""
        if not (amount >= 0 and math.isfinite(amount)):
            raise ValueError(f"charge must be a finite number >= 0, got {amount}")
        micro = _up(amount)
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")
            try:
                budget, used = self._budget_micro(c, user), self._used_micro(c, user)
                if used + micro > budget:
                    raise BudgetExceeded(user, budget / _UNIT, used / _UNIT, micro / _UNIT)
                cur = c.execute("INSERT INTO charges(user, micro, state, purpose, created) "
                                "VALUES (?, ?, 'reserved', ?, ?)", (user, micro, purpose, time.time()))
                self._fault("reserve:before-commit")
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return Reservation(cur.lastrowid, user, micro / _UNIT)

    def settle(self, res: Reservation, actual: float | None = None) -> float:
        """Mark a reservation spent, shrunk to ``actual``; growing it is refused (it could pass the budget)."""
        micro = _up(res.amount if actual is None else actual)
        if micro > _up(res.amount):
            raise ValueError(f"cannot settle {actual} against a reservation of {res.amount}: reserve more first")
        with self._conn() as c:
            c.execute("UPDATE charges SET state='spent', micro=? WHERE id=? AND state='reserved'", (micro, res.id))
        return micro / _UNIT

    def release(self, res: Reservation) -> None:
        """Cancel a reservation: only when nothing depending on the private data left the device."""
        with self._conn() as c:
            c.execute("UPDATE charges SET state='released' WHERE id=? AND state='reserved'", (res.id,))

    def history(self, user: str) -> list[tuple[int, float, str, str]]:
        with self._conn() as c:
            rows = c.execute("SELECT id, micro, state, purpose FROM charges WHERE user=? ORDER BY id",
                             (user,)).fetchall()
        return [(i, m / _UNIT, s, p) for i, m, s, p in rows]
