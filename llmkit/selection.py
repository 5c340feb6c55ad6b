"""Pick the best of several models / generation settings on a task with few evaluations (``llmkit select``).

Each arm is a model plus generation settings. A pull of an arm draws a problem uniformly (with
replacement) from the task's pool and scores the arm's answer 0/1 with the task's own grader (GSM8K:
lm-eval's flexible-extract, ``llmkit.evals.tasks.gsm8k``); an (arm, problem) pair is generated once and its
score reused, so a pull is exactly a Bernoulli draw with the arm's accuracy on the pool, and the cost is
the number of distinct (arm, problem) generations. Arms are chosen by beta-EB-TCI with the GLR stopping
rule (``llmkit.optim.bandits``); a fixed full evaluation would cost ``arms x problems`` generations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


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
    extra: dict = field(default_factory=dict)


ARM_KEYS = {"name", "model", "system_prompt", "max_new_tokens", "temperature", "top_p", "num_fewshot", "seed"}


def arms_from_config(items: list[dict] | dict) -> list[Arm]:
    """Arms from a list of dicts (or a name -> settings mapping); unknown keys raise ValueError."""
    if isinstance(items, dict):
        items = [{"name": k, **(v or {})} for k, v in items.items()]
    arms = []
    for i, it in enumerate(items):
        bad = set(it) - ARM_KEYS
        if bad:
            raise ValueError(f"config {i}: unknown key(s) {', '.join(sorted(bad))} (known: {', '.join(sorted(ARM_KEYS))})")
        arms.append(Arm(**{"name": it.get("name", f"config{i}"), **{k: v for k, v in it.items() if k != "name"}}))
    return arms


class EngineScorer:
    """``score(arm_index, problem_index) -> 0/1`` with generation through llmkit engines, batched lookahead."""

    def __init__(self, arms: list[Arm], problems: list[dict], task, engine_factory: Callable[[str | None], object],
                 lookahead: int = 1, progress=None):
        self.arms, self.problems, self.task = arms, problems, task
        self.engine_factory = engine_factory
        self.engines: dict = {}
        self.cache: dict[tuple[int, int], float] = {}
        self.lookahead = max(1, int(lookahead))
        self.progress = progress

    def _engine(self, model):
        if model not in self.engines:
            self.engines[model] = self.engine_factory(model)
        return self.engines[model]

    def _generate(self, a: int, idxs: list[int]) -> None:
        from llmkit.generation import GenerationParams

        arm = self.arms[a]
        eng = self._engine(arm.model)
        prompts = []
        for i in idxs:
            msgs = self.task.build_prompt(self.problems[i], arm.num_fewshot)
            if arm.system_prompt:
                msgs = [{"role": "system", "content": arm.system_prompt}] + msgs
            prompts.append(eng.chat_prompt(msgs))
        params = GenerationParams(max_new_tokens=arm.max_new_tokens, temperature=arm.temperature, top_p=arm.top_p,
                                  stop=list(self.task.stop), seed=arm.seed)
        outs = eng.generate(prompts, params)
        for i, o in zip(idxs, outs):
            self.cache[(a, i)] = float(self.task.score(o[0].text, self.problems[i])[self.task.primary] > 0.5)
        if self.progress is not None:
            self.progress.update(len(idxs))

    def score(self, a: int, i: int, upcoming: list[int] = ()) -> float:
        if (a, i) not in self.cache:
            todo = [i] + [j for j in upcoming if (a, j) not in self.cache and j != i]
            self._generate(a, list(dict.fromkeys(todo))[: self.lookahead])
        return self.cache[(a, i)]

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
        k = int(round(float(algo.means[a]) * n))
        ci = binomtest(k, n).proportion_ci(confidence_level=1 - delta) if n else None
        arms.append({"estimate": k / n if n else None, "interval": [ci.low, ci.high] if ci else None,
                     "pulls": n, "problems_scored": len(seen[a])})
    evals = generated() if generated else sum(len(s) for s in seen)
    full = num_arms * num_problems
    return {"winner": algo.best_arm(), "stopped": bool(algo.should_stop()), "delta": delta, "pulls": int(algo.t),
            "arms": arms, "evaluations": int(evals), "full_evaluations": full, "evals_vs_full": evals / full}
