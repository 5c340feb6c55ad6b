"""Query perturbation under epsilon-LDP, and randomized response for the scheduler's bit.

Paper: LDPCache (../shared/seeds/004_ead6308da16bc4ed.txt, "LDPCache: cache-enhanced
LDP for multi-query LLM processing"). The abstract leaves the perturbation open
("existing approaches perturb user queries under LDP"); we use the word-piece
**exponential mechanism** of SanText (Yue et al., 2021) with a bounded metric, so
the guarantee is pure epsilon-LDP and not only metric-DP.

Mechanism (``ExponentialTokenMechanism``)
    Public vocabulary V with unit-norm embeddings e_v (all-MiniLM-L6-v2's input
    word-piece table). Distance d(u, v) = ||e_u - e_v|| / 2, a metric with values in
    [0, 1]. Each token x of the query is replaced independently by y ~ P(y | x) ∝
    exp(-eps_tok * d(x, y) / 2).

Privacy argument
    For one token and any inputs x, x' and output y:
        P(y|x) / P(y|x') = exp(eps_tok/2 * (d(x',y) - d(x,y))) * Z(x') / Z(x).
    By the triangle inequality |d(x',y) - d(x,y)| <= d(x,x') <= 1, so the first
    factor is <= exp(eps_tok/2 * d(x,x')), and each term of Z(x') is at most
    exp(eps_tok/2 * d(x,x')) times the matching term of Z(x), so the second factor
    is too. Hence the loss is <= eps_tok * d(x,x') <= eps_tok: eps_tok-LDP per token
    (and eps_tok*d metric-DP). Tokens are perturbed independently, so by sequential
    composition a query of n tokens is released under epsilon = n * eps_tok. That is
    the amount the accountant charges (``query_epsilon``).
    Neighbouring inputs are two queries with the same number of word pieces: like
    every token-level text mechanism (SanText, CusText) this releases the length.

Randomized response (``RandomizedResponse``)
    A bit b is reported truthfully with probability e^eps / (1 + e^eps), flipped
    otherwise: the ratio of the report's probabilities under b and 1-b is exactly
    e^eps, so any bit computed from the private data is released under eps-LDP.

Deviation from the paper: none in the privacy argument we know of; the paper's
own perturbation may differ (the abstract does not say which one). Pure LDP over
a 30k-token vocabulary is costly: the output becomes readable only around
eps_tok ~ 35 (measured: keep-rate 0.56 at 30, 0.98 at 40 on a GSM8K question),
so per-query epsilons are in the hundreds to thousands. The cache's saving is a
ratio and does not depend on that scale.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class Perturbed:
    """One released query: the text the upstream sees and the epsilon it cost."""

    text: str
    epsilon: float
    n_tokens: int


class ExponentialTokenMechanism:
    """SanText-style exponential mechanism over a public word-piece vocabulary (see module docstring)."""

    name = "exponential-token (SanText, bounded metric)"

    def __init__(self, embeddings: np.ndarray, epsilon_per_token: float,
                 tokenize: Callable[[str], list[int]], detokenize: Callable[[list[int]], str]):
        if epsilon_per_token <= 0 or not math.isfinite(epsilon_per_token):
            raise ValueError(f"epsilon_per_token must be a positive number, got {epsilon_per_token}")
        emb = np.asarray(embeddings, dtype=np.float32)
        norms = np.linalg.norm(emb, axis=1, keepdims=True)
        if np.any(norms == 0):
            raise ValueError("vocabulary embeddings must be non-zero")
        self.emb = emb / norms
        self.epsilon_per_token = float(epsilon_per_token)
        self._tokenize = tokenize
        self._detokenize = detokenize

    @property
    def vocab_size(self) -> int:
        return self.emb.shape[0]

    def distances(self, ids: Sequence[int]) -> np.ndarray:
        x = self.emb[np.asarray(ids, dtype=np.int64)]
        # ||a-b||^2 = 2 - 2 a.b for unit vectors; clip guards float error so d stays in [0, 1]
        sq = np.clip(2.0 - 2.0 * (x @ self.emb.T), 0.0, 4.0)
        return np.sqrt(sq) / 2.0

    def log_probabilities(self, ids: Sequence[int]) -> np.ndarray:
        """log P(y | x) for each input id (rows) over the whole vocabulary (columns)."""
        logits = -0.5 * self.epsilon_per_token * self.distances(ids).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    def perturb_ids(self, ids: Sequence[int], rng: np.random.Generator) -> list[int]:
        if len(ids) == 0:
            return []
        logp = self.log_probabilities(ids)
        gumbel = rng.gumbel(size=logp.shape)  # Gumbel-max: argmax(logp + G) ~ softmax(logp)
        return np.argmax(logp + gumbel, axis=1).tolist()

    def tokenize(self, text: str) -> list[int]:
        return self._tokenize(text)

    def query_epsilon(self, text: str) -> float:
        return self.epsilon_per_token * len(self._tokenize(text))

    def perturb(self, text: str, rng: np.random.Generator) -> Perturbed:
        ids = self._tokenize(text)
        out = self.perturb_ids(ids, rng)
        return Perturbed(self._detokenize(out), self.epsilon_per_token * len(ids), len(ids))

    def perturb_many(self, texts: Sequence[str], rng: np.random.Generator) -> tuple[list[str], float]:
        """Perturb several texts (e.g. the user and system messages of one request); epsilon adds up."""
        outs = [self.perturb(t, rng) for t in texts]
        return [o.text for o in outs], sum(o.epsilon for o in outs)

    @classmethod
    def word_level(cls, vocab: Sequence[str], embeddings: np.ndarray,
                   epsilon_per_token: float) -> ExponentialTokenMechanism:
        """A small whitespace-word vocabulary (tests, demos); unknown words map to ``vocab[0]``."""
        index = {w: i for i, w in enumerate(vocab)}

        def tokenize(text: str) -> list[int]:
            return [index.get(w, 0) for w in re.findall(r"[\w.]+|[^\w\s]", text.lower())]

        return cls(embeddings, epsilon_per_token, tokenize, lambda ids: " ".join(vocab[i] for i in ids))

    @classmethod
    def from_minilm(cls, epsilon_per_token: float, path=None) -> ExponentialTokenMechanism:
        """The vocabulary and embeddings of all-MiniLM-L6-v2's word-piece table (29.5k tokens)."""
        emb, domain, tok = _minilm_vocab(str(path) if path else None)
        index = {tid: i for i, tid in enumerate(domain)}
        unk = index[tok.unk_token_id]

        def tokenize(text: str) -> list[int]:
            return [index.get(t, unk) for t in tok(text, add_special_tokens=False)["input_ids"]]

        def detokenize(ids: list[int]) -> str:
            return tok.decode([domain[i] for i in ids], skip_special_tokens=True,
                              clean_up_tokenization_spaces=True)

        return cls(emb, epsilon_per_token, tokenize, detokenize)


@lru_cache(maxsize=1)
def _minilm_vocab(path: str | None):
    from .embedder import _load_minilm, minilm_path

    model, tok = _load_minilm(path or str(minilm_path()))
    table = model.embeddings.word_embeddings.weight.detach().numpy()
    specials = {tok.pad_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id}
    names = tok.convert_ids_to_tokens(list(range(table.shape[0])))
    # [unused*] rows are untrained noise; [UNK] stays so unknown characters have an input
    domain = [i for i, n in enumerate(names) if i not in specials and not n.startswith("[unused")]
    return table[domain], domain, tok


class RandomizedResponse:
    """Warner's randomized response on one bit: eps-LDP for any bit computed from private data."""

    def __init__(self, epsilon: float):
        if epsilon <= 0 or not math.isfinite(epsilon):
            raise ValueError(f"randomized-response epsilon must be a positive number, got {epsilon}")
        self.epsilon = float(epsilon)
        self.p_truth = math.exp(self.epsilon) / (1.0 + math.exp(self.epsilon))

    def release(self, bit: bool, rng: np.random.Generator) -> bool:
        return bool(bit) if rng.random() < self.p_truth else not bool(bit)

    def probability(self, report: bool, bit: bool) -> float:
        return self.p_truth if report == bit else 1.0 - self.p_truth
