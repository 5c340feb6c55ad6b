"""SMITH's three reward axes: schema, code, outcome. Each is its own TRL reward function returning ``None`` where it
does not apply, so each failure mode gets its own (group-normalized, with ``normalize_then_sum``) gradient.

Rows carry ``kind`` ("build" | "use"), ``family``, ``seed`` and, for use rows, ``instance`` (JSON: question,
args, answer) and ``tool`` (JSON ToolSpec of the pooled tool shown in the prompt).

build rows (the reply is a spec + code; the code runs in the sandbox on ``checks`` fresh instances):
  * schema  = 0.5 [the parameters are a valid JSON Schema object] + 0.5 [no schema error at all: it matches the
    function's real signature and its properties are the task's argument names]
  * code    = share of fresh instances where the function ran without error within the limits and returned the
    declared type (``returns``; any JSON value when the spec is missing). No code at all: 0.
  * outcome = share of fresh instances whose value is exactly right (the family's exact verifier).
  A broken schema lowers only the schema axis: the code still runs on the instances' arguments.
use rows (the reply is a call + an answer; the call runs the pooled tool in the sandbox):
  * schema  = 1 if the call names the tool and its arguments validate against the tool's schema, else 0
  * code    = 1 if the tool ran without error and returned its declared type, else 0; None when no call was made
  * outcome = exact verifier on the tool's value (or, when no call ran, on the reply's "Answer:" line)

Scores for a (completion, row) pair are computed once and cached, so the three functions share one sandbox run.
:class:`SmithRewards` also reports every build that passes (outcome >= ``pass_threshold``) to ``on_pass`` (the
trainer adds it to the pool). Module-level :func:`schema_reward`, :func:`code_reward`, :func:`outcome_reward` use a
default instance without a pool.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from llmkit.rewards.correctness import completion_text
from llmkit.tools import sandbox, tasks
from llmkit.tools.rollouts import parse_build, parse_use, spec_from_build
from llmkit.tools.spec import ToolSpec, value_matches

CHECK_SEED_OFFSET = 2 * tasks.EVAL_SEED_OFFSET  # build checks: fresh, and never the evaluation instances


@dataclass
class AxisScores:
    schema: float | None
    code: float | None
    outcome: float | None
    spec: ToolSpec | None = None
    detail: dict = field(default_factory=dict)


def _schema_valid(params) -> bool:
    import jsonschema

    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(
            params.get("properties"), dict):
        return False
    try:
        jsonschema.Draft202012Validator.check_schema(params)
        return True
    except jsonschema.SchemaError:
        return False


def score_build(text: str, family: str, seed: int, *, checks: int = 4,
                limits: sandbox.Limits | None = None, unsafe: bool = False) -> AxisScores:
    fam = tasks.get(family)
    spec_d, code = parse_build(text)
    spec = spec_from_build(spec_d, code)
    insts = fam.generate(checks, seed=CHECK_SEED_OFFSET + int(seed))
    arg_names = set(insts[0].args) if insts else set()
    if spec_d is None and spec is None:
        return AxisScores(0.0, 0.0, 0.0, None, {"error": "no tool spec and no code"})
    params = spec_d.get("parameters") if isinstance(spec_d, dict) else None
    valid = _schema_valid(params)
    errs = (spec.schema_errors() if spec is not None and spec_d is not None
            else ["no spec" if spec_d is None else "no code"])
    if valid and set(params["properties"]) != arg_names:
        errs.append(f"properties {sorted(params['properties'])} are not the task's arguments {sorted(arg_names)}")
    schema = 0.5 * valid + 0.5 * (valid and not errs)
    if spec is None:
        return AxisScores(schema, 0.0, 0.0, None, {"schema_errors": errs, "error": "no code"})
    from llmkit.tools.rollouts import function_names

    fns = function_names(spec.code)
    run_name = spec.name if spec.name in fns or not fns else fns[0]
    results = sandbox.run_calls(spec.code, run_name, [i.args for i in insts], limits or sandbox.Limits(timeout=2.0),
                                unsafe=unsafe)
    returns = spec.returns if spec_d is not None and spec.returns in (
        "integer", "number", "string", "boolean", "array", "object") else None
    ran = [r.ok and value_matches(r.value, returns) for r in results]
    right = [r.ok and fam.verify(fam.to_answer(r.value), i) for r, i in zip(results, insts)]
    n = max(len(insts), 1)
    return AxisScores(schema, sum(ran) / n, sum(right) / n, spec,
                      {"schema_errors": errs, "errors": [r.error for r in results if not r.ok][:2]})


def score_use(text: str, family: str, instance: tasks.Instance, tool: ToolSpec, *,
              limits: sandbox.Limits | None = None, unsafe: bool = False) -> AxisScores:
    fam = tasks.get(family)
    call, answer = parse_use(text)
    if call is None:
        return AxisScores(0.0, None, float(fam.verify(answer, instance)), None, {"error": "no tool call"})
    args = call.get("arguments")
    errs = [] if call.get("name") == tool.name else [f"called {call.get('name')!r}, not {tool.name!r}"]
    errs += tool.call_errors(args)
    schema = 0.0 if errs else 1.0
    if not isinstance(args, dict):
        return AxisScores(schema, 0.0, float(fam.verify(answer, instance)), None, {"call_errors": errs})
    r = sandbox.run_function(tool.code, tool.name, args, limits or sandbox.Limits(timeout=2.0), unsafe=unsafe)
    code = float(r.ok and value_matches(r.value, tool.returns))
    final = fam.to_answer(r.value) if r.ok else answer
    return AxisScores(schema, code, float(fam.verify(final, instance)), None,
                      {"call_errors": errs, "tool_error": r.error, "answer": final})


def _json(v):
    if isinstance(v, str):
        return json.loads(v) if v else None
    return v


def _col(values, i):
    return values[i] if isinstance(values, (list, tuple)) else values


class SmithRewards:
    """The three axes as TRL reward functions sharing one cache; ``on_pass(spec, family, score, step)`` sees every
    build whose outcome reaches ``pass_threshold``."""

    def __init__(self, *, checks: int = 4, pass_threshold: float = 1.0, limits: sandbox.Limits | None = None,
                 on_pass: Callable | None = None, unsafe: bool = False, cache_size: int = 4096):
        self.checks, self.pass_threshold, self.on_pass, self.unsafe = checks, pass_threshold, on_pass, unsafe
        self.limits = limits or sandbox.Limits(timeout=2.0)
        self._cache: OrderedDict = OrderedDict()
        self.cache_size = cache_size

        def schema(completions=None, **kw):
            return self._axis("schema", completions, kw)

        def code(completions=None, **kw):
            return self._axis("code", completions, kw)

        def outcome(completions=None, **kw):
            return self._axis("outcome", completions, kw)

        schema.__name__, code.__name__, outcome.__name__ = "schema_reward", "code_reward", "outcome_reward"
        self.schema_reward, self.code_reward, self.outcome_reward = schema, code, outcome

    @property
    def funcs(self) -> list[Callable]:
        return [self.schema_reward, self.code_reward, self.outcome_reward]

    def score(self, text: str, kind: str, family: str, seed: int = 0, instance=None, tool=None,
              step: int = -1) -> AxisScores:
        key = (text, kind, family, int(seed or 0), json.dumps(_json(instance), sort_keys=True),
               json.dumps(_json(tool), sort_keys=True))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if kind == "build":
            s = score_build(text, family, int(seed or 0), checks=self.checks, limits=self.limits, unsafe=self.unsafe)
            if (self.on_pass is not None and s.spec is not None and s.outcome is not None
                    and s.outcome >= self.pass_threshold and not s.detail.get("schema_errors")):
                self.on_pass(s.spec, family, s.outcome, step)
        elif kind == "use":
            inst = _json(instance)
            s = score_use(text, family, tasks.Instance(family, inst["question"], inst["args"], inst["answer"]),
                          ToolSpec.from_dict(_json(tool)), limits=self.limits, unsafe=self.unsafe)
        else:
            s = AxisScores(None, None, None)
        self._cache[key] = s
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return s

    def _axis(self, axis: str, completions, kw) -> list[float | None]:
        out = []
        state = kw.get("trainer_state")
        step = int(getattr(state, "global_step", -1)) if state is not None else -1
        for i, c in enumerate(completions or []):
            kind = _col(kw.get("kind"), i)
            if kind not in ("build", "use"):
                out.append(None)
                continue
            s = self.score(completion_text(c), kind, _col(kw.get("family"), i), _col(kw.get("seed"), i) or 0,
                           _col(kw.get("instance"), i), _col(kw.get("tool"), i), step)
            out.append(getattr(s, axis))
        return out


_DEFAULT = SmithRewards()
schema_reward = _DEFAULT.schema_reward
code_reward = _DEFAULT.code_reward
outcome_reward = _DEFAULT.outcome_reward


def combined_reward(completions=None, **kw) -> list[float | None]:
    """The single-scalar ablation: schema + code + outcome summed (missing axes count 0) before any
    normalization, so one advantage mixes all three failure modes."""
    parts = [f(completions=completions, **kw) for f in (schema_reward, code_reward, outcome_reward)]
    return [None if all(p[i] is None for p in parts) else sum(p[i] or 0.0 for p in parts)
            for i in range(len(parts[0]))]
