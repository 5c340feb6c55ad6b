"""The tool format: a JSON Schema for the parameters plus one Python function, checked without running it.

A :class:`ToolSpec` is what a build rollout must produce and what the pool stores::

    {"name": "gcd_of", "description": "...", "returns": "integer",
     "parameters": {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
                    "required": ["numbers"]},
     "code": "def gcd_of(numbers):\\n    ..."}

:meth:`ToolSpec.schema_errors` validates the schema with ``jsonschema`` (the metaschema of draft 2020-12, and the
shape a function-calling schema needs: an object with named properties) and against the function's real signature,
read with ``ast`` from the code (the code is never executed on the host): every schema property is a parameter and
every parameter without a default is a property and is required; ``*args``/``**kwargs`` are refused; where the
code annotates a parameter, the annotation must agree with the schema type. :meth:`ToolSpec.call_errors` checks a
call's arguments against the schema; :func:`value_matches` checks a returned value against the declared
``returns`` type.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

import jsonschema

JSON_TYPES = ("integer", "number", "string", "boolean", "array", "object", "null")
# Python annotation name -> JSON Schema types it agrees with
_ANNOTATION_TYPES = {"int": {"integer"}, "float": {"number", "integer"}, "str": {"string"}, "bool": {"boolean"},
                     "list": {"array"}, "List": {"array"}, "tuple": {"array"}, "Sequence": {"array"},
                     "dict": {"object"}, "Dict": {"object"}, "Mapping": {"object"}}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


@dataclass
class ToolSpec:
    name: str
    parameters: dict
    code: str
    description: str = ""
    returns: str | None = None  # a JSON Schema type name, or None for "anything JSON"
    meta: dict = field(default_factory=dict)  # free-form (family, notes); not part of the identity

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ToolSpec:
        if not isinstance(d, dict):
            raise ValueError("a tool must be a JSON object")  # noqa: TRY004 (bad input: callers catch ValueError)
        missing = [k for k in ("name", "parameters", "code") if k not in d]
        if missing:
            raise ValueError(f"tool is missing {', '.join(missing)}")
        return cls(name=str(d["name"]), parameters=d["parameters"], code=str(d["code"]),
                   description=str(d.get("description", "")), returns=d.get("returns"), meta=dict(d.get("meta") or {}))

    def fingerprint(self) -> str:
        blob = json.dumps([self.name, self.parameters, self.code, self.returns], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def to_openai(self) -> dict:
        """The OpenAI / TRL function-calling form (name, description, parameters)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def schema_text(self) -> str:
        """What a use prompt shows: name, description, parameters and return type (no code)."""
        return json.dumps({"name": self.name, "description": self.description, "parameters": self.parameters,
                           "returns": self.returns}, indent=1)

    # ------------------------------------------------------------------ checks
    def signature(self) -> tuple[list[str], set[str], dict[str, str]] | None:
        """(parameter names, names with defaults, name -> annotation) of the top-level ``def name``; None if absent
        or the code does not parse. Raises ValueError for ``*args`` / ``**kwargs``."""
        try:
            tree = ast.parse(self.code)
        except (SyntaxError, ValueError):
            return None
        fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and n.name == self.name), None)
        if fn is None:
            return None
        a = fn.args
        if a.vararg or a.kwarg:
            raise ValueError("the function takes *args/**kwargs; a tool's parameters must be named")
        positional = a.posonlyargs + a.args
        names = [x.arg for x in positional + a.kwonlyargs]
        defaults = {x.arg for x in positional[len(positional) - len(a.defaults):]} if a.defaults else set()
        defaults |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
        ann = {}
        for x in positional + a.kwonlyargs:
            if x.annotation is not None:
                node = x.annotation.value if isinstance(x.annotation, ast.Subscript) else x.annotation
                ann[x.arg] = node.id if isinstance(node, ast.Name) else (
                    node.attr if isinstance(node, ast.Attribute) else ast.unparse(node))
        return names, defaults, ann

    def schema_errors(self) -> list[str]:
        """Everything wrong with the schema (empty list: valid and matching the function's signature)."""
        errs: list[str] = []
        if not _NAME_RE.match(self.name or ""):
            errs.append(f"tool name {self.name!r} is not a Python identifier")
        p = self.parameters
        if not isinstance(p, dict):
            return errs + ["parameters must be a JSON object (a JSON Schema)"]
        try:
            jsonschema.Draft202012Validator.check_schema(p)
        except jsonschema.SchemaError as e:
            errs.append(f"parameters is not a valid JSON Schema: {e.message}")
        if p.get("type") != "object":
            errs.append('parameters must have "type": "object"')
        props = p.get("properties")
        if not isinstance(props, dict):
            errs.append("parameters must list the arguments under properties")
            props = {}
        required = p.get("required", [])
        if not isinstance(required, list):
            errs.append("required must be a list")
            required = []
        for k, v in props.items():
            if not isinstance(v, dict) or "type" not in v:
                errs.append(f"property {k!r} has no type")
            elif not set([v["type"]] if isinstance(v["type"], str) else v["type"]) <= set(JSON_TYPES):
                errs.append(f"property {k!r} has an unknown type {v['type']!r}")
        if any(r not in props for r in required):
            errs.append(f"required names unknown properties: {[r for r in required if r not in props]}")
        if self.returns is not None and self.returns not in JSON_TYPES:
            errs.append(f"returns must be one of {', '.join(JSON_TYPES)}, got {self.returns!r}")
        try:
            sig = self.signature()
        except ValueError as e:
            return errs + [str(e)]
        if sig is None:
            return errs + [f"the code does not define a function named {self.name!r} (or does not parse)"]
        names, defaults, ann = sig
        if set(names) != set(props):
            errs.append(f"signature parameters {names} differ from schema properties {sorted(props)}")
        no_default = [n for n in names if n not in defaults]
        if any(n not in required for n in no_default if n in props):
            errs.append(f"parameters without defaults must be required: {[n for n in no_default if n not in required]}")
        for n, a in ann.items():
            want = _ANNOTATION_TYPES.get(a)
            t = props.get(n, {}).get("type") if isinstance(props.get(n), dict) else None
            ts = set([t] if isinstance(t, str) else (t or []))
            if want and ts and not (ts & want):
                errs.append(f"parameter {n!r} is annotated {a} but the schema says {t}")
        return errs

    def call_errors(self, args) -> list[str]:
        """Errors of a call's arguments against the schema (empty: the call validates)."""
        if not isinstance(args, dict):
            return ["arguments must be a JSON object"]
        try:
            v = jsonschema.Draft202012Validator(self.parameters)
            return [e.message for e in v.iter_errors(args)]
        except (jsonschema.SchemaError, TypeError, AttributeError) as e:
            return [f"the tool's schema is unusable: {e}"]


def value_matches(value, returns: str | None) -> bool:
    """Whether a returned (JSON-decoded) value has the declared JSON Schema type (None: any value)."""
    if returns is None:
        return True
    if returns not in JSON_TYPES:
        return False
    return jsonschema.Draft202012Validator({"type": returns}).is_valid(value)


def python_type_to_json(name: str | None) -> str | None:
    return {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "list": "array",
            "tuple": "array", "dict": "object", "NoneType": "null"}.get(name or "")
