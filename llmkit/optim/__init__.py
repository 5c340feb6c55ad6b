"""Classical optimization backends from the seed abstracts, one small module per family.

Optimizers (``torch.optim.Optimizer`` subclasses) are importable from here
directly (``llmkit.optim.Muon``); the other families are submodules
(``llmkit.optim.zo``, ``llmkit.optim.bandits`` ...). Everything is imported
lazily so ``import llmkit.optim`` stays cheap and optional dependencies
(torchjd, botorch, cma) load only when their module is used.
"""

from __future__ import annotations

import importlib

# public name -> submodule that defines it
_EXPORTS = {
    "SignSGD": "sign",
    "Lion": "sign",
    "Muon": "muon",
    "MuonLight": "muon",
    "IMuon": "imuon",
    "imuon_lora_param_groups": "imuon",
    "MirrorDescent": "mirror",
    "SemismoothNewton": "ssn",
}

SUBMODULES = ("sign", "muon", "imuon", "mirror", "ssn", "jd", "zo", "bilevel", "bandits", "es", "bo",
              "constrained", "dro", "inverse", "tensor", "matrix", "hf")

__all__ = [*sorted(_EXPORTS), *SUBMODULES]  # noqa: PLE0604 - built from the lazy-import table, all str


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
