"""``llmkit tune``'s engine: load an objective, log every evaluation to JSONL, resume by replay.

An objective spec is ``module:function`` or ``path/to/file.py:function``; the function takes the
parameter values as keyword arguments (a direction on the sphere as one numpy array) and returns a float
to minimize. Resuming: the search is deterministic given its seed and the values it sees, so a rerun with
the same settings replays the logged values in order (the objective is not called for them) and continues
where the log ends; a logged point that differs from the one asked for means different settings.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from pathlib import Path

import numpy as np


def load_objective(spec: str):
    target, sep, fn = spec.rpartition(":")
    if not sep or not target or not fn:
        raise ValueError(f"objective '{spec}' must be module:function or file.py:function")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"objective file not found: {path}")
        s = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    else:
        try:
            mod = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"cannot import objective module '{target}': {e}") from None
    f = getattr(mod, fn, None)
    if not callable(f):
        raise ValueError(f"'{fn}' is not a function in {target}")  # noqa: TRY004 - a bad --objective spec, not a type error
    return f


class EvalLog:
    """Every evaluation appended to ``path`` as JSON; earlier ones replayed in order on resume."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.saved = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    self.saved.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        self.i = 0
        self.replayed = 0

    def __call__(self, f, params: dict) -> float:
        if self.i < len(self.saved):
            rec = self.saved[self.i]
            if not all(np.allclose(np.asarray(rec["params"][k]), np.asarray(v), atol=1e-9) for k, v in params.items()):
                raise ValueError(f"{self.path} evaluation {self.i} was at {rec['params']}, this run asks "
                                 f"{ {k: np.asarray(v).tolist() for k, v in params.items()} }: settings differ; "
                                 "use another --out")
            self.i += 1
            self.replayed += 1
            return float(rec["value"])
        value = float(f(**params))
        with self.path.open("a") as fh:
            fh.write(json.dumps({"i": self.i, "params": {k: np.asarray(v).tolist() for k, v in params.items()},
                                 "value": value, "time": time.time()}) + "\n")
        self.i += 1
        return value
