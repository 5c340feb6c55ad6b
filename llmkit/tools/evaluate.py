"""Writing tools with a model and answering held-out questions with pooled tools (``llmkit tools build|eval``,
``bench/smith.py``).

A *generator* maps a list of chat conversations to one reply each. :func:`local_generator` runs a local model
(alias, folder or hub id, or an already loaded model) with transformers (greedy replies are memoized per prompt, so
make a new generator after the model changes); :func:`openai_generator` calls any
OpenAI-compatible endpoint (``base_url``; the key from ``OPENAI_API_KEY`` if set, since the sandbox never sees
the host's environment this is safe).

* :func:`build_tools`: for each family, ``attempts`` build prompts with K examples; each reply is scored by
  :func:`llmkit.rewards.tools.score_build` on fresh instances and the best passing one (outcome >= ``min_score``)
  joins the pool with provenance.
* :func:`build_verified_rate`: the share of build attempts (``attempts`` per family, fresh examples each) whose
  reply becomes a verified tool (it would join the pool), with every failed attempt put in one bucket: ``no_spec``
  (no JSON spec parsed), ``no_code``, ``schema`` (the spec's schema is invalid or does not match the signature or
  the task's arguments), ``crash`` (the code did not run or returned the wrong type on some check), ``wrong`` (ran,
  but some answer was wrong). Measures the writer before and after a warm start (``bench/smith.py``).
* :func:`evaluate` answers ``n`` evaluation instances per family: with the pool's best tool for the family
  (a use rollout whose call runs in the sandbox), with the reference tool (``mode="reference"``), or with no tool
  (``mode="none"``, also the fallback for a family without a pooled tool). Accuracy is the exact verifier's;
  ``macro`` is the mean over families. Where a tool is shown, ``call_parse_rate`` is the share of replies holding
  a parseable call (a JSON object with dict arguments, :func:`llmkit.tools.rollouts.parse_use`) and
  ``call_valid_rate`` the share whose call names the tool and validates against its schema. ``n_per_family``
  and ``correct_per_family`` are the counts behind the accuracies, and ``macro_ci`` the exact (Clopper-Pearson)
  binomial interval of the macro (:func:`macro_interval`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tqdm.auto import tqdm

from llmkit.rewards.tools import score_build, score_use
from llmkit.tools import tasks
from llmkit.tools.pool import ToolPool
from llmkit.tools.rollouts import build_prompt, final_answer, parse_use, plain_prompt, use_prompt
from llmkit.tools.sandbox import Limits

Generator = Callable[[list[list[dict]]], list[str]]


def local_generator(model, tokenizer=None, *, max_new_tokens: int = 256, temperature: float = 0.0,
                    batch_size: int = 8, seed: int | None = 0) -> Generator:
    """A generator over a local model: a name/path (loaded with ``llmkit.models.load``) or a loaded model."""
    from llmkit.generation import GenerationParams, chat_prompt, generate

    if isinstance(model, (str, os.PathLike)):
        from llmkit.models import load

        model, tokenizer = load(str(model))
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    memo: dict[str, str] = {}

    def gen(convs: list[list[dict]]) -> list[str]:
        prompts = [chat_prompt(tokenizer, c) for c in convs]
        if temperature > 0:
            return [c.text for c in generate(model, tokenizer, prompts, params, batch_size=batch_size)]
        # greedy: a prompt asked again (e.g. the no-tool fallback of a family without a pooled tool, in several
        # conditions) is answered from the memo; the model must not change while this generator is in use
        todo = list(dict.fromkeys(p for p in prompts if p not in memo))
        if todo:
            memo.update(zip(todo, (c.text for c in generate(model, tokenizer, todo, params, batch_size=batch_size))))
        return [memo[p] for p in prompts]

    return gen


def openai_generator(model: str, base_url: str | None = None, *, max_new_tokens: int = 256,
                     temperature: float = 0.0, api_key: str | None = None) -> Generator:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none")

    def gen(convs: list[list[dict]]) -> list[str]:
        out = []
        for c in convs:
            r = client.chat.completions.create(model=model, messages=c, max_tokens=max_new_tokens,
                                               temperature=temperature)
            out.append(r.choices[0].message.content or "")
        return out

    return gen


def build_tools(gen: Generator, families, pool: ToolPool, *, examples: int = 3, attempts: int = 1,
                checks: int = 8, min_score: float = 1.0, source: str = "", step: int = -1, seed: int = 0,
                limits: Limits | None = None, unsafe: bool = False, progress: bool = True) -> dict:
    """Ask ``gen`` to write a tool per family; add the best verified one to ``pool``. Returns, per family, the
    best attempt's axis scores and whether it joined the pool."""
    report = {}
    families = list(families)
    convs, owners = [], []
    for fam_name in families:  # one generation call for every family and attempt (batched)
        fam = tasks.get(fam_name)
        for a in range(attempts):
            convs.append(build_prompt(fam, fam.generate(examples, seed=seed + 7919 * a)))
            owners.append((fam_name, a))
    replies = gen(convs)
    best: dict = {}
    for (fam_name, a), text in tqdm(list(zip(owners, replies)), desc="verify builds", disable=not progress):
        s = score_build(text, fam_name, seed + a, checks=checks, limits=limits, unsafe=unsafe)
        b = best.get(fam_name)
        if b is None or (s.outcome, s.code, s.schema) > (b[0].outcome, b[0].code, b[0].schema):
            best[fam_name] = (s, text)
    for fam_name in families:
        s, text = best[fam_name]
        added = bool(s.spec is not None and s.outcome >= min_score and not s.detail.get("schema_errors"))
        if added:
            pool.add(s.spec, fam_name, s.outcome, step=step, source=source)
        report[fam_name] = {"schema": s.schema, "code": s.code, "outcome": s.outcome, "added": added,
                            "reply": text[:2000]}
    return report


BUILD_FAILURES = ("no_spec", "no_code", "schema", "crash", "wrong")


def classify_build(s) -> str:
    """``verified`` or the first failure bucket of :data:`BUILD_FAILURES` for a :func:`score_build` result."""
    errs = s.detail.get("schema_errors") or []
    if s.spec is None:  # no code: with a parsed spec "no_code", with nothing at all "no_spec"
        return "no_spec" if s.detail.get("error") == "no tool spec and no code" else "no_code"
    if "no spec" in errs:
        return "no_spec"
    if errs:
        return "schema"
    if s.code < 1.0:
        return "crash"
    if s.outcome < 1.0:
        return "wrong"
    return "verified"


def build_verified_rate(gen: Generator, families, *, attempts: int = 2, examples: int = 3, checks: int = 4,
                        seed: int = 0, limits: Limits | None = None, unsafe: bool = False,
                        progress: bool = True) -> dict:
    """Share of build attempts that yield a verified tool (outcome 1 on ``checks`` fresh instances, no schema
    error), per family and over all; ``failures`` counts the failed attempts per bucket (:func:`classify_build`).
    Examples come from training seeds ``seed + 7919 * a`` (never evaluation or check instances)."""
    families = list(families)
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    convs, owners = [], []
    for fam_name in families:
        fam = tasks.get(fam_name)
        for a in range(attempts):
            convs.append(build_prompt(fam, fam.generate(examples, seed=seed + 7919 * a)))
            owners.append((fam_name, a))
    replies = gen(convs)
    per_family: dict = {f: [] for f in families}
    failures = dict.fromkeys(BUILD_FAILURES, 0)
    samples: dict = {}
    for (fam_name, a), text in tqdm(list(zip(owners, replies)), desc="verify builds", disable=not progress):
        s = score_build(text, fam_name, seed + a, checks=checks, limits=limits, unsafe=unsafe)
        verdict = classify_build(s)
        per_family[fam_name].append(verdict == "verified")
        if verdict != "verified":
            failures[verdict] += 1
        samples.setdefault(fam_name, {"verdict": verdict, "schema": s.schema, "code": s.code,
                                      "outcome": s.outcome, "reply": text[:1200],
                                      "errors": [str(e)[:200] for e in (s.detail.get("schema_errors") or [])
                                                 + (s.detail.get("errors") or [])][:3]})
    total = sum(len(v) for v in per_family.values())
    return {"rate": sum(sum(v) for v in per_family.values()) / max(total, 1), "attempts": total,
            "per_family": {f: sum(v) / len(v) for f, v in per_family.items()}, "failures": failures,
            "samples": samples}


def evaluate(gen: Generator, families, *, pool: ToolPool | None = None, mode: str = "pool", n: int = 10,
             seed_offset: int = tasks.EVAL_SEED_OFFSET, limits: Limits | None = None, unsafe: bool = False,
             progress: bool = True) -> dict:
    """Held-out accuracy per family and its macro average. ``mode``: pool | reference | none."""
    if mode not in ("pool", "reference", "none"):
        raise ValueError(f"mode must be pool, reference or none, got '{mode}'")
    per_family, used_tool = {}, {}
    convs, jobs = [], []
    for fam_name in families:  # all prompts of all families go to the generator in one call (batched)
        fam = tasks.get(fam_name)
        insts = fam.generate(n, seed=seed_offset)
        tool = None
        if mode == "reference":
            tool = fam.reference
        elif mode == "pool" and pool is not None:
            e = pool.best(fam_name)
            tool = e.spec if e else None
        used_tool[fam_name] = tool is not None
        for i in insts:
            convs.append(plain_prompt(i) if tool is None else use_prompt(i, tool))
            jobs.append((fam, i, tool))
    replies = gen(convs)
    right: dict = {f: [] for f in used_tool}
    parsed, valid, samples = [], [], {}
    for (fam, inst, tool), r in tqdm(list(zip(jobs, replies)), desc=f"score ({mode})", disable=not progress):
        if tool is None:
            ok = fam.verify(final_answer(r), inst)
        else:
            s = score_use(r, fam.name, inst, tool, limits=limits, unsafe=unsafe)
            ok = bool(s.outcome)
            call = parse_use(r)[0]
            parsed.append(call is not None and isinstance(call.get("arguments"), dict))
            valid.append(s.schema == 1.0)
        right[fam.name].append(ok)
        samples.setdefault(fam.name, r[:600])
    per_family = {f: sum(v) / max(len(v), 1) for f, v in right.items()}
    macro = sum(per_family.values()) / max(len(per_family), 1)
    counts, correct = {f: len(v) for f, v in right.items()}, {f: sum(v) for f, v in right.items()}
    return {"mode": mode, "per_family": per_family, "macro": macro, "used_tool": used_tool, "n": n,
            "n_per_family": counts, "correct_per_family": correct, "macro_ci": macro_interval(correct, counts),
            "call_parse_rate": sum(parsed) / len(parsed) if parsed else None,
            "call_valid_rate": sum(valid) / len(valid) if valid else None, "sample_replies": samples}


def macro_interval(correct: dict, n: dict, level: float = 0.95) -> list[float] | None:
    """``[lo, hi]``: the exact binomial (Clopper-Pearson, scipy's ``binomtest(...).proportion_ci``) interval of the
    macro accuracy. With the same number of questions in every family the macro IS the pooled proportion of
    ``sum(correct)`` in ``sum(n)`` independent questions, so the interval is exact; with unequal counts the macro
    is not a binomial proportion and this returns None. Also None when no question was asked."""
    from scipy.stats import binomtest

    counts = set(n.values())
    if len(counts) != 1 or not sum(n.values()):
        return None
    ci = binomtest(int(sum(correct.values())), int(sum(n.values()))).proportion_ci(confidence_level=level)
    return [float(ci.low), float(ci.high)]
