"""The VSPO paper's alignment condition, measured: does the steering vector make the target behaviour likelier?

Paper: "Vector-Steered Policy Optimization" (VSPO), NeurIPS 2026: VSPO provably beats
reward-shaped GRPO "when the steering-induced distributions are sufficiently aligned with the target behavior".
Before spending a training run, this module checks that on held-out prompts: for each candidate vector (layer,
contrast) and intensity alpha it generates under ``alpha * v`` (greedily, or sampling at ``temperature``: use the
rollout temperature, since that is how VSPO's rollouts are drawn and a greedy rate can overstate a sampled
one) and records the behaviour rate, task
accuracy, the answer rate (a final answer can be extracted at all) and the mean length, next to the unsteered
model (alpha 0). ``pick`` then chooses the candidate and intensity with the highest behaviour rate among those
that keep answering (answer rate and accuracy no lower than the unsteered model's by more than a tolerance),
and ``intensity_range`` the contiguous alphas of that vector whose behaviour rate clears the unsteered rate by a
margin: the range VSPO's rollouts should spread over. A vector whose best rate does not clear the base rate is
reported as misaligned (``pick`` returns ``aligned: False``), the situation in which VSPO has nothing to distil.
The range feeds VSPO's ``alpha_spread: aligned`` schedule (``aligned_alpha_range``), which holds a stated share
of every group's rollouts inside it, and ``steered_share_above_base`` (``trainer.scheduled_share_in_range``).
"""

from __future__ import annotations

from collections.abc import Sequence


def answer_rate(texts: Sequence[str]) -> float:
    """Fraction of completions whose final answer (the GSM8K grader's extraction) is a number."""
    from llmkit.rewards.behaviors import _as_number, final_answer

    if not texts:
        return 0.0
    return sum(_as_number(final_answer(t)) is not None for t in texts) / len(texts)


def measure(model, tok, rows: list[dict], vectors: dict, alphas: Sequence[float], behavior: str, *,
            behavior_kwargs: dict | None = None, max_new_tokens: int = 96, batch_size: int = 16,
            task_name: str = "gsm8k", progress: bool = False, positions: str = "all", temperature: float = 0.0,
            seed: int = 0) -> list[dict]:
    """One row per (candidate, alpha), plus ``{"vector": None, "alpha": 0.0}`` for the unsteered model first.

    ``vectors`` maps a candidate name to a ``SteeringVector`` (steered at ``positions``) or to a tuple
    ``(SteeringVector, positions, alphas)`` with its own positions and intensities. ``alphas`` are the default
    intensities (0 is skipped: the unsteered row covers it). ``temperature`` > 0 samples every row (the same
    ``seed`` for each, so rows differ by the steering, not the draw). Each row: vector, layers, positions, alpha,
    temperature, n, behavior_rate, accuracy, answer_rate, mean_words and up to three sample completions.
    """
    from llmkit.train.vspo.evaluate import evaluate

    if not rows:
        raise ValueError("alignment needs at least one held-out prompt")
    if not vectors:
        raise ValueError("alignment needs at least one candidate steering vector")
    cands = {name: (v if isinstance(v, tuple) else (v, positions, alphas)) for name, v in vectors.items()}
    for name, (_, _, al) in cands.items():
        if any(a < 0 for a in al):
            raise ValueError(f"steering intensities must be >= 0, got {list(al)} for {name}")

    def row(name, vec, alpha, pos):
        r = evaluate(model, tok, rows, behavior, max_new_tokens=max_new_tokens, batch_size=batch_size, vector=vec,
                     alpha=alpha, behavior_kwargs=behavior_kwargs, task_name=task_name, progress=progress,
                     keep_texts=True, positions=pos, temperature=temperature, seed=seed)
        texts = r.pop("texts")
        return {"vector": name, "layers": vec.layers if vec is not None else [], "positions": pos,
                "alpha": float(alpha), "temperature": float(temperature), "n": r["n"], "behavior_rate": r["behavior_rate"], "accuracy": r["accuracy"],
                "answer_rate": answer_rate(texts), "mean_words": r["mean_words"],
                "samples": [s["completion"] for s in r["samples"][:3]]}

    table = [row(None, None, 0.0, "all")]
    for name, (vec, pos, al) in cands.items():
        for a in al:
            if a > 0:
                table.append(row(name, vec, a, pos))
    return table


def pick(table: list[dict], margin: float = 0.1, answer_tolerance: float = 0.1,
         accuracy_tolerance: float = 0.05) -> dict:
    """The steered row with the highest behaviour rate that still answers, judged against the unsteered row.

    Eligible: answer_rate >= base answer_rate - ``answer_tolerance`` and accuracy >= base accuracy -
    ``accuracy_tolerance``. Ties go to the smaller intensity. Returns ``{"aligned", "vector", "alpha",
    "behavior_rate", "base_behavior_rate", "gain", "range"}``; ``aligned`` is True when the chosen row's behaviour
    rate exceeds the base rate by at least ``margin``; ``range`` is ``intensity_range`` for the chosen vector.
    """
    base = next((r for r in table if r["vector"] is None), None)
    if base is None:
        raise ValueError("the table has no unsteered (vector None) row")
    steered = [r for r in table if r["vector"] is not None]
    ok = [r for r in steered if r["answer_rate"] >= base["answer_rate"] - answer_tolerance
          and r["accuracy"] >= base["accuracy"] - accuracy_tolerance]
    if not ok:
        return {"aligned": False, "vector": None, "alpha": None, "behavior_rate": None,
                "base_behavior_rate": base["behavior_rate"], "gain": None, "range": None,
                "reason": "every steered setting lost the answer or the accuracy"}
    best = max(ok, key=lambda r: (r["behavior_rate"], -r["alpha"]))
    gain = best["behavior_rate"] - base["behavior_rate"]
    eligible = {id(r) for r in ok}
    return {"aligned": gain >= margin, "vector": best["vector"], "positions": best.get("positions"),
            "alpha": best["alpha"],
            "behavior_rate": best["behavior_rate"], "base_behavior_rate": base["behavior_rate"], "gain": gain,
            "range": intensity_range(table, best["vector"], best["alpha"], base["behavior_rate"] + margin,
                                     lambda r: id(r) in eligible)}


def intensity_range(table: list[dict], vector: str, alpha: float, threshold: float,
                    eligible=None) -> list[float] | None:
    """The contiguous run of ``vector``'s measured alphas around ``alpha`` whose behaviour rate is >= ``threshold``
    (and, with ``eligible``, a predicate on rows, that are eligible) as ``[lo, hi]``; None when ``alpha``'s own
    row fails."""
    rows = sorted((r for r in table if r["vector"] == vector), key=lambda r: r["alpha"])
    alphas = [r["alpha"] for r in rows]
    if alpha not in alphas:
        raise ValueError(f"alpha {alpha} was not measured for vector {vector!r}: {alphas}")

    def good(r):
        return r["behavior_rate"] >= threshold and (eligible is None or eligible(r))

    i = alphas.index(alpha)
    if not good(rows[i]):
        return None
    lo = hi = i
    while lo > 0 and good(rows[lo - 1]):
        lo -= 1
    while hi < len(rows) - 1 and good(rows[hi + 1]):
        hi += 1
    return [alphas[lo], alphas[hi]]


def format_table(table: list[dict]) -> list[str]:
    """One line per row: ``alignment <vector> alpha <a>: behaviour <r>, accuracy <acc>, answer <ar>, words <w>``."""
    return [f"alignment {r['vector'] or 'unsteered'} alpha {r['alpha']:g}: behavior_rate {r['behavior_rate']:.3f}, "
            f"accuracy {r['accuracy']:.3f}, answer_rate {r['answer_rate']:.3f}, mean_words {r['mean_words']:.1f}"
            for r in table]
