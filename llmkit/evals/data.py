"""Loading eval records from a local JSONL/JSON file or folder, or from the Hugging Face hub.

Every record keeps where it came from (``_source`` = "file:line" or "file:item N")
so that a missing field can be reported against the exact line of the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from llmkit.cli import UserError
from llmkit.data import GSM8K_SAMPLE


class DataError(UserError):
    """Bad eval data: the message names the file and the line (or JSON item)."""


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            rec["_source"] = f"{path}:{lineno}"
            rows.append(rec)
    return rows


def _read_json(path: Path) -> list[dict]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
    if isinstance(obj, dict):  # {"data": [...]} or {"rows": [...]}, the two common wrappers
        for key in ("data", "rows", "examples"):
            if isinstance(obj.get(key), list):
                obj = obj[key]
                break
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a JSON list of records (or JSONL)")
    rows = []
    for i, rec in enumerate(obj):
        if not isinstance(rec, dict):
            raise DataError(f"{path}: item {i}: expected a JSON object, got {type(rec).__name__}")
        rows.append({**rec, "_source": f"{path}:item {i}"})
    return rows


def read_records(path: str | Path, split: str = "test") -> list[dict]:
    """Records from a .jsonl/.json file, or from a folder (``<split>.jsonl``/``.json`` if present, else every file)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"no such data file or folder: {path}")
    if path.is_dir():
        for ext in (".jsonl", ".json"):
            if (path / f"{split}{ext}").is_file():
                return read_records(path / f"{split}{ext}")
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json") and p.is_file())
        if not files:
            raise DataError(f"{path}: folder holds no .jsonl or .json file")
        return [r for p in files for r in read_records(p)]
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".json":
        return _read_json(path)
    # unknown suffix: sniff the first character
    head = path.read_text(encoding="utf-8")[:1]
    return _read_json(path) if head == "[" else _read_jsonl(path)


def load_hub(hub_id: str, config: str | None, split: str) -> list[dict]:
    """Rows of a hub dataset via ``datasets`` (needs network or a warm cache)."""
    try:
        import datasets

        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # noqa: BLE001 -- offline, missing cache, wrong id: all end the same way for a user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"could not load hub dataset '{hub_id}'{f' ({config})' if config else ''} split '{split}': "
            f"{first[:200]} -- offline? pass a local file or folder with --data (a GSM8K sample ships "
            f"with llmkit: {GSM8K_SAMPLE})"
        ) from None
    return [{**dict(r), "_source": f"{hub_id}:{split}:{i}"} for i, r in enumerate(ds)]


# "owner/name": what the hub accepts as a dataset id (no file suffix, no leading ./ or /)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(source: str | Path) -> bool:
    """Whether ``source`` names a hub dataset rather than a local file: ``owner/name``, not an existing path."""
    s = str(source)
    return (isinstance(source, str) and _HUB_ID.fullmatch(s) is not None and not Path(s).exists()
            and Path(s).suffix not in (".jsonl", ".json", ".txt"))


def load_source(source: str | Path, split: str = "test", config: str | None = None) -> list[dict]:
    """Records from a local file or folder (see :func:`read_records`) or a hub dataset id (``owner/name``).

    The one entry point for "hub id or local path": a path that exists is read in place; an ``owner/name``
    string that is not a local path goes to ``datasets`` (``config``, ``split``); anything else is a
    :class:`DataError` naming it.
    """
    if is_hub_id(source):
        return load_hub(str(source), config, split)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"no such data file or folder: {path} (nor a hub dataset id 'owner/name')")
    return read_records(path, split)


def require(rec: dict, *fields: str) -> None:
    """Raise a DataError naming the record's file and line if a field is missing or empty."""
    for f in fields:
        if rec.get(f) in (None, ""):
            raise DataError(f"{rec.get('_source', '<record>')}: missing field '{f}'")
