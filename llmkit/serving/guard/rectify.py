"""Latent rectification: watch the chaos score while generating, and steer back when it crosses the threshold.

AEO ("Asymmetric Entropic Optimization", NeurIPS 2026) gates "a lightweight post-hoc correction
module" with the chaos score and reports it lifts IHEval instruction following without
finetuning; the abstract does not describe the module. This is the in-latent-space
version: no second prompt, no second generation.

Algorithm (greedy decoding, transformers model, one ``generate`` call per batch):

1. Forward hooks record, at every decoding step, the state of the token just fed at each
   guard layer: the same rows a teacher-forced pass over the response would give.
2. A logits processor (it runs after every forward) scores each unfinished, not yet
   rectified row's trajectory so far with the guard's own score (whichever kind it was
   fitted with, calibrated and windowed as the guard scores: past one window this is the
   running maximum over the windows so far) once it has ``min_tokens`` tokens, then every
   ``check_every`` steps.
3. When a row's score exceeds the threshold (the guard's, set on held-out compliant
   responses), it is *rectified* from the next token on: at each steering layer ``l``
   (the guard layers that are block outputs, i.e. all but the final-norm one) a fixed
   shift ``alpha * (mu_l - m_l)`` is added to that row's residual stream, where ``mu_l``
   is the compliant manifold's mean and ``m_l`` the mean of the row's trajectory so far
   at that layer. It removes a fraction ``alpha`` of the trajectory's drift away from the
   compliant manifold while keeping each token's own variation; the row then continues.

Rows never rectified are exactly the greedy generation (the hooks only read), so "no
correction" and "latent correction" differ only where the guard fired.

Deviations: the paper's correction module is unspecified (only that the chaos score gates
it); the shift toward the compliant mean is our choice (a mean-difference steering vector
as in activation steering). Prompt tokens are never steered, and a row is rectified once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmkit.serving.guard.capture import Capture, _backbone, _layer_module


@dataclass
class Rectified:
    text: str
    completion: object  # llmkit.generation.Completion
    triggered_at: int | None  # tokens generated when the guard fired (None: never)
    trigger_score: float | None


class _Monitor:
    """Records guard-layer states per step, scores rows, and holds the per-row steering shifts."""

    def __init__(self, model, guard, width: int, batch: int, eos: set[int], *, threshold: float, alpha: float,
                 min_tokens: int, check_every: int, steer_layers: list[int]):
        self.guard, self.width, self.eos = guard, width, eos
        self.threshold, self.alpha = threshold, alpha
        self.min_tokens, self.check_every = max(1, min_tokens), max(1, check_every)
        self.steps: dict[int, list[torch.Tensor]] = {l: [] for l in guard.layers}
        self.shift: dict[int, torch.Tensor | None] = dict.fromkeys(steer_layers)
        self.triggered: list[int | None] = [None] * batch
        self.trigger_score: list[float | None] = [None] * batch
        self.batch = batch
        base = _backbone(model)
        n = model.config.num_hidden_layers
        self.handles = []
        for l in steer_layers:  # steering first, so the recorders see what the next block sees
            self.handles.append(_layer_module(base, n, l).register_forward_hook(self._steer_hook(l), prepend=True))
        for l in guard.layers:
            self.handles.append(_layer_module(base, n, l).register_forward_hook(self._record_hook(l)))

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _record_hook(self, layer):
        def hook(_m, _i, output):
            out = output[0] if isinstance(output, tuple) else output
            if out.shape[1] == 1:  # decoding step: the state of the token just fed
                self.steps[layer].append(out[:, 0].detach().float().cpu())

        return hook

    def _steer_hook(self, layer):
        def hook(_m, _i, output):
            shift = self.shift[layer]
            out = output[0] if isinstance(output, tuple) else output
            if shift is None or out.shape[1] != 1:
                return None
            new = out + shift.to(out)[:, None, :]
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.width  # tokens generated so far = states recorded so far
        if t < self.min_tokens or (t - self.min_tokens) % self.check_every:
            return scores
        gen = input_ids[:, self.width :].tolist()
        for r in range(self.batch):
            if self.triggered[r] is not None or any(tok in self.eos for tok in gen[r]):
                continue
            cap = Capture(states={l: torch.stack([s[r] for s in self.steps[l][:t]]) for l in self.guard.layers},
                          n_tokens=t)
            score = float(self.guard.score_captures([cap])[0])
            if score > self.threshold:
                self.fire(r, t, score, cap.states)
        return scores

    def fire(self, r: int, t: int, score: float, states: dict[int, torch.Tensor]):
        """Mark row ``r`` rectified after ``t`` tokens; its shift removes ``alpha`` of the drift of ``states[l][:t]``."""
        self.triggered[r], self.trigger_score[r] = t, score
        for l in self.shift:
            mu = self.guard.manifolds[l].mean.double()
            if self.shift[l] is None:
                self.shift[l] = torch.zeros(self.batch, mu.numel(), dtype=torch.float64)
            self.shift[l][r] = self.alpha * (mu - states[l][:t].double().mean(0))


@torch.inference_mode()
def generate_rectified(model, tokenizer, guard, prompts_messages: list[list[dict]], params, *,
                       alpha: float = 0.5, min_tokens: int = 8, check_every: int = 4,
                       threshold: float | None = None, steer_layers: list[int] | None = None,
                       batch_size: int = 8, progress: bool = False) -> list[Rectified]:
    """Greedy generation with the guard watching and latent rectification (see the module docstring).

    ``alpha`` is the fraction of the trajectory's drift removed once the guard fires (0: watch
    only); ``threshold`` defaults to the guard's. Returns one :class:`Rectified` per prompt.
    """
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    from llmkit.generation import _eos_ids, chat_prompt, generate

    if not params.greedy:
        raise ValueError("latent rectification is implemented for greedy decoding (temperature 0)")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (the fraction of the drift removed), got {alpha}")
    guard._check_model(model)
    n = model.config.num_hidden_layers
    if steer_layers is None:  # the final-norm layer (n) is not a block output a hook can shift
        steer = [l for l in guard.layers if 1 <= l < n]
    else:
        steer = list(steer_layers)
        bad = [l for l in steer if l not in guard.manifolds or not 1 <= l < n]
        if bad:
            raise ValueError(f"steering layers {bad} are not guard layers that are block outputs "
                             f"({[l for l in guard.layers if 1 <= l < n]}): the shift needs their means")
    thr = guard.threshold if threshold is None else float(threshold)
    eos = _eos_ids(model, tokenizer)
    prompts = [chat_prompt(tokenizer, m) for m in prompts_messages]
    out: list[Rectified] = []
    bar = tqdm(total=len(prompts), desc="rectified generation", disable=not progress, unit="resp")
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        old = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            width = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)["input_ids"].shape[1]
        finally:
            tokenizer.padding_side = old
        mon = _Monitor(model, guard, width, len(chunk), eos, threshold=thr, alpha=alpha, min_tokens=min_tokens,
                       check_every=check_every, steer_layers=steer if alpha > 0 else [])
        try:
            comps = generate(model, tokenizer, chunk, params, batch_size=len(chunk),
                             logits_processor=LogitsProcessorList([mon]))
        finally:
            mon.close()
        out += [Rectified(c.text, c, mon.triggered[i], mon.trigger_score[i]) for i, c in enumerate(comps)]
        bar.update(len(chunk))
    bar.close()
    return out


def trigger_point(guard, cap: Capture, *, threshold: float, min_tokens: int = 8, check_every: int = 4,
                  max_new_tokens: int | None = None) -> tuple[int | None, float | None]:
    """Where :func:`generate_rectified` would fire on a response it generated itself.

    ``cap`` is the teacher-forced capture of the response (its guard-layer states): the
    monitor's running score after ``t`` tokens is the guard's score of the first ``t`` rows,
    checked at ``min_tokens``, then every ``check_every`` tokens, while the row is unfinished
    (at most ``n_tokens`` tokens, and the last token of a ``max_new_tokens``-long answer is
    never followed by a check). Returns ``(t, score)`` or ``(None, None)``.
    """
    last = cap.n_tokens if max_new_tokens is None else min(cap.n_tokens, max_new_tokens - 1)
    for t in range(max(1, min_tokens), last + 1, max(1, check_every)):
        part = Capture(states={l: cap.states[l][:t] for l in guard.layers}, n_tokens=t)
        score = float(guard.score_captures([part])[0])
        if score > threshold:
            return t, score
    return None, None


@torch.inference_mode()
def rectify_from_captures(model, tokenizer, guard, prompts_messages: list[list[dict]], responses: list[str],
                          captures: list[Capture], params, *, alpha: float = 0.5, min_tokens: int = 8,
                          check_every: int = 4, threshold: float | None = None, steer_layers: list[int] | None = None,
                          response_ids: list[list[int]] | None = None, batch_size: int = 8,
                          progress: bool = False) -> list[Rectified]:
    """:func:`generate_rectified` for answers already generated greedily, without generating the unflagged ones.

    Until the guard fires, rectified generation *is* greedy generation (the hooks only read), so
    its result is determined by the plain answer: the trigger point is found on the answer's
    teacher-forced ``captures`` (:func:`trigger_point`), an answer the guard never fires on is
    returned as it is, and a flagged one keeps its first ``t`` tokens and continues from there with
    the shift ``alpha * (mu_l - m_l)`` of the first ``t`` states, exactly as the live monitor would
    (the token chosen at the trigger comes from unsteered states, every later one from steered
    states). ``responses`` must be the texts the captures were taken of (``capture`` encodes them with
    ``encode_text``; pass ``response_ids`` when the captures were taken of other ids, such as the ids a
    model generated that do not survive a decode/encode round trip). With answers served by
    another engine (vLLM), the continuation also switches engine: run it with ``alpha=0`` too to
    separate the steering from the switch. ``completion`` of an unflagged result is ``None``.
    """
    from tqdm.auto import tqdm

    from llmkit.generation import Completion, _eos_ids, encode_chat, encode_text

    if not params.greedy:
        raise ValueError("latent rectification is implemented for greedy decoding (temperature 0)")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (the fraction of the drift removed), got {alpha}")
    if not len(prompts_messages) == len(responses) == len(captures):
        raise ValueError(f"{len(prompts_messages)} prompts, {len(responses)} responses and {len(captures)} captures: "
                         "one of each per answer")
    guard._check_model(model)
    n = model.config.num_hidden_layers
    steer = [l for l in guard.layers if 1 <= l < n] if steer_layers is None else list(steer_layers)
    thr = guard.threshold if threshold is None else float(threshold)
    out: list[Rectified | None] = [None] * len(responses)
    todo = []  # (index, prompt ids, kept response ids, t, score)
    for i, (m, text, cap) in enumerate(zip(prompts_messages, responses, captures)):
        t, score = trigger_point(guard, cap, threshold=thr, min_tokens=min_tokens, check_every=check_every,
                                 max_new_tokens=params.max_new_tokens)
        if t is None:
            out[i] = Rectified(text, None, None, None)
            continue
        r_ids = list(response_ids[i]) if response_ids is not None else encode_text(tokenizer, text)
        if len(r_ids) < cap.n_tokens:
            raise ValueError(f"response {i} has {len(r_ids)} tokens but its capture {cap.n_tokens}: "
                             "the captures must be of these responses")
        todo.append((i, encode_chat(tokenizer, m), r_ids[:t], t, score))
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    device = next(model.parameters()).device
    todo.sort(key=lambda r: len(r[1]) + len(r[2]))
    bar = tqdm(total=len(todo), desc="rectified continuation", disable=not progress, unit="resp")
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        seqs = [p + r for _, p, r, _, _ in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):  # left padding, as generation pads
            ids[r, width - len(s) :] = torch.tensor(s)
            mask[r, width - len(s) :] = 1
        mon = _Monitor(model, guard, width, len(chunk), eos, threshold=float("inf"), alpha=alpha,
                       min_tokens=1, check_every=1, steer_layers=steer if alpha > 0 else [])
        for r, (i, _, _, t, score) in enumerate(chunk):
            mon.fire(r, t, score, captures[i].states)
        try:
            seq = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=params.max_new_tokens - min(c[3] for c in chunk),
                                 do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        finally:
            mon.close()
        for r, (i, p_ids, kept, t, score) in enumerate(chunk):
            new = []
            for tok_id in seq[r, width:].tolist()[: params.max_new_tokens - t]:
                if tok_id in eos:
                    break
                new.append(tok_id)
            gen = kept + new
            finish = "length" if len(gen) >= params.max_new_tokens else "stop"
            comp = Completion(tokenizer.decode(gen, skip_special_tokens=True), len(p_ids), len(gen), finish, gen)
            out[i] = Rectified(comp.text, comp, t, score)
        bar.update(len(chunk))
    bar.close()
    return out  # type: ignore[return-value]
