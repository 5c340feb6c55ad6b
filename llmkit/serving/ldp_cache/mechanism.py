"""Query perturbation under epsilon-LDP, and randomized response for the scheduler's bit.

Paper: LDPCache (NeurIPS 2026, "LDPCache: cache-enhanced
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
    (and eps_tok*d metric-DP). By sequential composition a query of n tokens is
    released under epsilon = n * eps_tok, the amount the accountant charges
    (``query_epsilon``). Like every token-level text mechanism (SanText, CusText) this
    releases the length; with ``length_bucket=L`` the word pieces are padded (with a
    public filler token, perturbed like the rest) to the next multiple of L, so only the
    bucket is released and the charge is eps_tok x the padded length.

Per-call budget (``perturb(..., epsilon=e)``): a call given a query epsilon e runs at
eps_tok = e / (padded length), so it costs exactly e; at e in single digits that is
close to uniform noise (see :mod:`.sentence` for a mechanism that stays usable there).

Randomized response (``RandomizedResponse``): a bit b is reported truthfully with probability
e^eps / (1 + e^eps), flipped otherwise, so any bit computed from private data is released under eps-LDP.

Deviation from the paper: none in the privacy argument we know of; the paper's own
perturbation may differ (the abstract does not say which one). Pure LDP over a 30k-token
vocabulary is costly: the output becomes readable only at a per-token epsilon in the
tens, so per-query epsilons are in the hundreds to thousands. The cache's saving is a
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
                 tokenize: Callable[[str], list[int]], detokenize: Callable[[list[int]], str],
                 length_bucket: int | None = None, pad_id: int = 0):
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
        if length_bucket is not None and length_bucket < 1:
            raise ValueError(f"length_bucket must be a positive number of tokens, got {length_bucket}")
        if not 0 <= pad_id < emb.shape[0]:
            raise ValueError(f"pad_id {pad_id} is outside the vocabulary (size {emb.shape[0]})")
        self.length_bucket = length_bucket
        self.pad_id = int(pad_id)

    @property
    def vocab_size(self) -> int:
        return self.emb.shape[0]

    def distances(self, ids: Sequence[int]) -> np.ndarray:
        x = self.emb[np.asarray(ids, dtype=np.int64)]
        # ||a-b||^2 = 2 - 2 a.b for unit vectors; clip guards float error so d stays in [0, 1]
        sq = np.clip(2.0 - 2.0 * (x @ self.emb.T), 0.0, 4.0)
        return np.sqrt(sq) / 2.0

    def log_probabilities(self, ids: Sequence[int], epsilon_per_token: float | None = None) -> np.ndarray:
        """log P(y | x) for each input id (rows) over the whole vocabulary (columns)."""
        eps = self.epsilon_per_token if epsilon_per_token is None else epsilon_per_token
        logits = -0.5 * eps * self.distances(ids).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    def perturb_ids(self, ids: Sequence[int], rng: np.random.Generator,
                    epsilon_per_token: float | None = None) -> list[int]:
        if len(ids) == 0:
            return []
        logp = self.log_probabilities(ids, epsilon_per_token)
        gumbel = rng.gumbel(size=logp.shape)  # Gumbel-max: argmax(logp + G) ~ softmax(logp)
        return np.argmax(logp + gumbel, axis=1).tolist()

    def tokenize(self, text: str) -> list[int]:
        """Word-piece ids, padded with ``pad_id`` to the length bucket when one is set."""
        ids = self._tokenize(text)
        if self.length_bucket:
            n = -(-max(len(ids), 1) // self.length_bucket) * self.length_bucket  # next multiple, >= 1 bucket
            ids = ids + [self.pad_id] * (n - len(ids))
        return ids

    def query_epsilon(self, text: str) -> float:
        return self.epsilon_per_token * len(self.tokenize(text))

    def perturb(self, text: str, rng: np.random.Generator, epsilon: float | None = None) -> Perturbed:
        """Release ``text``; with ``epsilon`` the whole query costs that (eps_tok = epsilon / length)."""
        ids = self.tokenize(text)
        if epsilon is None:
            eps_tok, eps = self.epsilon_per_token, self.epsilon_per_token * len(ids)
        else:
            if not (epsilon >= 0 and math.isfinite(epsilon)):
                raise ValueError(f"query epsilon must be a finite number >= 0, got {epsilon}")
            eps_tok, eps = (epsilon / len(ids) if ids else 0.0), float(epsilon)
        out = self.perturb_ids(ids, rng, eps_tok)
        return Perturbed(self._detokenize(out), eps, len(ids))

    def expected_keep_rate(self, text: str, epsilon: float | None = None) -> float:
        """The expected share of word pieces released unchanged (exact, no sampling) at query ``epsilon``."""
        ids = self.tokenize(text)
        if not ids:
            return 1.0
        eps_tok = self.epsilon_per_token if epsilon is None else epsilon / len(ids)
        logp = self.log_probabilities(ids, eps_tok)
        return float(np.mean(np.exp(logp[np.arange(len(ids)), ids])))

    def perturb_many(self, texts: Sequence[str], rng: np.random.Generator) -> tuple[list[str], float]:
        """Perturb several texts (e.g. the user and system messages of one request); epsilon adds up."""
        outs = [self.perturb(t, rng) for t in texts]
        return [o.text for o in outs], sum(o.epsilon for o in outs)

    @classmethod
    def word_level(cls, vocab: Sequence[str], embeddings: np.ndarray,
                   epsilon_per_token: float, **kw) -> ExponentialTokenMechanism:
        """A small whitespace-word vocabulary (tests, demos); unknown words map to ``vocab[0]``."""
        index = {w: i for i, w in enumerate(vocab)}

        def tokenize(text: str) -> list[int]:
            return [index.get(w, 0) for w in re.findall(r"[\w.]+|[^\w\s]", text.lower())]

        return cls(embeddings, epsilon_per_token, tokenize, lambda ids: " ".join(vocab[i] for i in ids), **kw)

    @classmethod
    def from_minilm(cls, epsilon_per_token: float, path=None,
                    length_bucket: int | None = None) -> ExponentialTokenMechanism:
        """The vocabulary and embeddings of all-MiniLM-L6-v2's word-piece table (29.5k tokens).

        With ``length_bucket`` the filler is the word piece ".".
        """
        emb, domain, tok = _minilm_vocab(str(path) if path else None)
        index = {tid: i for i, tid in enumerate(domain)}
        unk = index[tok.unk_token_id]

        def tokenize(text: str) -> list[int]:
            return [index.get(t, unk) for t in tok(text, add_special_tokens=False)["input_ids"]]

        def detokenize(ids: list[int]) -> str:
            return tok.decode([domain[i] for i in ids], skip_special_tokens=True,
                              clean_up_tokenization_spaces=True)

        pad = index[tok.convert_tokens_to_ids(".")]
        return cls(emb, epsilon_per_token, tokenize, detokenize, length_bucket=length_bucket, pad_id=pad)


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
