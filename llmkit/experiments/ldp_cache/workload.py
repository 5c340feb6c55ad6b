"""LDPCache benchmark workloads: GSM8K problem sets, query streams of templated variants, scoring.

A stream is a sequence of *visits*; a visit is 2-4 consecutive queries that are distinct templated
variants of one problem ("Solve this math word problem: ...", "... Think step by step.", drawn without
replacement from 8 templates; the answer never changes), so consecutive queries are semantically
correlated. The workloads differ only in which problem a visit is about:

- ``uniform`` (session 1's workload): the first visit takes problem 0; every later visit returns to an
  earlier problem with probability 0.5, uniformly among the problems seen so far (not the one just
  visited), else takes the next new problem. Neither recency nor frequency predicts a revisit.
- ``zipf``: the independent reference model of web/CDN and LLM-query traces: a pool of N problems in a
  random popularity order (workload seed); each visit draws rank k with probability k^-s / H, s = 1.0.
  A few problems come often, a long tail once or never (consecutive visits may repeat a problem).
- ``uniform_arith`` / ``zipf_arith``: the same streams over a problem set the bundled model can answer,
  so accuracy separates the arms (on the open-ended set it gets ~0% right even without privacy).

Problem sets, fixed before any model run: :func:`load_problems` takes GSM8K train problems of at most
two calculator steps and 45 words, shuffled with a fixed seed. :func:`load_arith_problems` takes problems
of at most 45 words and reduces each to its first calculator annotation ``<<a op b=c>>`` with plain
integers a, b, c <= 100, op in + - * / and a op b == c exactly (GSM8K's rare wrong annotations are
skipped); the problem's text without its last sentence stays as context, so entities stay and problems
stay distinct, and the question becomes "<context> What is <a> plus|minus|times|divided by <b>?" with
gold answer c. Problems without such an annotation, or of one sentence, are skipped.

Sizes (distinct problems for uniform, pool for zipf / visits): quick 6 / 12 and 12 / 12 for every kind;
full 20 / 45, 40 / 45, and 120 / 240, 200 / 240 for the arithmetic sets, which are larger because a
cached answer is one noisy sample reused on every hit: per problem the cache is right on all its hits
or on none, so the variance is across problems and only more problems narrow the interval.

Scoring: the last number of an answer equals the gold one.
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from pathlib import Path

TEMPLATES = [
    "{q}",
    "Solve this math word problem: {q}",
    "{q} Think step by step.",
    "Question: {q}\nAnswer:",
    "I need help with my homework. {q}",
    "{q} Give the final answer as a number.",
    "Please work out the following. {q}",
    "Here is a word problem for you. {q} What is the answer?",
]
WORKLOADS = ("uniform", "zipf", "uniform_arith", "zipf_arith")
ZIPF_S = 1.0
# distinct problems (uniform) / pool (zipf) and visits per workload, full and --quick (module docstring)
FULL_SIZES = {"uniform": 20, "zipf": 40, "uniform_arith": 120, "zipf_arith": 200}
QUICK_SIZES = {"uniform": 6, "zipf": 12, "uniform_arith": 6, "zipf_arith": 12}
FULL_VISITS = {"uniform": 45, "zipf": 45, "uniform_arith": 240, "zipf_arith": 240}
QUICK_VISITS = 12


def load_problems(path: Path, n: int, seed: int, max_steps: int = 2) -> list[dict]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                gold = r["answer"].split("####")[-1].strip().replace(",", "")
                float(gold)
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}:{line_no}: not a GSM8K record ({e})") from e
            if r["answer"].count("<<") <= max_steps and len(r["question"].split()) <= 45:
                rows.append({"question": r["question"], "gold": gold})
    random.Random(seed).shuffle(rows)
    return rows[:n]


ARITH_WORDS = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}
ARITH_MAX = 100  # operands and result at most this (one-step arithmetic a 135M model can do)
_ANNOTATION = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>")


def arith_question(question: str, answer: str, max_value: int = ARITH_MAX) -> dict | None:
    """A GSM8K problem reduced to its first one-step calculator annotation, or None.

    See the module docstring (uniform_arith / zipf_arith) for the construction.
    """
    for a, op, b, c in _ANNOTATION.findall(answer):
        x, y, z = int(a), int(b), int(c)
        if max(x, y, z) > max_value:
            continue
        if op == "/" and y == 0:
            continue
        exact = {"+": x + y, "-": x - y, "*": x * y, "/": Fraction(x, y) if y else None}[op]
        if exact != z:
            continue
        sentences = re.split(r"(?<=[.?!])\s+", question.strip())
        if len(sentences) < 2:
            return None
        context = " ".join(sentences[:-1])
        return {
            "question": f"{context} What is {x} {ARITH_WORDS[op]} {y}?",
            "gold": str(z),
            "annotation": f"{x}{op}{y}={z}",
            "source": question,
        }
    return None


def load_arith_problems(path: Path, n: int, seed: int) -> list[dict]:
    """The uniform_arith / zipf_arith problem set (module docstring)."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                q, a = r["question"], r["answer"]
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}:{line_no}: not a GSM8K record ({e})") from e
            if len(q.split()) <= 45:
                p = arith_question(q, a)
                if p is not None:
                    rows.append(p)
    random.Random(seed).shuffle(rows)
    return rows[:n]


def _visit(queries: list[dict], problems: list[dict], pid: int, v: int, rng: random.Random) -> None:
    for t in rng.sample(range(len(TEMPLATES)), rng.randint(2, 4)):
        queries.append(
            {
                "problem": pid,
                "visit": v,
                "template": t,
                "text": TEMPLATES[t].format(q=problems[pid]["question"]),
                "gold": problems[pid]["gold"],
            }
        )


def build_uniform(problems: list[dict], visits: int, seed: int, p_revisit: float = 0.5) -> list[dict]:
    """Session 1's workload: revisits uniform over the problems seen so far."""
    rng = random.Random(seed)
    seen: list[int] = []
    queries: list[dict] = []
    nxt = 0
    for v in range(visits):
        revisit = seen and (nxt >= len(problems) or rng.random() < p_revisit)
        if revisit:
            cur = queries[-1]["problem"] if queries else -1
            choices = [p for p in seen if p != cur] or seen
            pid = rng.choice(choices)
        else:
            pid = nxt
            nxt += 1
            seen.append(pid)
        _visit(queries, problems, pid, v, rng)
    return queries


def build_zipf(problems: list[dict], visits: int, seed: int, s: float = ZIPF_S) -> list[dict]:
    """Independent reference model with Zipf(s) popularity over a randomly ranked pool."""
    rng = random.Random(seed)
    order = list(range(len(problems)))
    rng.shuffle(order)  # order[k] = the problem with popularity rank k + 1
    weights = [(k + 1) ** -s for k in range(len(problems))]
    queries: list[dict] = []
    for v in range(visits):
        pid = order[rng.choices(range(len(problems)), weights)[0]]
        _visit(queries, problems, pid, v, rng)
    return queries


def build(kind: str, problems: list[dict], visits: int, seed: int) -> list[dict]:
    return {"uniform": build_uniform, "zipf": build_zipf}[kind.removesuffix("_arith")](problems, visits, seed)


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return nums[-1] if nums else None


def correct(text: str, gold: str | None) -> bool:
    x = last_number(text)
    return x is not None and gold is not None and abs(float(x) - float(gold)) < 1e-6


