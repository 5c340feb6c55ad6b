"""ToolPool's read cache: an unchanged pool is answered without touching its files, and an add from any process
(another ToolPool on the same path stands in for another rank) is seen on the next read."""

from __future__ import annotations

import builtins
import sqlite3
from pathlib import Path

import pytest

from llmkit.tools import ToolPool, ToolSpec

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _spec(body: str) -> ToolSpec:
    return ToolSpec(name="f", parameters=OBJ, code=f"def f(a):\n    return {body}\n", returns="integer")


@pytest.fixture
def no_file_reads(monkeypatch):
    """Within the block, opening, globbing or querying anything fails the test (``stat`` stays allowed)."""

    def refuse(*a, **k):
        raise AssertionError(f"pool read touched its files: {a[:2]}")

    def block():
        monkeypatch.setattr(builtins, "open", refuse)
        monkeypatch.setattr(Path, "glob", refuse)
        monkeypatch.setattr(Path, "read_text", refuse)
        monkeypatch.setattr(sqlite3, "connect", refuse)

    return block


@pytest.mark.parametrize("where", ["pool", "pool.sqlite"])
def test_second_read_is_served_from_the_cache(tmp_path, where, no_file_reads):
    pool = ToolPool(tmp_path / where)
    pool.add(_spec("a"), "gcd", 1.0, step=2)
    pool.add(_spec("a + 0"), "lcm", 0.5, step=3)
    first = (len(pool), pool.best("gcd").spec, [e.id for e in pool.entries()])
    no_file_reads()
    for _ in range(3):  # every read of an unchanged pool: the same answer, no file opened
        assert (len(pool), pool.best("gcd").spec, [e.id for e in pool.entries()]) == first
        assert pool.families() == ["gcd", "lcm"] and pool.best("count_primes") is None


@pytest.mark.parametrize("where", ["pool", "pool.sqlite"])
def test_an_add_from_another_process_invalidates_the_cache(tmp_path, where):
    pool = ToolPool(tmp_path / where)
    other = ToolPool(tmp_path / where)  # another rank's handle on the same pool
    pool.add(_spec("a"), "gcd", 0.5, step=1)
    assert len(pool) == 1 and len(other) == 1  # both caches filled
    other.add(_spec("a + 0"), "gcd", 1.0, step=4)
    assert len(pool) == 2 and pool.best("gcd").step == 4  # seen without reopening the pool
    assert pool.best("gcd", before_step=4).step == 1 and pool.families(before_step=1) == []  # a step's snapshot
    pool.add(_spec("a * 1"), "lcm", 1.0, step=5)  # the writer's own add too
    assert pool.families() == ["gcd", "lcm"] and other.families() == ["gcd", "lcm"]
    assert ToolPool(tmp_path / where).growth() == [(1, 1), (4, 2), (5, 3)]
