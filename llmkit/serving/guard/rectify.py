"""Latent rectification: watch the chaos score while generating, and steer back when it crosses the threshold.

AEO (../shared/seeds/000_99acb659bb8537c9.txt) gates "a lightweight post-hoc correction
module" with the chaos score and reports it lifts IHEval instruction following without
finetuning; the abstract does not describe the module. This is the in-latent-space
version: no second prompt, no second generation.

Algorithm (greedy decoding, transformers model, one ``generate`` call per batch):

1. Forward hooks record, at every decoding step, the state of the token just fed at each
   guard layer: the same rows a teacher-forced pass over the response would give.
2. A logits processor (it runs after every forward) scores each unfinished, not yet
   rectified row's trajectory so far with the guard's own score (energy or entropic,
   calibrated as the guard is) once it has ``min_tokens`` tokens, then every
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
            score = float(self.guard.layer_z([cap])[0].mean())
            if score > self.threshold:
                self.triggered[r], self.trigger_score[r] = t, score
                for l in self.shift:
                    mu = self.guard.manifolds[l].mean.double()
                    delta = self.alpha * (mu - cap.states[l].double().mean(0))
                    if self.shift[l] is None:
                        self.shift[l] = torch.zeros(self.batch, mu.numel(), dtype=torch.float64)
                    self.shift[l][r] = delta
        return scores


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
