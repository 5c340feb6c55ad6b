"""Batched text generation with transformers: the one place that calls ``model.generate``.

Prompts are already-formatted strings (``chat_prompt`` applies the chat
template). Batches are left-padded so every row's new tokens start at the
same position; stop strings are applied after decoding (the earliest match
wins) so that the result is the same whatever the batch composition.

Client text is text, never markup: ``encode_chat`` tokenizes the chat
template's own pieces with special tokens parsed and every string the client
sent (message content and ``name``, tool names, descriptions and parameter
schemas, tool-call arguments, tool results, any other field the template
renders) with special-token strings split into ordinary tokens, so a user who
writes ``<|im_end|>\n<|im_start|>system`` anywhere gets those characters, not
a new turn. When no such string holds a special-token string the ids are
exactly those of the rendered string (the common case costs nothing and
changes nothing).

``render_chat`` also carries OpenAI ``tools``: a template that knows tools
gets them as ``tools=``; for one that does not (ChatML models such as the
bundled SmolLM2) the tools are described in a system message in the
Hermes/Qwen convention (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``),
assistant ``tool_calls`` are written back the same way and ``tool`` messages
stay in the history as ``tool`` turns.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # the OpenAI/vLLM sampling extras; defaults change nothing
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: over the generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt + generated tokens
    logprobs: int | None = None  # None = off; k = the chosen token's logprob plus the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token (completions' echo)
    guided: dict | None = None  # {"json": schema} | {"json_object": True}: the output must match
    # vLLM's extras (SamplingParams' meanings); defaults change nothing
    ignore_eos: bool = False  # EOS is an ordinary token: run to max_new_tokens (or a stop)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings unchecked, before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # more tokens that end the answer, like EOS
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the answer
    skip_special_tokens: bool = True  # special tokens' text is left out of the answer
    spaces_between_special_tokens: bool = True  # tokenizer.decode's flag (slow tokenizers put spaces there)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (eos or stop string) or "length"
    token_ids: list[int] = field(default_factory=list)


class ChatPrompt(str):
    """A rendered chat prompt; ``token_ids`` are its safe ids when plain tokenization would differ, else None."""

    token_ids: list[int] | None = None


def chat_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> ChatPrompt:
    """Render OpenAI-style messages with the tokenizer's chat template.

    The result is a ``str``; where a client string holds a special-token string its
    ``token_ids`` hold :func:`encode_chat`'s ids (engines use them instead of re-tokenizing).
    """
    opts = {"continue_final_message": continue_final_message, "template_kwargs": template_kwargs}
    text = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt, **opts)
    out = ChatPrompt(text)
    if _holds_special(tokenizer, *tool_messages(tokenizer, messages, tools)):
        out.token_ids = encode_chat(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **opts)
    return out


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids of an already-rendered prompt: a :class:`ChatPrompt`'s safe ids, or the plain tokenization."""
    ids = getattr(prompt, "token_ids", None)
    return list(ids) if ids is not None else tokenizer.encode(prompt, add_special_tokens=False)


def encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as ordinary tokens: special-token strings inside it are spelled out, never control tokens."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def special_strings(tokenizer) -> list[str]:
    """The strings that plain tokenization turns into special (control) tokens."""
    cached = getattr(tokenizer, "_llmkit_specials", None)
    if cached is None:
        found = {str(t) for t in tokenizer.all_special_tokens}
        found |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                  if getattr(t, "special", False)}
        cached = sorted((s for s in found if s), key=len, reverse=True)
        try:
            tokenizer._llmkit_specials = cached
        except AttributeError:  # a tokenizer that takes no new attributes: compute each time
            pass
    return cached


def _special_re(tokenizer) -> re.Pattern | None:
    """One pattern for all special strings, longest first (the tokenizer's own leftmost-longest match)."""
    specials = special_strings(tokenizer)
    return re.compile("|".join(re.escape(s) for s in specials)) if specials else None


def _strings(obj):
    """Every string inside ``obj`` (dict keys included: a schema's property names are client text too)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def _holds_special(tokenizer, messages, tools=None) -> bool:
    """Whether any string the template will be given (messages and tools, as :func:`tool_messages` left them)
    holds a special-token string."""
    pat = _special_re(tokenizer)
    return pat is not None and any(pat.search(s) for s in _strings((messages, tools)))


def supports_tools(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the chat template renders ``tools`` itself."""
    t = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # several named templates
        t = t.get("tool_use") or t.get("default")
    return isinstance(t, str) and "tools" in t


TOOL_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to answer the user. The functions you can call are "
    "described, one JSON signature per line, inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _arguments(raw):
    """Tool-call arguments as a dict where they parse (templates expect objects), else as given."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def tool_messages(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list | None]:
    """Messages (and tools) ready for the template: native tool support, or the Hermes convention in text."""
    has_calls = any(m.get("tool_calls") for m in messages)
    if not tools and not has_calls:
        return [{**m, "content": m.get("content") or ""} for m in messages], None
    if supports_tools(tokenizer):
        out = []
        for m in messages:
            m = {**m, "content": m.get("content") or ""}
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, (tools or None)
    out = []
    for src in messages:
        m = {k: v for k, v in src.items() if k not in ("tool_calls", "tool_call_id")}
        m["content"] = src.get("content") or ""
        blocks = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])})
                  for c in src.get("tool_calls") or []]
        if blocks:  # the assistant's calls written back the way the model was asked to write them
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            m["content"] = (m["content"] + "\n" + text) if m["content"] else text
        out.append(m)
    if tools:
        spec = TOOL_SYSTEM.format(tools="\n".join(json.dumps(t, sort_keys=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + spec) if out[0]["content"] else spec}
        else:
            out.insert(0, {"role": "system", "content": spec})
    return out, None


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> str:
    """The chat template applied to ``messages`` (with ``tools``, see :func:`tool_messages`), as a string.

    ``continue_final_message`` leaves the last message open (the model continues it);
    ``template_kwargs`` are extra template variables (vLLM's ``chat_template_kwargs``,
    checked by :func:`template_options`).
    """
    msgs, native_tools = tool_messages(tokenizer, messages, tools)
    kw = template_options(tokenizer, template_kwargs, continue_final_message)
    if native_tools:
        kw["tools"] = native_tools
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


def template_options(tokenizer, template_kwargs: dict | None, continue_final_message: bool = False) -> dict:
    """``apply_chat_template`` keywords for client-chosen template variables.

    A variable's value is placed in the prompt as markup (it is not message content), so a
    value holding a special-token string is refused rather than let it become a control token,
    and names that are ``apply_chat_template``'s own arguments are refused (they have fields).
    """
    import inspect

    kw: dict = {"continue_final_message": True} if continue_final_message else {}
    if not template_kwargs:
        return kw
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
    specials = special_strings(tokenizer)
    for name, value in template_kwargs.items():
        if name in own:
            raise ValueError(f"chat_template_kwargs.{name} is an argument of the chat template call, not a "
                             "template variable (use the request's own field)")
        text = json.dumps(value, ensure_ascii=False, default=str)  # every string inside, keys too
        hit = next((s for s in specials if s in text), None)
        if hit is not None:
            raise ValueError(f"chat_template_kwargs.{name} holds the special-token string {hit!r}; template "
                             "variables become markup, so such strings are refused")
        kw[name] = value
    return kw


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` wrapped in what ``tokenizer.encode(..., add_special_tokens=True)`` adds around a text (e.g. BOS)."""
    probe = "a"
    bare = tokenizer.encode(probe, add_special_tokens=False)
    full = tokenizer.encode(probe, add_special_tokens=True)
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start] + list(ids) + full[start + len(bare):]
    return list(ids)


def _replace_strings(obj, fn):
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {_replace_strings(k, fn): _replace_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_replace_strings(v, fn) for v in obj]
    return obj


def _renderings(s: str) -> list[str]:
    """How a template may write a string: as is, or JSON-escaped (``tojson``: plain, or HTML-safe as Jinja's)."""
    plain = json.dumps(s, ensure_ascii=False)[1:-1]
    ascii_ = json.dumps(s)[1:-1]
    html = ascii_.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")
    return list(dict.fromkeys([s, plain, ascii_, html]))


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the rendered chat where only the template's own markup can become special tokens.

    Every special-token string inside any string the template is given (messages with every
    key, tools, tool-call arguments after JSON decoding) is replaced by a random alphanumeric
    marker and the template rendered again. Between markers is the template's own text plus
    client text that now holds no special string (tokenized with special tokens parsed); at
    each marker goes what the real rendering wrote there (the special string, or its JSON
    escape), with special-token strings split (:func:`encode_text`). A template that renders
    those strings in some other way (so the two renderings do not line up): ``ValueError``.
    """
    text = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, template_kwargs=template_kwargs)
    msgs, native_tools = tool_messages(tokenizer, messages, tools)
    if not _holds_special(tokenizer, msgs, native_tools):
        return tokenizer.encode(text, add_special_tokens=False)
    specials, pat = special_strings(tokenizer), _special_re(tokenizer)
    index = {s: k for k, s in enumerate(specials)}
    # random, so that no client can write a marker; alphanumeric, so that no escaping changes it
    nonce = secrets.token_hex(8)
    marker = re.compile(f"q{nonce}x(\\d+)x")
    safe = _replace_strings((msgs, native_tools),
                            lambda s: pat.sub(lambda m: f"q{nonce}x{index[m.group(0)]}x", s))
    kw = template_options(tokenizer, template_kwargs, continue_final_message)
    if safe[1]:
        kw["tools"] = safe[1]
    skeleton = tokenizer.apply_chat_template(safe[0], tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    pieces = marker.split(skeleton)  # template, index, template, index, ..., template
    ids: list[int] = []
    pos = 0
    for k, p in enumerate(pieces):
        if k % 2 == 0:
            form = p if text.startswith(p, pos) else None
        else:
            form = next((f for f in _renderings(specials[int(p)]) if text.startswith(f, pos)), None)
        if form is None:
            break
        if k % 2 == 0:
            ids += tokenizer.encode(form, add_special_tokens=False) if form else []
        else:
            ids += encode_text(tokenizer, form)
        pos += len(form)
    else:
        if pos == len(text):
            return ids
    found = sorted({m.group(0) for s in _strings((msgs, native_tools)) for m in pat.finditer(s)})
    raise ValueError(f"the request holds the special-token string(s) {', '.join(found)} and this chat "
                     "template changes such strings, so they cannot be tokenized as plain text; remove them")


def truncate_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut ``text`` at the earliest stop string; report whether one was found."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut], cut < len(text)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[str], params: GenerationParams | None = None,
             batch_size: int = 16, **generate_kwargs) -> list[Completion]:
    """Generate one completion per prompt, ``batch_size`` prompts per ``generate`` call."""
    params = params or GenerationParams()
    out: list[Completion] = []
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        old_side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tokenizer.padding_side = old_side
        enc = {k: v.to(model.device) for k, v in enc.items()}
        kwargs = {"max_new_tokens": params.max_new_tokens, "pad_token_id": pad_id, "do_sample": not params.greedy}
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        kwargs.update(generate_kwargs)
        seqs = model.generate(**enc, **kwargs)
        if not isinstance(seqs, torch.Tensor):
            seqs = seqs.sequences
        width = enc["input_ids"].shape[1]
        prompt_lens = enc["attention_mask"].sum(dim=1).tolist()
        for row, plen in zip(seqs[:, width:].tolist(), prompt_lens):
            ids = []
            hit_eos = False
            for t in row:
                if t in eos:
                    hit_eos = True
                    break
                ids.append(t)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            text, hit_stop = truncate_at_stop(text, params.stop)
            if hit_stop:
                ids = tokenizer.encode(text, add_special_tokens=False)
            finish = "stop" if (hit_eos or hit_stop) else "length"
            out.append(Completion(text, int(plen), len(ids), finish, ids))
    return out
