"""The OpenAI wire format: request validation, response bodies, error bodies.

Requests are validated strictly (a string where a number belongs is an error,
as with OpenAI, not silently coerced). A field this server does not know, or
knows but cannot honour (``logit_bias``, ``best_of`` > 1, ``suffix``,
``store: true``, ...), is a 400 naming the field: a request is never answered
as if a field it sent had been applied when it was not. Fields set to their
"off" value (``null``, ``{}``, ``false``) are accepted. Every error is
``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

vLLM's extra fields are honoured with vLLM's meanings (its
``entrypoints/openai`` protocol): ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``truncate_prompt_tokens`` (with
``truncation_side``, default left: the last tokens are kept),
``add_special_tokens``; on chat also ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``. ``/tokenize`` and
``/detokenize`` take vLLM's bodies (``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``DetokenizeRequest``).

Tool calls: the model is asked (by the chat template, or by llmkit's tool
system prompt, see ``llmkit.generation.render_chat``) to answer
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``parse_tool_calls``
turns such blocks (or an answer that is one bare ``{"name", "arguments"}``
object, as Llama 3 and the forced ``tool_choice`` path write them) into
OpenAI ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 16
MAX_STOP = 4
MAX_PROMPTS = 64
MAX_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        headers = headers or None
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Lenient(BaseModel):  # nested objects whose extra keys the OpenAI API itself tolerates
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, v):
        # a message echoed back from a response carries null fields (refusal, audio, ...): nothing to honour
        if isinstance(v, dict):
            return {k: x for k, x in v.items() if x is not None or k in ("content",)}
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict:
        """The message as chat templates take it (tool calls and ids kept)."""
        m: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Lenient):
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    def guided(self) -> dict | None:
        """The engines' guided-decoding request (``GenerationParams.guided``), None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return {"json": self.json_schema.schema_}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extra; -1 and 0 mean off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    response_format: ResponseFormat | None = None
    # vLLM's extras (vllm.entrypoints.openai.*.protocol), with vLLM's defaults
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # known OpenAI fields accepted only at their "off" value (anything else is a 400 naming the field)
    logit_bias: dict | None = None
    metadata: dict | None = None
    store: bool | None = None
    best_of: int | None = None
    service_tier: str | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot honour."""
        if self.logit_bias:
            return "logit_bias"
        if self.store:
            return "store"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier"
        return None

    def sampling(self) -> dict:
        """The sampling extras as ``GenerationParams`` keywords."""
        return {"top_k": max(self.top_k, 0), "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                "stop_token_ids": list(self.stop_token_ids or []),
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens}

    @model_validator(mode="after")
    def _min_tokens(self):
        asked = self.requested_max_tokens()
        if asked is not None and self.min_tokens > asked:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({asked})")
        return self

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class _ChatTemplateOptions(_Strict):
    """The chat-template fields vLLM takes on chat completions and chat ``/tokenize``."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # BOS etc. on top of the template's own (vLLM's default for chat: no)
    chat_template_kwargs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _continue(cls, v):
        # as in vLLM, both on is an error; continuing the final message alone turns the generation prompt off
        if isinstance(v, dict) and v.get("continue_final_message"):
            if v.get("add_generation_prompt"):
                raise ValueError("cannot set both continue_final_message and add_generation_prompt to true")
            v = {**v, "add_generation_prompt": False}
        return v

    def template_options(self) -> dict:
        """``Engine.encode_chat`` keywords."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "template_kwargs": self.chat_template_kwargs}


class ChatRequest(_ChatTemplateOptions, _Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tools(self):
        if self.top_logprobs is not None and not self.logprobs and self.top_logprobs > 0:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, ToolChoiceFunction):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def active_tools(self) -> list[dict] | None:
        """The tools the model sees (none with tool_choice 'none')."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's default for completions: the tokenizer's BOS etc. are added

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        items = [v] if isinstance(v, str) else v
        if not items or (isinstance(items[0], int)):
            items = [items]
        if len(items) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if any(len(p) == 0 for p in items):
            raise ValueError("prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


class _Tokenize(_Strict):
    model: str | None = None
    return_token_strs: bool | None = False

    def unsupported(self) -> str | None:
        return None


class TokenizeCompletionRequest(_Tokenize):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_ChatTemplateOptions, _Tokenize):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

    def unsupported(self) -> str | None:
        return None


def parse(model_cls: type[_Sampling], body) -> _Sampling:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        errs = e.errors()
        # a field this server does not know comes first: it is the clearest thing to fix
        extra = [x for x in errs if x["type"] == "extra_forbidden"]
        err = extra[0] if extra else errs[0]
        where = ".".join(str(x) for x in err["loc"] if not str(x).startswith(
            ("function-", "list[", "str", "int", "literal[", "ToolChoiceFunction", "dict[")))
        # unions report one error per branch; the first names the field and what was wrong
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "field required"
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"'{where}' is not supported by this server (it would be ignored, so the "
                           "request is refused)", param=where, code="unsupported_parameter") from None
        raise APIError(400, f"invalid '{where}': {msg}" if where else msg, param=where or None,
                       code="invalid_value") from None
    bad = req.unsupported()
    if bad is not None:
        raise APIError(400, f"'{bad}' = {getattr(req, bad)!r} is not supported by this server (only its default "
                       "is accepted)", param=bad, code="unsupported_parameter")
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# -- tool calls ---------------------------------------------------------------------------------------------

_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(obj, names) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_id("call"), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


def parse_tool_calls(text: str, names: list[str] | None) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` from a generated answer; no calls leaves the text as content.

    Recognised: ``<tool_call>{json}</tool_call>`` blocks (Hermes/Qwen; the rest of the text is
    the content), or an answer that is a single ``{"name": ..., "arguments": {...}}`` object
    (or a list of them). Only calls of offered tools (``names``) count; a block that does not
    parse leaves the whole answer as content.
    """
    if "<tool_call>" in text:
        calls = []
        for m in _TOOL_BLOCK.finditer(text):
            try:
                c = _call(json.loads(m.group(1)), names)
            except ValueError:
                c = None
            if c is None:
                return text, []
            calls.append(c)
        content = _TOOL_BLOCK.sub("", text).strip()
        return (content or None), calls
    s = text.strip()
    if s[:1] in "{[":
        try:
            obj = json.loads(s)
        except ValueError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call(o, names) for o in items]
        if calls and all(c is not None for c in calls):
            return None, calls
    return text, []


def forced_tool_schema(tools: list[dict], name: str | None) -> dict:
    """The JSON schema of one call ``{"name", "arguments"}`` to tool ``name`` (any offered tool if None)."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                          "arguments": f.get("parameters") or {"type": "object"}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_info(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and its bytes; a piece of a multi-byte character gets its own bytes, not U+FFFD's."""
    text = tokenizer.decode([int(token_id)])
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str) and piece:
        m = _HEX_BYTE.fullmatch(piece)  # SentencePiece byte fallback
        if m:
            return text, [int(m.group(1), 16)]
        if all(ch in _BYTES for ch in piece):  # byte-level BPE
            raw = bytes(_BYTES[ch] for ch in piece)
            if "\ufffd" in text or raw.decode("utf-8", "replace") == text:
                return text, list(raw)
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer, entries) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for t, lp, top in entries:
        text, raw = token_info(tokenizer, t)
        tops = []
        for tid, tlp in top:
            ttext, traw = token_info(tokenizer, tid)
            tops.append({"token": ttext, "logprob": _finite(tlp), "bytes": traw})
        content.append({"token": text, "logprob": _finite(lp), "bytes": raw, "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tokenizer, entries, offset0: int = 0) -> dict:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset (None entry = first prompt token)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset0
    for e in entries:
        t = e[0] if e is not None else None
        text = token_info(tokenizer, t)[0] if t is not None else ""
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if e is None or e[1] is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(_finite(e[1]))
            top: dict[str, float] = {}
            for tid, tlp in e[2]:
                top.setdefault(token_info(tokenizer, tid)[0], _finite(tlp))
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _finite(x: float) -> float:
    return x if x > -1e30 else -9999.0  # JSON has no -inf; OpenAI clients expect a number

