"""A sentence-level LDP mechanism that stays usable at single-digit epsilon: release a public candidate.

Paper: LDPCache (cache-enhanced LDP for multi-query LLM processing, NeurIPS 2026). The abstract leaves the query
perturbation open; the token mechanism (:mod:`.mechanism`) needs eps ~ 35 per word piece
(~1,000 per query) before the perturbed text is readable. At a per-query epsilon in single
digits that mechanism sends noise. This one spends the whole query epsilon on one choice.

Mechanism (``CandidateMechanism``)
    A public list of k candidate queries C (a question bank the user's device holds; nothing
    in it is private). On the device the raw query x is embedded and S(x) is the set of the m
    candidates nearest to it (cosine, ``top_m``, default 1; ties broken by index). The device
    releases one candidate y with

        P(y | x) = e^eps / (m e^eps + k - m)   if y in S(x),
                   1     / (m e^eps + k - m)   otherwise,

    and sends y upstream in place of x ("decoding a candidate"). With m = 1 this is k-ary
    randomized response on the nearest candidate; it is the exponential mechanism with the
    0/1 utility u(x, y) = [y in S(x)], whose normalizer m e^eps + k - m is the same for every
    x, so the usual factor 1/2 is not needed.

Privacy argument
    For any two queries x, x' (of any length and wording) and any output y the denominators
    are equal, so P(y|x) / P(y|x') is e^eps, 1 or e^-eps: the release is eps-LDP for the whole
    query, with every pair of queries neighbours. The output is a public string, so nothing
    about the query's length or wording leaks beyond the choice itself. Sequential composition
    over queries as usual; the accountant charges eps per release.

Utility
    P(y in S(x)) = m e^eps / (m e^eps + k - m): with k = 120 candidates and m = 1 that is 0.06
    at eps 2, 0.31 at eps 4, 0.77 at eps 6, 0.96 at eps 8. It is useful only where the bank
    covers the user's queries (the nearest candidate asks the same thing); a query with no
    close candidate is answered for the wrong question whatever eps is. Embedding-noise
    mechanisms (perturb emb(x), decode the nearest candidate) need noise calibrated to the
    embedding space's diameter and at single-digit eps decode almost uniformly; graded
    utilities (cosine) in the exponential mechanism lose the factor 1/2 and, since unrelated
    questions already have cosine ~0.3 under MiniLM, spread the mass over the whole bank.
    Deviation: the paper's own mechanism is not given in the abstract; this is ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .mechanism import Perturbed


class CandidateMechanism:
    """Release one public candidate query: k-ary randomized response on the nearest (module docstring)."""

    name = "candidate (nearest public query, k-ary randomized response)"

    def __init__(self, candidates: Sequence[str], embedder: Callable, epsilon: float = 6.0, top_m: int = 1):
        cands = list(candidates)
        if len(cands) < 2:
            raise ValueError(f"the candidate bank needs at least 2 public queries, got {len(cands)}")
        if len(set(cands)) != len(cands):
            raise ValueError("the candidate bank has duplicate entries")
        if not 1 <= top_m < len(cands):
            raise ValueError(f"top_m must be in [1, {len(cands) - 1}], got {top_m}")
        self._check(epsilon)
        self.candidates = cands
        self.embedder = embedder
        self.epsilon = float(epsilon)
        self.top_m = int(top_m)
        self.emb = np.asarray(embedder(cands), np.float32)

    @staticmethod
    def _check(eps) -> None:
        if not (eps >= 0 and math.isfinite(eps)):
            raise ValueError(f"epsilon must be a finite number >= 0, got {eps}")

    @property
    def k(self) -> int:
        return len(self.candidates)

    def nearest(self, text: str) -> np.ndarray:
        """Indices of S(x), the top_m candidates nearest to ``text`` (computed on the device)."""
        sims = self.emb @ np.asarray(self.embedder([text])[0], np.float32)
        order = np.lexsort((np.arange(self.k), -sims))  # most similar first, ties by index
        return order[: self.top_m]

    def probabilities(self, text: str, epsilon: float | None = None) -> np.ndarray:
        """P(y | text) over the candidates."""
        eps = self.epsilon if epsilon is None else epsilon
        self._check(eps)
        w = np.ones(self.k)
        w[self.nearest(text)] = math.exp(eps)
        return w / w.sum()

    def query_epsilon(self, text: str) -> float:
        return self.epsilon

    def perturb(self, text: str, rng: np.random.Generator, epsilon: float | None = None) -> Perturbed:
        eps = self.epsilon if epsilon is None else float(epsilon)
        p = self.probabilities(text, eps)
        return Perturbed(self.candidates[int(rng.choice(self.k, p=p))], eps, 0)

    def perturb_many(self, texts: Sequence[str], rng: np.random.Generator) -> tuple[list[str], float]:
        outs = [self.perturb(t, rng) for t in texts]
        return [o.text for o in outs], sum(o.epsilon for o in outs)
