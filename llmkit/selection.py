"""Pick the best of several models / generation settings on a task with few evaluations (``llmkit select``).

Each arm is a model plus generation settings. A pull of an arm draws a problem uniformly (with
replacement) from the task's pool and scores the arm's answer 0/1 with the task's own grader (GSM8K:
lm-eval's flexible-extract, ``llmkit.evals.tasks.gsm8k``); an (arm, problem) pair is generated once and its
score reused, so a pull is exactly a Bernoulli draw with the arm's accuracy on the pool, and the cost is
the number of distinct (arm, problem) generations. Arms are chosen by beta-EB-TCI with the GLR stopping
rule (``llmkit.optim.bandits``); a fixed full evaluation would cost ``arms x problems`` generations.

Arm settings (``arms_from_config``; ``ARM_KEYS``)
-------------------------------------------------
- prompt / decoding: ``system_prompt``, ``num_fewshot``, ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``.
- engine: ``kv_cache`` (a name of ``llmkit.serving.kv_cache.cache_factory``: ``inquant``, ``kivi``,
  ``outlier-buffer``, or ``none``/``dynamic``/``bf16`` for transformers' default cache; hf engine only, as in
  ``llmkit serve --kv-cache``) and ``kv_cache_options`` (keyword arguments of that cache class, e.g.
  InQuant's ``group_size``, ``n_outliers``, ``max_stride``, ``min_ratio``). Arms are grouped by
  ``(model, kv_cache, kv_cache_options)``: one engine is built per distinct key, so arms differing only in
  prompt / decoding / guard settings share one loaded model.
- guard (``llmkit serve --guard DIR --guard-action ...`` applied offline): ``guard`` (a folder from
  ``llmkit guard fit``, fitted on the arm's model), ``guard_action`` (``annotate`` default, ``block``,
  ``correct``) and ``guard_threshold`` (overrides the fitted threshold: flagged = chaos score > it). Every
  answer of the arm is checked (``Guard.generate``: states recorded during generation on the hf engine) and
  then, as the server does with a flagged answer: ``annotate`` grades it unchanged (the flag is only counted),
  ``block`` grades the server's refusal text instead (so a blocked answer scores 0), ``correct`` grades the
  guard's regenerated answer (``Guard.correct_batch``, same decoding parameters, no score comparison with the
  original, as in the server). What a guard cannot do offline is left out: there is no streaming to hold back
  and no per-request prefill overlap (``guard_prefill``), which change latency, not answers. Each arm's
  result reports ``guard_flagged`` (flagged answers among its generations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

GUARD_ACTIONS = ("annotate", "block", "correct")  # = llmkit.serving.server.GUARD_ACTIONS (kept import-light)


@dataclass
class Arm:
    name: str
    model: str | None = None
    system_prompt: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    num_fewshot: int = 0
    seed: int = 0
    kv_cache: str | None = None
    kv_cache_options: dict = field(default_factory=dict)
    guard: str | None = None
    guard_action: str = "annotate"
    guard_threshold: float | None = None
    extra: dict = field(default_factory=dict)

    def engine_settings(self) -> dict:
        """Keyword arguments for the engine factory beyond the model: ``{}`` for the default KV cache."""
        name = None if self.kv_cache is None or self.kv_cache.lower() in ("none", "bf16", "dynamic") else self.kv_cache
        return {} if name is None else {"kv_cache": name.lower(), "kv_cache_options": dict(self.kv_cache_options)}

    def engine_key(self) -> tuple:
        s = self.engine_settings()
        return (self.model, s.get("kv_cache"), tuple(sorted((s.get("kv_cache_options") or {}).items())))


PROMPT_KEYS = {"name", "model", "system_prompt", "max_new_tokens", "temperature", "top_p", "num_fewshot", "seed"}
ENGINE_KEYS = {"kv_cache", "kv_cache_options"}
GUARD_KEYS = {"guard", "guard_action", "guard_threshold"}
ARM_KEYS = PROMPT_KEYS | ENGINE_KEYS | GUARD_KEYS


def _check_engine_settings(i: int, it: dict) -> None:
    import inspect

    name = it.get("kv_cache")
    opts = it.get("kv_cache_options")
    if opts is not None and not isinstance(opts, dict):
        raise TypeError(f"config {i}: kv_cache_options must be a mapping of keyword arguments")
    if name is None:
        if opts:
            raise ValueError(f"config {i}: kv_cache_options given without kv_cache")
        return
    if not isinstance(name, str):
        raise TypeError(f"config {i}: kv_cache must be a name (e.g. inquant), got {name!r}")
    from llmkit.serving.kv_cache import CACHES, cache_factory

    try:
        cache_factory(name)
    except ValueError as e:
        raise ValueError(f"config {i}: kv_cache: {e}") from None
    if opts:
        cls = CACHES.get(name.lower())
        if cls is None:
            raise ValueError(f"config {i}: kv_cache_options given for the default cache '{name}', which takes none")
        known = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "config")]
        bad = set(opts) - set(known)
        if bad:
            raise ValueError(f"config {i}: unknown kv_cache_options key(s) {', '.join(sorted(bad))} for "
                             f"kv_cache {name} (known: {', '.join(known)})")


def _check_guard_settings(i: int, it: dict) -> None:
    if it.get("guard") is None:
        extra = sorted(k for k in GUARD_KEYS - {"guard"} if k in it)
        if extra:
            raise ValueError(f"config {i}: {', '.join(extra)} given without guard (a `llmkit guard fit` folder)")
        return
    if not isinstance(it["guard"], str):
        raise TypeError(f"config {i}: guard must be a folder path, got {it['guard']!r}")
    action = it.get("guard_action", "annotate")
    if action not in GUARD_ACTIONS:
        raise ValueError(f"config {i}: guard_action {action!r} is not one of {', '.join(GUARD_ACTIONS)}")
    thr = it.get("guard_threshold")
    if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float))):
        raise TypeError(f"config {i}: guard_threshold must be a number, got {thr!r}")


def arms_from_config(items: list[dict] | dict) -> list[Arm]:
    """Arms from a list of dicts (or a name -> settings mapping); unknown keys or bad values raise
    ValueError (TypeError for a value of the wrong type), naming the config and the key."""
    if isinstance(items, dict):
        items = [{"name": k, **(v or {})} for k, v in items.items()]
    if not isinstance(items, list):
        raise TypeError("expected a list of arm settings or a name -> settings mapping")
    arms = []
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise TypeError(f"config {i}: expected a mapping of settings, got {it!r}")
        bad = set(it) - ARM_KEYS
        if bad:
            raise ValueError(f"config {i}: unknown key(s) {', '.join(sorted(bad))} (known: {', '.join(sorted(ARM_KEYS))})")
        _check_engine_settings(i, it)
        _check_guard_settings(i, it)
        kw = {k: v for k, v in it.items() if k != "name"}
        if kw.get("kv_cache_options") is None:
            kw.pop("kv_cache_options", None)
        arms.append(Arm(**{"name": it.get("name", f"config{i}"), **kw}))
    return arms


class LookaheadCache:
    """``score(arm_index, problem_index, upcoming) -> 0/1`` with a cache of (arm, problem) scores.

    On a miss, the problem and the arm's next not-yet-scored problems (``upcoming``, from
    ``select_best``) are scored together, ``lookahead`` at most: that is one engine batch in
    ``EngineScorer``, and every scored pair counts as spent (``len(cache)``). Subclasses fill
    ``cache`` in ``_generate(arm, problem_indices)``.
    """

    def __init__(self, lookahead: int = 1):
        self.cache: dict[tuple[int, int], float] = {}
        self.lookahead = max(1, int(lookahead))

    def _generate(self, a: int, idxs: list[int]) -> None:
        raise NotImplementedError

    def score(self, a: int, i: int, upcoming: list[int] = ()) -> float:
        if (a, i) not in self.cache:
            todo = [i] + [j for j in upcoming if (a, j) not in self.cache and j != i]
            self._generate(a, list(dict.fromkeys(todo))[: self.lookahead])
        return self.cache[(a, i)]


class TableScorer(LookaheadCache):
    """Replays a precomputed ``table[arm, problem]`` of 0/1 scores with the same lookahead accounting as
    ``EngineScorer`` (``llmkit select --batch-size`` = lookahead): what the CLI would have spent."""

    def __init__(self, table, lookahead: int = 1):
        super().__init__(lookahead)
        self.table = np.asarray(table, dtype=float)

    def _generate(self, a: int, idxs: list[int]) -> None:
        for i in idxs:
            self.cache[(a, i)] = float(self.table[a, i])


def _load_guard(path: str, model: str | None):
    from llmkit.models import DEFAULT_MODEL
    from llmkit.serving.guard import Guard

    return Guard.load(path, model_name=model or DEFAULT_MODEL)


class EngineScorer(LookaheadCache):
    """``score(arm_index, problem_index) -> 0/1`` with generation through llmkit engines, batched lookahead.

    ``engine_factory(model, **arm.engine_settings())`` builds one engine per distinct ``arm.engine_key()``
    (for arms on the default KV cache it is called as ``engine_factory(model)``). Arms with a ``guard`` have
    it loaded by ``guard_loader(path, model)`` (default ``Guard.load`` checked against the arm's model) and
    applied to each answer (module docstring).
    """

    def __init__(self, arms: list[Arm], problems: list[dict], task, engine_factory: Callable[..., object],
                 lookahead: int = 1, progress=None, guard_loader: Callable[[str, str | None], object] | None = None):
        super().__init__(lookahead)
        self.arms, self.problems, self.task = arms, problems, task
        self.engine_factory = engine_factory
        self.guard_loader = guard_loader or _load_guard
        self.engines: dict = {}
        self.guards: dict = {}
        self.guard_flagged = [0] * len(arms)
        self.progress = progress

    def _engine(self, arm: Arm):
        key = arm.engine_key()
        if key not in self.engines:
            self.engines[key] = self.engine_factory(arm.model, **arm.engine_settings())
        return self.engines[key]

    def guard_for(self, a: int):
        """The arm's guard (loaded once per (folder, model)), or None; raises what ``guard_loader`` raises."""
        arm = self.arms[a]
        if arm.guard is None:
            return None
        key = (arm.guard, arm.model)
        if key not in self.guards:
            self.guards[key] = self.guard_loader(arm.guard, arm.model)
        return self.guards[key]

    def _generate(self, a: int, idxs: list[int]) -> None:
        from llmkit.generation import GenerationParams

        arm = self.arms[a]
        eng = self._engine(arm)
        msgs_list = []
        for i in idxs:
            msgs = self.task.build_prompt(self.problems[i], arm.num_fewshot)
            if arm.system_prompt:
                msgs = [{"role": "system", "content": arm.system_prompt}] + msgs
            msgs_list.append(msgs)
        params = GenerationParams(max_new_tokens=arm.max_new_tokens, temperature=arm.temperature, top_p=arm.top_p,
                                  stop=list(self.task.stop), seed=arm.seed)
        guard = self.guard_for(a)
        if guard is None:
            texts = [o[0].text for o in eng.generate([eng.chat_prompt(m) for m in msgs_list], params)]
        else:
            texts = self._guarded(a, guard, eng, msgs_list, params)
        for i, t in zip(idxs, texts):
            self.cache[(a, i)] = float(self.task.score(t, self.problems[i])[self.task.primary] > 0.5)
        if self.progress is not None:
            self.progress.update(len(idxs))

    def _guarded(self, a: int, guard, eng, msgs_list, params) -> list[str]:
        """Answers after the arm's guard action (as ``llmkit serve --guard-action`` treats a flagged answer)."""
        arm = self.arms[a]
        checked = guard.generate(eng, msgs_list, params)
        texts = [t for t, _ in checked]
        thr = arm.guard_threshold
        flagged = [bool(r["score"] > thr) if thr is not None else bool(r["flagged"]) for _, r in checked]
        self.guard_flagged[a] += sum(flagged)
        idx = [k for k, f in enumerate(flagged) if f]
        if not idx or arm.guard_action == "annotate":
            return texts
        if arm.guard_action == "block":
            from llmkit.serving.server import REFUSAL

            for k in idx:
                texts[k] = REFUSAL
        else:  # correct
            fixed = guard.correct_batch(eng, [msgs_list[k] for k in idx], params)
            for k, t in zip(idx, fixed):
                texts[k] = t
        return texts

    def close(self):
        for e in self.engines.values():
            e.close()


def select_best(score: Callable[..., float], num_arms: int, num_problems: int, delta: float = 0.05,
                beta: float = 0.5, seed: int = 0, max_samples: int | None = None,
                generated: Callable[[], int] | None = None) -> dict:
    """Run beta-EB-TCI over arms whose pulls are ``score(arm, problem)`` for uniformly drawn problems.

    Returns a summary: winner, stopped (GLR test passed), pulls, per-arm estimate / 1-delta interval /
    pulls / distinct problems scored, evaluations (distinct generations) and the full-evaluation cost.
    """
    from scipy.stats import binomtest

    from llmkit.optim.bandits import TopTwoEBTCI

    rng = np.random.default_rng(seed)
    # each arm walks its own stream of uniformly drawn problems; the next few are its lookahead
    streams = [list(rng.integers(0, num_problems, size=64)) for _ in range(num_arms)]
    algo = TopTwoEBTCI(num_arms, delta, beta=beta)
    max_samples = max_samples or 50 * num_arms * num_problems
    seen: list[set] = [set() for _ in range(num_arms)]
    while not algo.should_stop() and algo.t < max_samples:
        a = algo.next_arm()
        if len(streams[a]) < 16:
            streams[a] += list(rng.integers(0, num_problems, size=64))
        i = int(streams[a].pop(0))
        seen[a].add(i)
        try:
            r = score(a, i, [int(j) for j in streams[a][:32]])
        except TypeError:
            r = score(a, i)
        algo.update(a, r)
    arms = []
    for a in range(num_arms):
        n = int(algo.counts[a])
        k = round(float(algo.means[a]) * n)
        ci = binomtest(k, n).proportion_ci(confidence_level=1 - delta) if n else None
        arms.append({"estimate": k / n if n else None, "interval": [ci.low, ci.high] if ci else None,
                     "pulls": n, "problems_scored": len(seen[a])})
    evals = generated() if generated else sum(len(s) for s in seen)
    full = num_arms * num_problems
    return {"winner": algo.best_arm(), "stopped": bool(algo.should_stop()), "delta": delta, "pulls": int(algo.t),
            "arms": arms, "evaluations": int(evals), "full_evaluations": full, "evals_vs_full": evals / full}
