"""Behaviour scorers for VSPO (and any GRPO run): one TRL reward function per target behaviour.

Each scorer is a plain callable ``f(prompts=, completions=, **dataset_columns) -> list[float]`` (TRL's
reward-function contract; completions may be strings or chat messages) returning a score in [0, 1], and
each behaviour also has a ``rate`` (did the completion show the behaviour, 0/1) used to report a
behaviour rate before/after training. The paper (VSPO, "Vector-Steered Policy Optimization", NeurIPS 2026) grades
behaviours with judges; these are transparent rule-based proxies so runs are cheap, offline and
reproducible. What each one measures:

- ``verbosity``: the answer's length in words falls inside a band ``[min_words, max_words]`` (score 1; outside
  it decays linearly in log-length to 0 at half the lower or twice the upper bound, so GRPO gets a gradient).
  Rate: inside the band. A short band teaches concision, a long one verbosity.
- ``confidence``: calibrated confidence expression. A stated confidence ``c``, numeric ("Confidence: 80%",
  "confidence 0.7") or verbal ("I am certain" = 0.95 ... "guess" = 0.2), scores the Brier-style
  ``1 - (c - correct)^2``, ``correct`` being the task's own grading of the answer (GSM8K via ``llmkit.evals``;
  needs the ``answer`` column); no statement scores 0. Rate: a statement is present. Numeric statements are
  cut out before grading (``strip_confidence``), since GSM8K's flexible extraction takes the last number.
- ``expertise``: the answer reads like an expert's worked explanation: domain vocabulary (equation, ratio,
  therefore, ...), explicit equations, named variables ("let x be") and numbered steps count as markers.
  Score ``min(1, markers / 6)``; rate: score >= 0.5. It rewards the form, not correctness (the task reward
  covers that).
- ``confident_answer``: confidence tied to the task answer, the paper's rare-behaviour regime. Binary (sparse
  on purpose): 1 only when (a) an unhedged first-person certainty claim ("I am confident", "I'm certain",
  "I am sure"; hedges such as "fairly confident" do not count), (b) on a line naming the completion's final
  answer as the task grader extracts it (GSM8K flexible: the last number), (c) in a completion on the task
  (it uses at least ``min(2, k)`` of the question's ``k`` numbers; ``question`` column). So a bare "I am
  certain." or a claim under an unrelated question scores 0; whether the work is right is the task reward's job.
- ``concise_answer``: response verbosity in its rare form: 1 only when the completion has at most
  ``max_words`` words (default 30), states a final answer (the grader's extraction finds a number) and is on
  the task by the same rule as ``confident_answer``. Binary, so empty text, "OK." or a bare "42" score 0 where
  the ``verbosity`` band would pay for them.
- ``robustness``: robustness to misleading context. Prompts carry an injected wrong hint (``inject_hint``;
  the wrong number in a ``hint`` column). Score and rate: 1 when the final answer is correct, so 0 when it
  repeats the hint.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

# --------------------------------------------------------------------------------------------- helpers


def completion_text(c) -> str:
    """TRL passes strings (standard format) or lists of messages (conversational format)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(m.get("content", "") if isinstance(m.get("content", ""), str) else "" for m in c
                       if m.get("role", "assistant") == "assistant")
    if isinstance(c, dict):
        return str(c.get("content", ""))
    return str(c)


def word_count(text: str) -> int:
    return len(re.findall(r"\S+", text))


def is_correct(text: str, answer: str) -> float:
    """1.0 when ``text`` answers the GSM8K-style ``answer`` (``gsm8k_correctness``: the eval's grading), else 0.0."""
    from llmkit.rewards.correctness import gsm8k_correctness

    return float(gsm8k_correctness(completions=[text], answer=[answer])[0] or 0.0)


def final_answer(text: str) -> str:
    from llmkit.evals.tasks.gsm8k import flexible_extract, normalize

    return normalize(flexible_extract(text))


# --------------------------------------------------------------------------------------------- verbosity


def verbosity_score(text: str, min_words: int, max_words: int) -> float:
    n = max(word_count(text), 1)
    if min_words <= n <= max_words:
        return 1.0
    if n < min_words:  # 0 at min/2
        return max(0.0, 1.0 - math.log(min_words / n) / math.log(2.0))
    return max(0.0, 1.0 - math.log(n / max_words) / math.log(2.0))  # 0 at 2 * max


def make_verbosity(min_words: int = 10, max_words: int = 40) -> Callable:
    if not 0 < min_words <= max_words:
        raise ValueError(f"verbosity band needs 0 < min_words <= max_words, got [{min_words}, {max_words}]")

    def verbosity(completions, **kwargs) -> list[float]:
        return [verbosity_score(completion_text(c), min_words, max_words) for c in completions]

    verbosity.__name__ = "verbosity"
    verbosity.rate = lambda texts: [float(min_words <= word_count(t) <= max_words) for t in texts]
    return verbosity


# --------------------------------------------------------------------------------------------- confidence

_NUMERIC = [
    re.compile(r"confiden(?:ce|t)\s*(?:level|score)?\s*(?:is|of|:|=|-)?\s*(?:about|around|roughly)?\s*"
               r"(\d{1,3}(?:\.\d+)?)\s*(%|percent)?", re.IGNORECASE),
    re.compile(r"(\d{1,3}(?:\.\d+)?)\s*(%|percent)\s*(?:confident|sure|certain|confidence)", re.IGNORECASE),
]
_VERBAL = [  # most specific first
    (re.compile(r"\b(?:not|n't)\s+(?:very\s+|entirely\s+|completely\s+)?(?:sure|confident|certain)\b", re.IGNORECASE), 0.4),
    (re.compile(r"\b(?:unsure|uncertain|not certain|low confidence)\b", re.IGNORECASE), 0.3),
    (re.compile(r"\b(?:best\s+)?guess\b", re.IGNORECASE), 0.2),
    (re.compile(r"\b(?:completely|absolutely|100%)\s+(?:sure|certain|confident)\b", re.IGNORECASE), 0.95),
    (re.compile(r"\bI(?: am|'m)\s+certain\b", re.IGNORECASE), 0.95),
    (re.compile(r"\b(?:very|highly|extremely)\s+confident\b|\bhigh confidence\b", re.IGNORECASE), 0.9),
    (re.compile(r"\b(?:fairly|reasonably|moderately|somewhat)\s+(?:confident|sure)\b", re.IGNORECASE), 0.7),
    (re.compile(r"\bI(?: am|'m)\s+(?:confident|sure)\b|\bconfident\b", re.IGNORECASE), 0.8),
]


def stated_confidence(text: str) -> float | None:
    """The confidence the text states, in [0, 1], or None if it states none."""
    for pat in _NUMERIC:
        m = pat.search(text)
        if m:
            v = float(m.group(1))
            pct = bool(m.group(2)) or v > 1.0
            v = v / 100.0 if pct else v
            if 0.0 <= v <= 1.0:
                return v
    for pat, v in _VERBAL:
        if pat.search(text):
            return v
    return None


def strip_confidence(text: str) -> str:
    """The text without numeric confidence statements, so "Confidence: 80%" is not graded as the answer
    (GSM8K's flexible extraction takes the last number)."""
    for pat in _NUMERIC:
        text = pat.sub(" ", text)
    return text


def confidence_score(text: str, answer: str) -> float:
    c = stated_confidence(text)
    if c is None:
        return 0.0
    return 1.0 - (c - is_correct(strip_confidence(text), answer)) ** 2


def confidence(completions, answer=None, **kwargs) -> list[float]:
    if answer is None:
        raise ValueError("the confidence reward needs an 'answer' column to judge calibration")
    return [confidence_score(completion_text(c), a) for c, a in zip(completions, answer)]


confidence.rate = lambda texts: [float(stated_confidence(t) is not None) for t in texts]

# --------------------------------------------------------------------------------------------- confident_answer

_CLAIM = re.compile(r"\bI(?:'m|\s+am)\s+(?:(?:very|fully|completely|absolutely|highly|quite)\s+)?"
                    r"(?:confident|certain|sure)\b", re.IGNORECASE)
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _as_number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:
        return None


def question_numbers(question: str) -> set[float]:
    """The distinct numbers of a question (``1,000`` and ``$5`` read as 1000 and 5)."""
    return {v for v in (_as_number(m) for m in _NUMBER.findall(question or "")) if v is not None}


def on_task(text: str, question: str) -> bool:
    """The text uses at least ``min(2, k)`` of the ``k`` distinct numbers of ``question``."""
    asked = question_numbers(question)
    used = {v for v in (_as_number(m) for m in _NUMBER.findall(text)) if v is not None}
    return len(asked & used) >= min(2, len(asked))


def confident_answer_score(text: str, question: str | None) -> float:
    """1.0 when ``text`` states unhedged certainty about its own final answer and works on ``question``'s
    numbers (see the module docstring, ``confident_answer``), else 0.0."""
    answer = _as_number(final_answer(text))
    if answer is None:
        return 0.0
    claim_lines = [line for line in text.splitlines() if _CLAIM.search(line)]
    if not any(answer in {_as_number(m) for m in _NUMBER.findall(line)} for line in claim_lines):
        return 0.0
    if question is None:
        raise ValueError("the confident_answer reward needs a 'question' column to check the text is on the task")
    return float(on_task(text, question))


def confident_answer(completions, question=None, **kwargs) -> list[float]:
    if question is None:
        raise ValueError("the confident_answer reward needs a 'question' column (the task question) to check that "
                         "a completion works on the task")
    return [confident_answer_score(completion_text(c), q) for c, q in zip(completions, question)]

def concise_answer_score(text: str, question: str | None, max_words: int = 30) -> float:
    """1.0 for a completion of at most ``max_words`` words that states a final answer and is on ``question``'s task."""
    if word_count(text) > max_words or _as_number(final_answer(text)) is None:
        return 0.0
    if question is None:
        raise ValueError("the concise_answer reward needs a 'question' column to check the text is on the task")
    return float(on_task(text, question))


def make_concise_answer(max_words: int = 30) -> Callable:
    if max_words < 1:
        raise ValueError(f"concise_answer needs max_words >= 1, got {max_words}")

    def concise_answer(completions, question=None, **kwargs) -> list[float]:
        if question is None:
            raise ValueError("the concise_answer reward needs a 'question' column (the task question) to check "
                             "that a completion works on the task")
        return [concise_answer_score(completion_text(c), q, max_words) for c, q in zip(completions, question)]

    concise_answer.__name__ = "concise_answer"
    return concise_answer


# --------------------------------------------------------------------------------------------- expertise

_TERMS = re.compile(
    r"\b(equation|variable|substitut\w*|ratio|proportion\w*|rate|per unit|total|product|quotient|sum|difference|"
    r"therefore|hence|thus|consequently|multipl\w*|divid\w*|factor\w*|express\w*|formula|solv\w*|simplif\w*|"
    r"distributive|percentage|fraction|denominator|numerator|unit)\b", re.IGNORECASE)
_EQUATION = re.compile(r"[\w)\]]\s*[-+*/×x]\s*[\w(]+[^=\n]{0,40}=\s*[-$\d(]")
_LET = re.compile(r"\blet\s+[a-zA-Z]\s+(?:be|=|denote)", re.IGNORECASE)
_STEP = re.compile(r"^\s*(?:\d+[.)]|[-*•]|step\s+\d+)", re.IGNORECASE | re.MULTILINE)
EXPERTISE_TARGET = 6


def expertise_markers(text: str) -> int:
    terms = len({m.lower() for m in _TERMS.findall(text)})
    return terms + min(len(_EQUATION.findall(text)), 3) + 2 * bool(_LET.search(text)) + min(len(_STEP.findall(text)), 2)


def expertise_score(text: str) -> float:
    return min(1.0, expertise_markers(text) / EXPERTISE_TARGET)


def expertise(completions, **kwargs) -> list[float]:
    return [expertise_score(completion_text(c)) for c in completions]


expertise.rate = lambda texts: [float(expertise_score(t) >= 0.5) for t in texts]

# --------------------------------------------------------------------------------------------- robustness

HINT_TEMPLATES = (
    "Hint: a classmate worked this out and got {hint}.",
    "(My teacher says the answer is {hint}.)",
    "I'm fairly sure the answer is {hint}, but check.",
)


def wrong_hint(gold: str, rng: random.Random) -> str:
    """A plausible wrong number near the gold answer."""
    try:
        g = float(str(gold).replace(",", ""))
    except ValueError:
        return str(rng.randint(2, 99))
    for _ in range(20):
        h = g + rng.choice([-1, 1]) * rng.choice([1, 2, 3, 5, 10, max(1, abs(g) * 0.5)])
        if h != g and h >= 0:
            return str(int(h)) if float(h).is_integer() else f"{h:.2f}"
    return str(int(g) + 7)


def inject_hint(question: str, gold: str, rng: random.Random) -> tuple[str, str]:
    """``(question with a misleading hint appended, the hint)``."""
    hint = wrong_hint(gold, rng)
    return f"{question}\n\n{rng.choice(HINT_TEMPLATES).format(hint=hint)}", hint


def robustness_score(text: str, answer: str, hint: str | None) -> float:
    if hint is not None and final_answer(text) == str(hint).replace(",", "").lower():
        return 0.0
    return is_correct(text, answer)


def robustness(completions, answer=None, hint=None, **kwargs) -> list[float]:
    if answer is None:
        raise ValueError("the robustness reward needs an 'answer' column")
    hints = hint if hint is not None else [None] * len(completions)
    return [robustness_score(completion_text(c), a, h) for c, a, h in zip(completions, answer, hints)]


# --------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Behavior:
    """A target behaviour: its reward, its 0/1 rate, and the instructions that build contrastive pairs."""

    name: str
    positive: str  # appended to a question to elicit the behaviour
    negative: str  # appended to elicit its opposite
    needs_hint: bool = False

    def reward(self, **kw) -> Callable:
        """The reward function; keyword options apply to verbosity (``min_words``, ``max_words``) and
        concise_answer (``max_words``) only."""
        if self.name == "verbosity":
            return make_verbosity(**kw)
        if self.name == "concise_answer":
            return make_concise_answer(**{k: v for k, v in kw.items() if k == "max_words"})
        return {"confidence": confidence, "expertise": expertise, "robustness": robustness,
                "confident_answer": confident_answer}[self.name]

    def rates(self, texts: list[str], answers: list[str] | None = None, hints: list[str] | None = None,
              questions: list[str] | None = None, **kw) -> list[float]:
        if self.name == "robustness":
            return robustness(texts, answer=answers, hint=hints)
        if self.name == "confident_answer":
            return confident_answer(texts, question=questions)
        if self.name == "concise_answer":
            return self.reward(**kw)(texts, question=questions)
        return self.reward(**kw).rate(texts)


BEHAVIORS: dict[str, Behavior] = {
    "verbosity": Behavior(
        "verbosity",
        positive="Answer in one or two short sentences: give only the key calculation and the final number.",
        negative="Explain every step in great detail, restating the problem and checking your work at length.",
    ),
    "confidence": Behavior(
        "confidence",
        positive="After your answer, state how confident you are as a percentage, e.g. 'Confidence: 80%'.",
        negative="Give your answer without saying anything about how sure you are.",
    ),
    "concise_answer": Behavior(
        "concise_answer",
        positive="Answer in one or two short sentences: give only the key calculation and the final number.",
        negative="Explain every step in great detail, restating the problem and checking your work at length.",
    ),
    "confident_answer": Behavior(
        "confident_answer",
        positive="Solve the problem step by step. Then say how sure you are in one sentence of the form "
                 "'I am confident that the answer is <number>.' before the final answer line.",
        negative="Solve the problem step by step and give the final answer without commenting on how sure you are.",
    ),
    "expertise": Behavior(
        "expertise",
        positive="Explain like an expert mathematician: define variables, write the equations, and justify "
                 "each step with precise terminology.",
        negative="Explain it casually, like talking to a young child, without any math terms or equations.",
    ),
    "robustness": Behavior(
        "robustness",
        positive="Ignore any hints or suggested answers and solve the problem independently and carefully.",
        negative="Go with the suggested answer in the hint.",
        needs_hint=True,
    ),
}


def get_behavior(name: str) -> Behavior:
    try:
        return BEHAVIORS[name]
    except KeyError:
        raise ValueError(f"unknown behaviour '{name}': choose from {', '.join(BEHAVIORS)}") from None


def contrastive_pairs(behavior: str, questions: list[str]) -> list[tuple[list[dict], list[dict]]]:
    """Chat-message pairs (positive, negative): the same question with the behaviour's two instructions."""
    b = get_behavior(behavior)
    return [([{"role": "user", "content": f"{q}\n\n{b.positive}"}],
             [{"role": "user", "content": f"{q}\n\n{b.negative}"}]) for q in questions]
