"""Build and use rollouts: the prompts the policy sees and the parsers for what it writes.

* **build**: K examples of a family (tool arguments -> answer) and a one-line hint; the reply is a JSON tool spec
  in a ```json block followed by the function in a ```python block (:func:`parse_build`).
* **use**: a question and the schema of a pooled tool (never its code); the reply is one
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and an ``Answer: ...`` line (:func:`parse_use`).
  The call runs in the sandbox and the tool's value is the answer; the ``Answer:`` line counts only when no call
  ran (one turn, see the recipe's docstring).
* **no tools** (baseline): the question alone; the ``Answer:`` line (or the last line) is the answer.

Also the supervised warm-start traces: :func:`reference_build_trace` writes the ideal build reply for a family
from its reference tool (only for training families, and only when a config asks for a warm start).
"""

from __future__ import annotations

import ast
import json
import re

from llmkit.tools.spec import ToolSpec
from llmkit.tools.tasks import Family, Instance

SYSTEM = "You are a careful programmer and problem solver."

BUILD_TEMPLATE = """Write a Python tool that solves this task: {hint}.
Examples (arguments -> answer):
{examples}

Reply with two blocks and nothing else:
1. a ```json block with the tool spec: {{"name": ..., "description": ..., "parameters": <JSON Schema object whose \
properties are exactly the argument names above>, "returns": <"integer"|"number"|"string"|"boolean"|"array">}}
2. a ```python block defining the function with the same name and parameters. Use only the standard library."""

USE_TEMPLATE = """{question}

You can call this tool:
{schema}

Reply with one call as <tool_call>{{"name": "{name}", "arguments": {{...}}}}</tool_call> and then a line \
"Answer: <answer>"."""

PLAIN_TEMPLATE = """{question}

End your reply with a line "Answer: <answer>"."""


def messages(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def build_prompt(family: Family, examples: list[Instance]) -> list[dict]:
    lines = "\n".join(f"{json.dumps(e.args)} -> {e.answer}" for e in examples)
    return messages(BUILD_TEMPLATE.format(hint=family.hint, examples=lines))


def use_prompt(instance: Instance, tool: ToolSpec) -> list[dict]:
    return messages(USE_TEMPLATE.format(question=instance.question.strip(), schema=tool.schema_text(),
                                        name=tool.name))


def plain_prompt(instance: Instance) -> list[dict]:
    return messages(PLAIN_TEMPLATE.format(question=instance.question.strip()))


# ---------------------------------------------------------------------------------------------- parsing
_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def _first_json_object(text: str):
    return next(_json_objects(text), None)


def parse_build(text: str) -> tuple[dict | None, str | None]:
    """(spec dict or None, code or None) from a build reply. Fenced blocks first (```json / ```python), then a
    bare JSON object and the text from the first ``def``/``import``."""
    spec, code = None, None
    for lang, body in _FENCE.findall(text):
        lang = lang.lower()
        if spec is None and lang in ("json", ""):
            try:
                obj = json.loads(body)
                if isinstance(obj, dict):
                    spec = obj
                    continue
            except json.JSONDecodeError:
                if lang == "json":
                    spec = _first_json_object(body)
                    continue
        if code is None and lang in ("python", "py", "") and re.search(r"^\s*def\s", body, re.MULTILINE):
            code = body
    if spec is None:
        spec = _first_json_object(text.split("```python")[0])
    if code is None:
        m = re.search(r"^(?:import .*\n|from .*\n)*def\s.*", text, re.MULTILINE | re.DOTALL)
        if m:
            code = m.group(0)
    if spec is not None and code is None and isinstance(spec.get("code"), str):
        code = spec["code"]
    return spec, code


def function_names(code: str) -> list[str]:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]


def spec_from_build(spec: dict | None, code: str | None) -> ToolSpec | None:
    """A ToolSpec from a parsed build reply (None when there is no code). A missing or broken spec keeps the code
    callable: the name falls back to the first function in the code, parameters to an empty object."""
    if code is None:
        return None
    spec = spec if isinstance(spec, dict) else {}
    fns = function_names(code)
    name = spec.get("name") if isinstance(spec.get("name"), str) else None
    if name is None and fns:
        name = fns[0]
    returns = spec.get("returns")
    return ToolSpec(name=name or "tool", parameters=spec.get("parameters", {}), code=code,
                    description=str(spec.get("description", "")),
                    returns=returns if isinstance(returns, str) or returns is None else str(returns))


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_ANSWER = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)


def _json_objects(text: str):
    """Every JSON object that starts somewhere in ``text`` (outer ones first, then nested ones)."""
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = dec.raw_decode(text[m.start():])
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj


_SCHEMA_WORDS = {"type", "properties", "required", "description", "items", "additionalProperties", "enum", "title",
                 "default", "minimum", "maximum"}
_JSON_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def _is_schema(d) -> bool:
    """A JSON Schema (what an echo of the tool's ``parameters`` looks like) rather than argument values: only schema
    keywords, with ``properties`` or a JSON type name as ``type``."""
    return (isinstance(d, dict) and bool(d) and set(d) <= _SCHEMA_WORDS
            and ("properties" in d or d.get("type") in _JSON_TYPES))


def _as_call(obj: dict) -> dict | None:
    """``{"name", "arguments"}`` from one JSON object, or None when it is not a call. ``arguments`` may be a JSON
    string (OpenAI style); ``parameters`` is accepted as the arguments (Llama style) unless it is a JSON Schema,
    which is what a model echoing the tool's schema writes (that is not a call)."""
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj and not _is_schema(obj["parameters"]):
        args = obj["parameters"]
    else:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    return {"name": obj.get("name"), "arguments": args}


def parse_use(text: str) -> tuple[dict | None, str | None]:
    """(call {"name", "arguments"} or None, final answer or None) from a use reply.

    The call is the first JSON object with ``arguments`` (or non-schema ``parameters``) inside a
    ``<tool_call>`` tag; without a tag, anywhere in the reply (so a call in a ```json fence, or bare, is read as
    well). An echoed schema (``parameters`` holding a JSON Schema) or a bare arguments object without a name is
    not a call."""
    call = None
    m = _CALL.search(text)
    for obj in _json_objects(m.group(1) if m else text):
        call = _as_call(obj)
        if call is not None:
            break
    return call, final_answer(text)


def final_answer(text: str) -> str | None:
    """The text after the last "Answer:", else the last non-empty line (outside a tool call)."""
    rest = _CALL.sub("", text)
    found = _ANSWER.findall(rest)
    if found:
        return found[-1].strip().strip("`*").strip()
    lines = [x.strip() for x in rest.strip().splitlines() if x.strip()]
    return lines[-1] if lines else None


# ---------------------------------------------------------------------------------------------- warm start
def reference_build_trace(family: Family) -> str:
    """The ideal build reply for ``family`` (its reference tool), for the documented supervised warm start."""
    t = family.reference
    spec = {"name": t.name, "description": t.description, "parameters": t.parameters, "returns": t.returns}
    return f"```json\n{json.dumps(spec)}\n```\n```python\n{t.code.strip()}\n```"


def reference_use_trace(instance: Instance, tool: ToolSpec) -> str:
    return (f'<tool_call>{json.dumps({"name": tool.name, "arguments": instance.args})}</tool_call>\n'
            f"Answer: {instance.answer}")
