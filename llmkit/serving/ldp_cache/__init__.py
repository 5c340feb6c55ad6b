"""LDPCache: a local-differential-privacy cache for multi-query LLM use (client side).

Paper: LDPCache ("LDPCache: cache-enhanced LDP for multi-query LLM processing", NeurIPS 2026). An edge user's queries
go to a cloud LLM only as LDP-perturbed text; a cache of past responses, consulted
by a scheduler whose hit/miss decision is itself LDP, saves budget on semantically
correlated consecutive queries. Parts:

- :mod:`.mechanism`   token-level exponential mechanism (pure eps-LDP, optional length buckets),
                      randomized response
- :mod:`.sentence`    sentence-level candidate mechanism (nearest public query + k-ary randomized
                      response; eps-LDP for any two queries, usable at single-digit eps)
- :mod:`.budget`      a fixed total budget over a stream: the per-call allocation rule
- :mod:`.scheduler`   the randomized hit/miss decision with an expected-accuracy-gain estimate;
                      a GPTCache-style threshold baseline
- :mod:`.accountant`  per-user budget, sequential composition, crash-safe SQLite ledger
- :mod:`.store`       the cache (SQLite WAL), capacity limit
- :mod:`.eviction`    multi-factor (diversity, accuracy, recency) and LRU eviction
- :mod:`.embedder`    offline all-MiniLM-L6-v2 embeddings; a hashed stand-in for tests
- :mod:`.client`      ``LDPCache.ask(query) -> Answer``; ``PerQueryLDP`` (no-cache baseline)
- :mod:`.proxy`       an OpenAI-compatible proxy app (``llmkit ldp-proxy``)

The benchmark's workloads, runs and statistics are in ``llmkit.experiments.ldp_cache``.
"""

from .accountant import BudgetExceeded, PrivacyLedger
from .budget import BudgetPlan
from .client import Answer, LDPCache, PerQueryLDP
from .eviction import LRUPolicy, MultiFactorPolicy, make_policy
from .mechanism import ExponentialTokenMechanism, RandomizedResponse
from .scheduler import LDPScheduler, ThresholdScheduler
from .sentence import CandidateMechanism
from .store import CacheStore
from .upstream import OpenAIUpstream, UpstreamError

__all__ = [
    "Answer", "BudgetExceeded", "BudgetPlan", "CacheStore", "CandidateMechanism", "ExponentialTokenMechanism", "LDPCache", "LDPScheduler",
    "LRUPolicy", "MultiFactorPolicy", "OpenAIUpstream", "PerQueryLDP", "PrivacyLedger",
    "RandomizedResponse", "ThresholdScheduler", "UpstreamError", "make_policy",
]
