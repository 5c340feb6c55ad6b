"""Teacher-forced capture of a response's hidden states (and token log-probs) in transformers.

A response is the last message of an OpenAI-style conversation. Its prompt is
the chat template applied to the earlier messages with the generation prompt,
exactly what an engine would have generated from; the response tokens follow.
One forward pass over prompt + response gives, for each chosen layer, the
states at the response positions (the "latent trajectory"), and, when asked,
the log-probability and predictive entropy of each response token (for the
perplexity baseline).

Layer ids index ``output_hidden_states``: 0 is the embedding output, ``l`` the
output of decoder block ``l`` (the last one has the final norm applied, as
transformers returns it).

Whole context. Every response token gets its state. When prompt + response exceed
``max_length`` the conversation is cut where it matters least for a guard: the leading
system messages (what the guard protects) and the latest turns (what the response
answers) stay, the oldest turns go first, and only then the middle of the last turn
(:func:`_cut_prompt`). A response too long for one pass is read in segments, each after
the cut prompt and the response tokens just before it (:func:`_pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Capture:
    """What one response looks like inside the model."""

    states: dict[int, torch.Tensor]  # layer -> (T, d) float32, T = response tokens kept
    token_logprobs: torch.Tensor | None = None  # (T,) log p(token | prefix)
    token_entropies: torch.Tensor | None = None  # (T,) entropy of the predictive distribution
    n_tokens: int = 0
    extra: dict = field(default_factory=dict)


def split_conversation(messages: list[dict]) -> tuple[list[dict], str]:
    """(prompt messages, response text); the last message must be the assistant's response."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise ValueError("the last message must be the assistant's response (role 'assistant')")
    if len(messages) < 2:
        raise ValueError("'messages' needs at least one message before the assistant's response")
    return messages[:-1], str(last.get("content") or "")


def default_layers(num_layers: int, count: int = 4) -> list[int]:
    """``count`` evenly spaced blocks over the second half of the network, the last one included."""
    count = max(1, min(count, num_layers))
    start = num_layers / 2
    ids = sorted({max(1, round(start + (num_layers - start) * (i + 1) / count)) for i in range(count)})
    return ids


def _backbone(model):
    base = getattr(model, model.base_model_prefix, None)
    return base if base is not None else model


def _leading_system(messages: list[dict]) -> int:
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    return n


def _cut_prompt(tokenizer, prompt_messages: list[dict], budget: int) -> tuple[list[int], int]:
    """The prompt's ids in at most ``budget`` tokens, and how many prompt tokens were dropped.

    A cut keeps what the guard exists to protect and what the response answers: the
    leading system messages and the latest turns. Whole turns (a user message and what
    follows it) are dropped oldest first; when the latest turn alone is still too long,
    the middle of the prompt goes: the system part's tokens are kept at the front and
    the rest is filled from the end (the latest words and the generation prompt).
    """
    from llmkit.generation import encode_chat

    budget = max(1, budget)
    full = encode_chat(tokenizer, prompt_messages)
    if len(full) <= budget:
        return full, 0
    n_sys = _leading_system(prompt_messages)
    system, rest = prompt_messages[:n_sys], list(prompt_messages[n_sys:])
    ids = full
    while len(ids) > budget:
        starts = [i for i, m in enumerate(rest) if i > 0 and m.get("role") == "user"]
        if not starts:
            break
        rest = rest[starts[0]:]  # the oldest turn goes whole
        try:
            ids = encode_chat(tokenizer, system + rest)
        except Exception:  # noqa: BLE001 - a template that rejects the shortened history: cut tokens instead
            ids = full
            break
    if len(ids) <= budget:
        return ids, len(full) - len(ids)
    head: list[int] = []
    if system:
        try:
            sys_ids = encode_chat(tokenizer, system, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a template that needs a user turn: no separable system part
            sys_ids = []
        if sys_ids and ids[: len(sys_ids)] == sys_ids:
            head = sys_ids
    # the end of the prompt (generation prompt included) keeps at least a quarter of the budget
    n_head = min(len(head), budget - min(max(1, budget // 4), len(ids) - len(head)))
    n_tail = budget - max(0, n_head)
    kept = ids[: max(0, n_head)] + ids[len(ids) - n_tail :]
    return kept, len(full) - len(kept)


def _pieces(tokenizer, prompt_messages, response, max_length, max_response_tokens=None
            ) -> tuple[list[tuple[list[int], int, int]], int, int]:
    """The forward passes that together give every response token a state: ``[(ids, lo, hi)], n_tokens, cut``.

    The states of rows ``lo:hi`` of each piece, in order, are the response's. A response that fits
    beside its (possibly cut) prompt is one piece. A response longer than three quarters of
    ``max_length`` is split into segments of ``max_length // 2`` tokens, each read after the cut
    prompt (a quarter of ``max_length``) and the response tokens just before it. An empty
    response is the state at the last prompt token. ``cut``: prompt tokens left out (most in any piece).
    """
    from llmkit.generation import encode_text

    # content is text: a special-token string in a message or the response is not a control token here
    # either, so the guard reads the same tokens the server generated from
    r_ids = encode_text(tokenizer, response)[:max_response_tokens]
    n = len(r_ids)
    if n == 0:
        p_ids, cut = _cut_prompt(tokenizer, prompt_messages, max_length)
        return [(p_ids, len(p_ids) - 1, len(p_ids))], 0, cut
    if n <= max(1, 3 * max_length // 4):
        p_ids, cut = _cut_prompt(tokenizer, prompt_messages, max_length - n)
        return [(p_ids + r_ids, len(p_ids), len(p_ids) + n)], n, cut
    seg = max(1, max_length // 2)
    p_ids, cut = _cut_prompt(tokenizer, prompt_messages, max(1, max_length // 4))
    pieces = []
    for a in range(0, n, seg):
        b = min(n, a + seg)
        back = min(a, max_length - len(p_ids) - (b - a))  # the response just before the segment
        lo = len(p_ids) + back
        pieces.append((p_ids + r_ids[a - back : b], lo, lo + b - a))
    return pieces, n, cut


class _StopForward(Exception):
    """Raised by the tap on the highest needed block: the rest of the network is not run."""


def _layer_module(base, num_layers: int, layer: int):
    """The module whose output is ``output_hidden_states[layer]``."""
    if layer == 0:
        return base.embed_tokens
    if layer == num_layers and getattr(base, "norm", None) is not None:
        return base.norm
    return base.layers[layer - 1]


class _Taps:
    """Forward hooks that keep the outputs of the chosen layers, for the calling thread only.

    With ``stop=True`` and a highest layer below the last, the forward is cut after
    that block (:class:`_StopForward`), so deeper blocks and the final norm are not
    computed. Hooks on a shared model see every thread's forwards (the server's
    batcher runs beside the guard), so a hook ignores forwards of other threads.
    """

    def __init__(self, model, layers: list[int], stop: bool = True):
        import threading

        self.base = _backbone(model)
        self.n = model.config.num_hidden_layers
        self.layers = sorted(set(layers))
        self.top = max(self.layers)
        self.truncates = stop and self.top < self.n
        self.states: dict[int, torch.Tensor] = {}
        self._tid = threading.get_ident()
        self._handles = []

    def __enter__(self):
        for l in self.layers:
            last = self.truncates and l == self.top
            self._handles.append(_layer_module(self.base, self.n, l).register_forward_hook(self._hook(l, last)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer, last):
        import threading

        def hook(_module, _inputs, output):
            if threading.get_ident() != self._tid:
                return
            self.states[layer] = output[0] if isinstance(output, tuple) else output
            if last:
                raise _StopForward

        return hook

    def run(self, **inputs) -> dict[int, torch.Tensor]:
        """One forward of the backbone (no LM head); returns {layer: (B, W, d)}."""
        self.states = {}
        try:
            _backbone_call(self.base, **inputs)
        except _StopForward:
            pass
        return self.states


def _backbone_call(base, **inputs):
    inputs.setdefault("use_cache", False)
    return base(**inputs)


@torch.inference_mode()
def capture(model, tokenizer, conversations: list[list[dict]], layers: list[int], *,
            with_logprobs: bool = False, batch_size: int = 8, max_length: int = 1024,
            max_response_tokens: int | None = None, progress: bool = False) -> list[Capture]:
    """One :class:`Capture` per conversation (each ending with the assistant's response).

    Every response token gets a state (``max_response_tokens`` keeps only the first ones,
    for callers that want that). A conversation longer than ``max_length`` tokens is cut
    the way :func:`_cut_prompt` says (system prompt and latest turns kept); a response too
    long for one pass is read in overlapping segments (:func:`_pieces`).
    ``Capture.extra["prompt_tokens_cut"]`` says how many prompt tokens were left out.
    An empty response is represented by the state at the last prompt token (the position
    that chose to stop), so every capture has at least one row. Only the backbone runs
    (never the LM head, except on the response rows for ``with_logprobs``), and it stops
    after the highest requested block.
    """
    from tqdm.auto import tqdm

    n_hidden = model.config.num_hidden_layers
    bad = [l for l in layers if not 0 <= l <= n_hidden]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{n_hidden} for this model")
    if max_length < 8:
        raise ValueError(f"max_length must be at least 8 tokens, got {max_length}")
    # rows: (conversation, ids, lo, hi); a conversation's rows hold its response's states in order
    rows, meta = [], []
    for ci, conv in enumerate(conversations):
        prompt_messages, response = split_conversation(conv)
        pieces, n_tok, cut = _pieces(tokenizer, prompt_messages, response, max_length, max_response_tokens)
        meta.append((n_tok, cut))
        rows += [(ci, ids, lo, hi) for ids, lo, hi in pieces]
    order = sorted(range(len(rows)), key=lambda j: len(rows[j][1]))
    seen: dict[int, int] = {}
    slot = []  # each row's place among its conversation's pieces
    for ci, *_ in rows:
        slot.append(seen.get(ci, 0))
        seen[ci] = slot[-1] + 1
    parts: list[list] = [[None] * seen.get(ci, 0) for ci in range(len(conversations))]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    head = model.get_output_embeddings()
    tap_layers = sorted(set(layers) | ({n_hidden} if with_logprobs else set()))
    bar = tqdm(total=len(rows), desc="guard capture", disable=not progress, unit="pass")
    with _Taps(model, tap_layers) as taps:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            seqs = [rows[j][1] for j in idx]
            width = max(len(s) for s in seqs)
            # right padding keeps position ids 0..n-1 for every row, as in an unpadded pass
            ids = torch.full((len(seqs), width), pad, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
                mask[r, : len(s)] = 1
            hs = taps.run(input_ids=ids.to(device), attention_mask=mask.to(device))
            for r, j in enumerate(idx):
                ci, _, lo, hi = rows[j]
                # copies: a view would keep the whole batch's hidden states alive as long as the capture
                part = {"states": {l: hs[l][r, lo:hi].to("cpu", torch.float32, copy=True) for l in layers}}
                if with_logprobs and meta[ci][0]:
                    # position t predicts token t+1: tokens lo..hi-1 are predicted from lo-1 .. hi-2
                    logits = head(hs[n_hidden][r, lo - 1 : hi - 1]).float()
                    logp = torch.log_softmax(logits, dim=-1)
                    target = ids[r, lo:hi].to(logp.device)
                    part["logprobs"] = logp.gather(1, target[:, None])[:, 0].cpu()
                    part["entropies"] = -(logp.exp() * logp).sum(-1).cpu()
                parts[ci][slot[j]] = part
            bar.update(len(idx))
    bar.close()
    out = []
    for ci, ps in enumerate(parts):
        n_tok, cut = meta[ci]
        cap = Capture(states={l: torch.cat([p["states"][l] for p in ps]) if len(ps) > 1 else ps[0]["states"][l]
                              for l in layers}, n_tokens=n_tok, extra={"prompt_tokens_cut": cut})
        if with_logprobs:
            cap.token_logprobs = torch.cat([p["logprobs"] for p in ps]) if n_tok else torch.zeros(0)
            cap.token_entropies = torch.cat([p["entropies"] for p in ps]) if n_tok else torch.zeros(0)
        out.append(cap)
    return out


@dataclass
class Prefill:
    """The prompt's KV cache (blocks up to the highest guard layer), computed before the response exists.

    The server starts it when a request arrives, so the prompt's share of the
    teacher-forced pass runs while the engine generates; :func:`capture_after_prefill`
    then feeds only the response tokens.
    """

    ids: list[int]
    cache: object
    last: dict[int, torch.Tensor]  # layer -> (1, d) state at the last prompt position
    layers: list[int]


@torch.inference_mode()
def prefill(model, tokenizer, prompt_messages: list[dict], layers: list[int], *,
            max_length: int = 1024) -> Prefill | None:
    """Run the prompt through the blocks the guard needs; ``None`` when it is too long to keep whole."""
    from transformers import DynamicCache

    from llmkit.generation import encode_chat

    p_ids = encode_chat(tokenizer, prompt_messages)
    if not p_ids or len(p_ids) >= max_length:
        return None
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with _Taps(model, layers) as taps:
        hs = taps.run(input_ids=torch.tensor([p_ids], device=device), past_key_values=cache, use_cache=True)
    return Prefill(ids=list(p_ids), cache=cache, last={l: hs[l][0, -1:].float().cpu() for l in layers},
                   layers=sorted(layers))


@torch.inference_mode()
def capture_after_prefill(model, tokenizer, pre: Prefill, response: str, layers: list[int], *,
                          max_length: int = 1024, max_response_tokens: int | None = None) -> Capture | None:
    """The :func:`capture` of prompt + ``response`` from a :class:`Prefill` of the prompt.

    Returns ``None`` when :func:`capture` would cut the prompt (prompt + response
    longer than ``max_length``) or the prefill lacks a layer: the caller then runs
    the whole pass.
    """
    import copy

    from llmkit.generation import encode_text

    r_ids = encode_text(tokenizer, response)[:max_response_tokens]
    if len(pre.ids) + len(r_ids) > max_length or max(layers) > max(pre.layers):
        return None
    if not r_ids:
        return Capture(states={l: pre.last[l] for l in layers}, n_tokens=0)
    p_len, r_len = len(pre.ids), len(r_ids)
    device = next(model.parameters()).device
    cache = copy.deepcopy(pre.cache)  # the prefill may serve several choices (n > 1)
    with _Taps(model, layers) as taps:
        hs = taps.run(input_ids=torch.tensor([r_ids], device=device),
                      attention_mask=torch.ones((1, p_len + r_len), dtype=torch.long, device=device),
                      position_ids=torch.arange(p_len, p_len + r_len, device=device)[None],
                      past_key_values=cache, use_cache=True)
    return Capture(states={l: hs[l][0].float().cpu() for l in layers}, n_tokens=r_len)


class GenerationRecorder:
    """Record the guard layers' states while the transformers engine generates (no extra forward pass).

    Each engine call runs one prefill forward per batch (all prompt positions,
    left-padded) and then one forward per new token, fed the tokens chosen last:
    the step that feeds response token ``k`` yields its states, which is where a
    teacher-forced pass would put them. The last token of a response cut by the
    length limit is never fed back, so it has no state (the teacher-forced pass
    would have one more row). Layer ``l`` is recorded at the output of block
    ``l - 1``, the final norm for the last layer, and the embeddings for 0, so the
    values equal ``output_hidden_states[l]``. Only forwards of the thread that
    entered the recorder are kept (a server's batcher may run beside it).

    Which tensor row belongs to which completion (:meth:`captures`):

    - the prefill's unpadded input ids must equal the chunk's prompts in order
      (an engine that reorders prompts, or splits the call into other batches, is
      detected here);
    - while every step has all the batch's rows (``model.generate``: finished rows
      stay in the batch), row ``r`` of each step is completion ``r``;
    - llmkit's greedy loop (``hf_batcher.greedy_generate``) drops finished rows at
      once and keeps the order of the others. Row ``i`` is fed ``f_i`` tokens:
      ``completion_tokens`` when it ended at EOS, one less when cut by the length
      limit; so step ``t`` holds, in order, the completions with ``f_i > t``. This
      is checked against every step's width. A row cut by a stop string ran past
      the cut (until the match was certain) and its completion no longer says how
      far, so with stop strings a batch whose rows left at different steps is not
      mapped.

    A batch that cannot be mapped this way gets ``None`` captures: the caller runs
    the teacher-forced pass for those responses instead.
    """

    def __init__(self, model, layers: list[int]):
        import threading

        self.model, self.layers = model, layers
        # per engine batch: {"prompts": [[ids]] | None, "last_prompt": {l: (B, d)}, "steps": [{l: (B_t, d)}]}
        self.chunks: list[dict] = []
        self._step: dict[int, torch.Tensor] = {}
        self._handles = []
        self._tid = threading.get_ident()

    def __enter__(self):
        base = _backbone(self.model)
        n = self.model.config.num_hidden_layers
        for l in self.layers:
            self._handles.append(_layer_module(base, n, l).register_forward_hook(self._hook(l)))
        self._handles.append(base.register_forward_hook(self._end_of_forward, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer):
        import threading

        def hook(_module, _inputs, output):
            if threading.get_ident() != self._tid:
                return
            out = output[0] if isinstance(output, tuple) else output
            self._step[layer] = out.detach()

        return hook

    def _end_of_forward(self, _module, args, kwargs, _output):
        import threading

        if threading.get_ident() != self._tid:
            return
        step, self._step = self._step, {}
        if not step:
            return
        width = next(iter(step.values())).shape[1]
        if width > 1 or not self.chunks:  # a prefill starts a new batch
            self.chunks.append({"prompts": _unpadded_ids(args, kwargs),
                                "last_prompt": {l: s[:, -1].float().cpu() for l, s in step.items()},
                                "steps": []})
        else:
            self.chunks[-1]["steps"].append({l: s[:, 0].float().cpu() for l, s in step.items()})

    def captures(self, completions, prompt_ids: list[list[list[int]]], stop: bool = False
                 ) -> list[Capture | None]:
        """One Capture per completion (``None`` where the rows cannot be mapped, see the class doc).

        ``prompt_ids`` holds, per engine call in order, the token ids of its prompts;
        ``stop``: whether stop strings were in force.
        """
        total = sum(len(p) for p in prompt_ids)
        if len(completions) != total or len(prompt_ids) != len(self.chunks):
            return [None] * len(completions)  # not one recorded batch per engine call
        out: list[Capture | None] = []
        k = 0
        for chunk, prompts in zip(self.chunks, prompt_ids):
            comps = completions[k : k + len(prompts)]
            k += len(prompts)
            rows = _row_map(chunk, prompts, comps, stop)
            if rows is None:
                out += [None] * len(comps)
                continue
            for i, comp in enumerate(comps):
                steps = rows[i]
                n = min(comp.completion_tokens, len(steps))
                if n == 0:
                    states = {l: chunk["last_prompt"][l][i : i + 1] for l in self.layers}
                else:
                    states = {l: torch.stack([chunk["steps"][t][l][steps[t]] for t in range(n)])
                              for l in self.layers}
                out.append(Capture(states=states, n_tokens=comp.completion_tokens))
        return out


def _unpadded_ids(args, kwargs) -> list[list[int]] | None:
    """The prefill's prompts (padding removed by the attention mask), or None when not passed as ids."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    mask = kwargs.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    if mask is None or not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        return [row.tolist() for row in ids]
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def _row_map(chunk: dict, prompts: list[list[int]], comps, stop: bool) -> list[list[int]] | None:
    """Per completion, its tensor row at each recorded step; None when that cannot be established."""
    if chunk["prompts"] != [list(p) for p in prompts]:
        return None  # prompts reordered, batched differently, or not seen
    size = len(prompts)
    widths = [next(iter(s.values())).shape[0] for s in chunk["steps"]]
    if all(w == size for w in widths):  # no row left the batch: rows keep their index
        return [[i] * len(widths) for i in range(size)]
    if stop:
        return None  # a stop-string row ran on past its cut for an unknown number of steps
    fed = [c.completion_tokens - (c.finish_reason == "length") for c in comps]
    rows: list[list[int]] = [[] for _ in range(size)]
    for t, w in enumerate(widths):
        active = [i for i in range(size) if fed[i] > t]
        if len(active) != w:
            return None
        for r, i in enumerate(active):
            rows[i].append(r)
    if any(len(rows[i]) < fed[i] for i in range(size)):
        return None
    return rows
