"""Steering vectors: extract from contrastive prompt pairs, save/load, apply with a per-row intensity.

A steering vector for a behaviour is, at each chosen decoder layer ``l``, the
difference of mean residual-stream activations between prompts that show the
behaviour and prompts that do not:

    v_l = mean_i h_l(positive_i) - mean_i h_l(negative_i)

``h_l`` is the output of decoder layer ``l`` read at the last prompt token
(``position="last"``, where the model is about to answer, so the instruction's
effect is summarised there) or averaged over the prompt's tokens
(``position="mean"``). The unit of intensity is therefore natural: ``alpha = 1``
moves the hidden state by the gap between the two prompt populations.

Applying: ``steer(model, vector, alphas)`` registers a forward hook on each
chosen layer that adds ``alphas[b] * v_l`` to every position of row ``b``
(prompt and generated tokens alike, as in activation addition), and removes
the hooks on exit, so the model is bit-for-bit the unsteered model afterwards.
``alphas`` is a scalar or one value per batch row; rows with ``alpha == 0``
are untouched (the hook adds exactly zero there). The hooks read
``alphas`` from a mutable holder, so a caller may change intensities between
forward passes without re-registering.

Vectors are saved as ``<dir>/steering.safetensors`` (one tensor per layer,
``layer.<l>``) plus ``<dir>/steering.json`` (behaviour, layers, position,
model, number of pairs, norms).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch

VECTOR_FILE = "steering.safetensors"
META_FILE = "steering.json"


@dataclass
class SteeringVector:
    """Per-layer directions (``layer index -> (hidden,) tensor``) for one behaviour."""

    directions: dict[int, torch.Tensor]
    behavior: str = ""
    position: str = "last"
    meta: dict = field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        return sorted(self.directions)

    def norms(self) -> dict[int, float]:
        return {layer: float(v.norm()) for layer, v in sorted(self.directions.items())}

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({f"layer.{layer}": v.detach().float().cpu().contiguous() for layer, v in self.directions.items()},
                  str(d / VECTOR_FILE))
        meta = {"behavior": self.behavior, "position": self.position, "layers": self.layers,
                "norms": {str(k): v for k, v in self.norms().items()}, **self.meta}
        (d / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> SteeringVector:
        from safetensors.torch import load_file

        d = Path(directory)
        if d.is_file() and d.name in (VECTOR_FILE, META_FILE):
            d = d.parent
        if not (d / VECTOR_FILE).is_file():
            raise FileNotFoundError(f"no steering vector at {d} (expected {VECTOR_FILE} and {META_FILE})")
        tensors = load_file(str(d / VECTOR_FILE))
        directions = {int(k.split(".", 1)[1]): v for k, v in tensors.items()}
        meta = json.loads((d / META_FILE).read_text()) if (d / META_FILE).is_file() else {}
        extra = {k: v for k, v in meta.items() if k not in ("behavior", "position", "layers", "norms")}
        return cls(directions, behavior=meta.get("behavior", ""), position=meta.get("position", "last"), meta=extra)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's stack of decoder layers, found structurally (works through peft and other wrappers)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if n is None and hasattr(config, "get_text_config"):
        n = getattr(config.get_text_config(), "num_hidden_layers", None)
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and (n is None or len(module) == n):
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def default_layers(model) -> list[int]:
    """One layer a bit past the middle of the stack: where behavioural directions usually steer best."""
    n = len(decoder_layers(model))
    return [max(0, min(n - 1, round(n * 0.6)))]


def _hidden_of(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, hidden):
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


@contextlib.contextmanager
def capture(model, layers: Sequence[int]):
    """Record each chosen layer's output hidden states (B, T, H) for the forward passes inside the block."""
    stack = decoder_layers(model)
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for layer in layers:
        def hook(_module, _args, output, _layer=layer):
            seen[_layer] = _hidden_of(output).detach()
        handles.append(stack[layer].register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _as_texts(tokenizer, items: Iterable, chat: bool) -> list[str]:
    out = []
    for x in items:
        if isinstance(x, list):  # chat messages
            out.append(tokenizer.apply_chat_template(x, tokenize=False, add_generation_prompt=True))
        elif chat and getattr(tokenizer, "chat_template", None):
            out.append(tokenizer.apply_chat_template([{"role": "user", "content": x}], tokenize=False,
                                                     add_generation_prompt=True))
        else:
            out.append(x)
    return out


@torch.no_grad()
def _mean_activation(model, tokenizer, texts: list[str], layers: Sequence[int], position: str,
                     batch_size: int) -> dict[int, torch.Tensor]:
    device = next(model.parameters()).device
    sums = {layer: None for layer in layers}
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # the last real token then sits at index -1 for every row
    try:
        for start in range(0, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with capture(model, layers) as seen:
                model(**enc)
            mask = enc["attention_mask"].unsqueeze(-1).float()
            for layer in layers:
                h = seen[layer].float()
                if position == "last":
                    pooled = h[:, -1, :]
                elif position == "mean":
                    pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1)
                else:
                    raise ValueError(f"position must be 'last' or 'mean', got {position!r}")
                s = pooled.sum(0)
                sums[layer] = s if sums[layer] is None else sums[layer] + s
    finally:
        tokenizer.padding_side = old_side
    return {layer: s / len(texts) for layer, s in sums.items()}


def extract(model, tokenizer, pairs: Sequence[tuple], layers: Sequence[int] | None = None, position: str = "last",
            behavior: str = "", chat: bool = True, batch_size: int = 8) -> SteeringVector:
    """Difference of mean activations between the positive and negative side of ``pairs``.

    Each pair is ``(positive, negative)``; each side is a string (wrapped as a user turn when ``chat`` and the
    tokenizer has a chat template) or a list of chat messages.
    """
    if not pairs:
        raise ValueError("need at least one contrastive pair to extract a steering vector")
    layers = list(layers) if layers else default_layers(model)
    n = len(decoder_layers(model))
    bad = [layer for layer in layers if not 0 <= layer < n]
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: the model has {n} decoder layers (0..{n - 1})")
    was_training = model.training
    model.eval()
    try:
        pos = _mean_activation(model, tokenizer, _as_texts(tokenizer, [p for p, _ in pairs], chat), layers, position,
                               batch_size)
        neg = _mean_activation(model, tokenizer, _as_texts(tokenizer, [q for _, q in pairs], chat), layers, position,
                               batch_size)
    finally:
        model.train(was_training)
    directions = {layer: (pos[layer] - neg[layer]).cpu() for layer in layers}
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return SteeringVector(directions, behavior=behavior, position=position,
                          meta={"model": str(name), "num_pairs": len(pairs)})


POSITIONS = ("all", "answer")


class Steering:
    """Live steering hooks; ``alphas`` may be reassigned between forward passes (scalar or one per row).

    ``positions``: ``all`` (activation addition at every position, prompt included) or ``answer`` (only from the
    last prompt token on: in a forward pass over several positions, the prefill, only the last one is shifted;
    in a one-token decoding step, that token). ``answer`` leaves the model's reading of the prompt intact, so a
    steered answer can still use the question's content; it assumes cached decoding (``generate``'s default):
    without a KV cache every step is a full forward and only its last position would be steered."""

    def __init__(self, model, vector: SteeringVector, alphas=0.0, positions: str = "all"):
        if positions not in POSITIONS:
            raise ValueError(f"steering positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
        self.model = model
        self.vector = vector
        self.alphas = alphas
        self.positions = positions
        self._handles: list = []
        self._cache: dict = {}

    def _delta(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        alphas = self.alphas
        if not torch.is_tensor(alphas):
            if isinstance(alphas, (int, float)):
                if alphas == 0:
                    return None
                alphas = torch.full((hidden.shape[0],), float(alphas))
            else:
                alphas = torch.as_tensor(list(alphas), dtype=torch.float32)
        if alphas.numel() == 1:
            alphas = alphas.reshape(1).expand(hidden.shape[0])
        if alphas.shape[0] != hidden.shape[0]:
            raise ValueError(f"steering got {alphas.shape[0]} intensities for a batch of {hidden.shape[0]} rows")
        key = (layer, hidden.device, hidden.dtype)
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = self.vector.directions[layer].to(device=hidden.device, dtype=hidden.dtype)
        a = alphas.to(device=hidden.device, dtype=hidden.dtype).view(-1, *([1] * (hidden.dim() - 1)))
        return a * v

    def attach(self) -> Steering:
        if self._handles:
            return self
        stack = decoder_layers(self.model)
        for layer in self.vector.layers:
            if not 0 <= layer < len(stack):
                raise ValueError(f"steering vector layer {layer} does not exist in a model with {len(stack)} layers")

            def hook(_module, _args, output, _layer=layer):
                hidden = _hidden_of(output)
                delta = self._delta(_layer, hidden)
                if delta is None:
                    return None
                if self.positions == "answer" and hidden.dim() == 3 and hidden.shape[1] > 1:
                    shifted = hidden.clone()
                    shifted[:, -1:, :] = shifted[:, -1:, :] + delta
                    return _replace_hidden(output, shifted)
                return _replace_hidden(output, hidden + delta)

            self._handles.append(stack[layer].register_forward_hook(hook))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> Self:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.remove()


def steer(model, vector: SteeringVector, alphas=1.0, positions: str = "all") -> Steering:
    """Context manager: ``with steer(model, vec, alphas): model.generate(...)``. Hooks are removed on exit."""
    return Steering(model, vector, alphas, positions)


def hidden_size_of(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.hidden_size)


def check_compatible(model, vector: SteeringVector) -> None:
    """Raise ValueError naming the mismatch when ``vector`` was built for a model of another shape."""
    h = hidden_size_of(model)
    n = len(decoder_layers(model))
    for layer, v in vector.directions.items():
        if layer >= n:
            raise ValueError(f"steering vector uses layer {layer} but the model has {n} decoder layers")
        if v.shape[-1] != h:
            raise ValueError(f"steering vector has hidden size {v.shape[-1]} but the model has {h}")
