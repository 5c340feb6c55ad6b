"""``LDPCache``: ask a query, get an answer, the epsilon it cost, and whether the cache answered.

One query, in order (see :mod:`.scheduler` for why each step is private):
  1. reserve the worst case (query epsilon + scheduler bit) in the ledger, or refuse;
     the refusal depends only on public facts (budget, spent, and the query length, which
     the token mechanism releases anyway: only its bucket with ``length_bucket``; with a
     fixed ``epsilon=`` the length plays no part);
  2. embed the raw query, pick the cached entry with the best expected reuse accuracy
     (accuracy x similarity), release the randomized hit/miss bit;
  3. hit: answer with the cached response, settle the charge to the bit's epsilon;
     miss: perturb every non-assistant message (assistant turns: see below) with the
     mechanism, send that upstream, settle to bit + query epsilon, cache (raw query,
     response, fidelity).
A failure before anything reached the upstream refunds the query part; any other
failure keeps the whole reservation (the upstream may have seen the query).

What leaves the device:
  - assistant turns (answers to private queries, which often restate them): none with
    ``assistant_turns="drop"`` (the default); ``"perturb"`` perturbs them like user text
    (charged like it, and part of the cache key, since they then shape the answer);
  - length: the token mechanism releases the number of word pieces, or only its bucket with
    ``length_bucket`` (:mod:`.mechanism`); the candidate mechanism (:mod:`.sentence`) releases a
    public string and no length;
  - the hit/miss pattern is the scheduler's randomized-response bit, charged per query; the
    message count is public (dropped assistant turns are not counted);
  - nothing else: a sent message is ``{"role", "content"}`` (``name``, ``tool_calls``,
    ``tool_call_id`` and any other key stay on the device: private text the mechanism never saw),
    and only the request fields in ``UPSTREAM_PARAMS`` go upstream (the model name and sampling
    numbers, type-checked so that no text rides in them); ``stop`` strings, tools, response
    formats and logit biases are refused here (the proxy drops them and says so);
  - a sentence-level mechanism (one that releases a public candidate, :mod:`.sentence`) releases
    the whole conversation once: one user message, the candidate nearest to all the perturbed
    messages together, charged one query epsilon (message by message, a system prompt would be
    replaced by a random question of the bank and charged a second time).
``epsilon=`` on :meth:`LDPCache.ask_messages` fixes the query part of a cloud call in
advance (split evenly over the perturbed messages): the fixed-budget allocation of
:mod:`.budget` decides it from public facts before each query.

``PerQueryLDP`` is the no-cache baseline: every query perturbed and sent.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .accountant import PrivacyLedger
from .mechanism import ExponentialTokenMechanism
from .scheduler import LDPScheduler
from .store import CacheStore
from .upstream import UpstreamError

PRIVATE_ROLES = ("system", "developer", "user", "tool")
ASSISTANT_TURNS = ("drop", "perturb")
# the request fields that may go upstream, and the type each must have: numbers that steer
# sampling carry no user text; ``model`` is a name the proxy checks against the upstream's list
SAMPLING_PARAMS = {"max_tokens": int, "max_completion_tokens": int, "seed": int, "temperature": float,
                   "top_p": float, "presence_penalty": float, "frequency_penalty": float}
UPSTREAM_PARAMS = ("model", *SAMPLING_PARAMS)


@dataclass(frozen=True)
class Answer:
    text: str
    cache_hit: bool
    epsilon: float  # charged for this query
    spent: float  # the user's total so far
    remaining: float
    similarity: float  # to the cached query considered for reuse (-1: cache was empty)
    sent_messages: list | None  # what the upstream saw; None on a hit
    raw: dict | None = None  # the upstream's chat.completion on a miss


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text":
                raise ValueError("only text content parts are supported by the LDP cache")
            parts.append(p.get("text", ""))
        return "\n".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _seq(seed) -> np.random.SeedSequence:
    if seed is None:
        return np.random.SeedSequence()  # OS entropy: the normal, private case
    return np.random.SeedSequence(list(seed) if isinstance(seed, (list, tuple)) else [int(seed)])


def _rngs(seed, bit_seed=None) -> tuple[np.random.Generator, np.random.Generator]:
    # separate streams for the perturbation and the bit, so a benchmark can couple perturbations
    # across runs (same seed -> same perturbed text) while varying the bits (bit_seed)
    a, b = _seq(seed).spawn(2)
    if bit_seed is not None:
        b = _seq(bit_seed)
    return np.random.default_rng(a), np.random.default_rng(b)


def check_params(params: dict) -> dict:
    """``params`` if every field may go upstream (``UPSTREAM_PARAMS``, right types), else ValueError."""
    for k, v in params.items():
        if k not in UPSTREAM_PARAMS:
            raise ValueError(f"request field {k!r} is not sent upstream by the LDP cache (it could carry text "
                             f"outside the privacy guarantee); allowed: {', '.join(UPSTREAM_PARAMS)}")
        if k == "model":
            ok = isinstance(v, str) and bool(v)
        elif SAMPLING_PARAMS[k] is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok:
            want = "a model name" if k == "model" else f"a{'n integer' if SAMPLING_PARAMS[k] is int else ' number'}"
            raise ValueError(f"request field {k!r} must be {want}, got {v!r}")
    return params


def _whole_query(mechanism) -> bool:
    """Whether ``mechanism`` releases one public string for a whole query (see module docstring)."""
    from .sentence import CandidateMechanism

    return isinstance(mechanism, CandidateMechanism)


def _private_parts(messages: list[dict], assistant_turns: str = "drop") -> list[int]:
    """Indices of the messages that are sent (perturbed); every other message is dropped."""
    if assistant_turns not in ASSISTANT_TURNS:
        raise ValueError(f"assistant_turns must be one of {', '.join(ASSISTANT_TURNS)}, got {assistant_turns!r}")
    if not messages:
        raise ValueError("messages is empty")
    roles = PRIVATE_ROLES + (("assistant",) if assistant_turns == "perturb" else ())
    idx = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] needs a 'role'")
        if m["role"] in roles:
            idx.append(i)
    if not any(messages[i]["role"] in PRIVATE_ROLES for i in idx):
        raise ValueError("no user or system message to answer")
    return idx


def _perturbed(mechanism, messages: list[dict], idx: list[int], rng,
               epsilon: float | None = None) -> tuple[list[dict], float, str]:
    """The messages that go upstream: ``idx`` perturbed, in order, role and content only."""
    if _whole_query(mechanism):
        p = mechanism.perturb("\n".join(_text(messages[i].get("content")) for i in idx), rng, epsilon=epsilon)
        return [{"role": "user", "content": p.text}], p.epsilon, p.text
    out = []
    eps = 0.0
    texts = []
    for i in idx:
        text = _text(messages[i].get("content"))
        p = (mechanism.perturb(text, rng) if epsilon is None
             else mechanism.perturb(text, rng, epsilon=epsilon / len(idx)))
        out.append({"role": messages[i]["role"], "content": p.text})
        eps += p.epsilon
        texts.append(p.text)
    return out, eps, "\n".join(texts)


class LDPCache:
    """A privacy cache in front of an OpenAI-compatible upstream (see module docstring)."""

    def __init__(self, upstream: Callable, ledger: PrivacyLedger, store: CacheStore,
                 mechanism: ExponentialTokenMechanism, embedder: Callable, scheduler=None,
                 default_user: str = "default", assistant_turns: str = "drop"):
        _private_parts([{"role": "user"}], assistant_turns)  # validates the option
        self.upstream = upstream
        self.ledger = ledger
        self.store = store
        self.mechanism = mechanism
        self.embedder = embedder
        self.scheduler = scheduler or LDPScheduler()
        self.default_user = default_user
        self.assistant_turns = assistant_turns
        self._lock = threading.Lock()

    @classmethod
    def open(cls, upstream: str | Callable, budget: float, state_dir: str | Path, *,
             question_bank: list[str] | None = None, query_epsilon: float = 6.0,
             epsilon_per_token: float | None = None, rr_epsilon: float = 3.0, sim_threshold: float = 0.8,
             gain_threshold: float = 0.1, capacity: int = 256, eviction: str = "multifactor",
             model: str | None = None, api_key: str | None = None, embedder=None, mechanism=None,
             assistant_turns: str = "drop", length_bucket: int | None = None):
        """Everything persisted under ``state_dir`` (ledger.sqlite, cache.sqlite).

        The mechanism must be chosen, there is no default: ``question_bank`` (public questions)
        gives the sentence-level mechanism at ``query_epsilon`` per query, ``epsilon_per_token`` the
        token mechanism (a query of n word pieces costs n times it), or pass ``mechanism``.
        """
        from .embedder import MiniLMEmbedder
        from .eviction import make_policy
        from .sentence import CandidateMechanism
        from .upstream import OpenAIUpstream

        chosen = sum(x is not None for x in (question_bank, epsilon_per_token, mechanism))
        if chosen != 1:
            raise ValueError("choose exactly one privacy mechanism: question_bank= (sentence-level, "
                             "query_epsilon per query), epsilon_per_token= (token-level) or mechanism=")
        if length_bucket is not None and epsilon_per_token is None:
            raise ValueError("length_bucket applies to the token mechanism (epsilon_per_token=) only")
        state = Path(state_dir)
        state.mkdir(parents=True, exist_ok=True)
        embedder = embedder or MiniLMEmbedder()
        if question_bank is not None:
            mechanism = CandidateMechanism(question_bank, embedder, query_epsilon)
        elif epsilon_per_token is not None:
            mechanism = ExponentialTokenMechanism.from_minilm(epsilon_per_token, length_bucket=length_bucket)
        up = OpenAIUpstream(upstream, model=model, api_key=api_key) if isinstance(upstream, str) else upstream
        return cls(up, PrivacyLedger(state / "ledger.sqlite", budget),
                   CacheStore(state / "cache.sqlite", capacity=capacity, policy=make_policy(eviction)),
                   mechanism, embedder,
                   LDPScheduler(rr_epsilon, sim_threshold, gain_threshold), assistant_turns=assistant_turns)

    def worst_case_epsilon(self, messages: list[dict], epsilon: float | None = None) -> float:
        idx = _private_parts(messages, self.assistant_turns)
        texts = [_text(messages[i].get("content")) for i in idx]
        if _whole_query(self.mechanism):
            texts = ["\n".join(texts)]
        query = sum(self.mechanism.query_epsilon(t) for t in texts) if epsilon is None else epsilon
        return query + self.scheduler.worst_case_epsilon

    def ask(self, query: str, user: str | None = None, seed=None, bit_seed=None, epsilon: float | None = None,
            **params) -> Answer:
        """Answer one query. ``seed``/``bit_seed`` fix the randomness (benchmarks only: leave them None)."""
        return self.ask_messages([{"role": "user", "content": query}], user=user, seed=seed,
                                 bit_seed=bit_seed, params=params, epsilon=epsilon)

    def _call(self, messages: list[dict], params: dict):
        chat = getattr(self.upstream, "chat", None)
        if chat is not None:
            raw = chat(messages, **params)
            return raw["choices"][0]["message"]["content"] or "", raw
        return self.upstream(messages, **params), None

    def ask_messages(self, messages: list[dict], user: str | None = None, seed=None, bit_seed=None,
                     params: dict | None = None, epsilon: float | None = None) -> Answer:
        """Answer a chat; ``params`` (``UPSTREAM_PARAMS`` only: model, max_tokens, temperature, ...) go
        to the upstream unchanged; any other field is refused (ValueError) before anything is charged.

        ``epsilon``: what a cloud call may spend on the query (fixed before the call); default:
        the mechanism's own per-query amount.
        """
        params = check_params(dict(params or {}))
        user = user or self.default_user
        if epsilon is not None and not (epsilon >= 0 and math.isfinite(epsilon)):
            raise ValueError(f"query epsilon must be a finite number >= 0, got {epsilon}")
        idx = _private_parts(messages, self.assistant_turns)
        key = "\n".join(_text(messages[i].get("content")) for i in idx)
        pert_rng, bit_rng = _rngs(seed, bit_seed)
        with self._lock:
            res = self.ledger.reserve(user, self.worst_case_epsilon(messages, epsilon), purpose="query")
            decided = None
            try:
                self.store.tick(user)
                emb = self.embedder([key])[0]
                entry, sim = self.store.best_for_reuse(user, emb)
                cloud_acc = self.store.cloud_accuracy(user)
                cloud_acc = 1.0 if cloud_acc is None else cloud_acc
                decided = self.scheduler.decide(entry, sim, bit_rng, cloud_acc)
                if decided.hit:
                    self.store.touch(user, decided.entry.id)
                    eps = self.ledger.settle(res, decided.epsilon)
                    return Answer(decided.entry.response, True, eps, self.ledger.spent(user),
                                  self.ledger.remaining(user), sim, None)
                sent, eps_q, sent_text = _perturbed(self.mechanism, messages, idx, pert_rng, epsilon)
                text, raw = self._call(sent, params)
            except UpstreamError as e:
                if e.sent:
                    self.ledger.settle(res)
                else:
                    self.ledger.settle(res, decided.epsilon if decided else 0.0)
                raise
            except BaseException:
                # before the upstream call nothing left the device (except through the bit)
                if decided is None:
                    self.ledger.release(res)
                else:
                    self.ledger.settle(res)
                raise
            eps = self.ledger.settle(res, decided.epsilon + eps_q)
            fidelity = float(np.clip(emb @ self.embedder([sent_text])[0], 0.0, 1.0))
            self.store.add(user, key, emb, text, fidelity)
            return Answer(text, False, eps, self.ledger.spent(user), self.ledger.remaining(user), sim, sent, raw)


class PerQueryLDP:
    """The baseline without a cache: every query is perturbed and sent, costing its full epsilon."""

    def __init__(self, upstream: Callable, ledger: PrivacyLedger, mechanism: ExponentialTokenMechanism,
                 default_user: str = "default"):
        self.upstream, self.ledger, self.mechanism = upstream, ledger, mechanism
        self.default_user = default_user

    def ask(self, query: str, user: str | None = None, seed=None, epsilon: float | None = None,
            **params) -> Answer:
        """``epsilon``: what this query may spend (default: the mechanism's own per-query amount)."""
        check_params(params)
        user = user or self.default_user
        messages = [{"role": "user", "content": query}]
        pert_rng, _ = _rngs(seed)
        res = self.ledger.reserve(user, self.mechanism.query_epsilon(query) if epsilon is None else epsilon,
                                  purpose="query")
        sent, _, _ = _perturbed(self.mechanism, messages, [0], pert_rng, epsilon)
        try:
            text = self.upstream(sent, **params)
        except UpstreamError as e:
            if not e.sent:
                self.ledger.release(res)
            else:
                self.ledger.settle(res)
            raise
        eps = self.ledger.settle(res)
        return Answer(text, False, eps, self.ledger.spent(user), self.ledger.remaining(user), -1.0, sent)
