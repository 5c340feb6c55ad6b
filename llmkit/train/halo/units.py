"""Group a causal LM's trainable parameters into units ordered output -> input.

Unit 0 holds everything that is neither a decoder layer nor an input
embedding (the LM head, the final norm); then one unit per decoder layer from
the last to the first; then the input embeddings. A tied LM head/embedding
matrix is a single tensor with two roles: as the LM head it belongs to the
output unit (it trains from t = 0, the paper starts from "the output layers");
its input-embedding role is a unit of its own, last in the order, that holds
no parameter but the embedding *module* (``Unit.tied_input``): the controller
gates the gradient that flows into the shared matrix through the embedding
lookup, so the input role joins last (see ``controller.py``). Units with no
trainable parameter and no tied input role (LoRA leaves most modules frozen)
are dropped, so unit 0 is always something that trains.

Decoder layers are recognised by the ``...layers.<i>.`` / ``h.<i>.`` /
``blocks.<i>.`` naming used by Llama, Qwen, Mistral, Gemma, GPT-2 and most
other transformers models; peft's ``base_model.model.`` prefix is harmless.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)(?:embed_tokens|embed_positions|wte|wpe|word_embeddings|embeddings)(?:\.|$)")


@dataclass
class Unit:
    name: str
    params: list[torch.nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    # the input-embedding module whose weight is the (trainable) tied LM head: this unit's lambda gates
    # the gradient that reaches the shared matrix through the lookup, not a parameter of its own
    tied_input: torch.nn.Module | None = None

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _tied_output_weight(model) -> torch.Tensor | None:
    try:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if out is not None and inp is not None and out.weight is inp.weight:
        return out.weight
    return None


def layer_units(model: torch.nn.Module, only_trainable: bool = True) -> list[Unit]:
    """The model's parameters as units, output first. ``only_trainable`` keeps params with requires_grad."""
    tied = _tied_output_weight(model)
    head = Unit("output")
    embed = Unit("embeddings")
    layers: dict[int, Unit] = {}
    for name, p in model.named_parameters():
        if only_trainable and not p.requires_grad:
            continue
        m = _LAYER_RE.search(name)
        if m:
            idx = int(m.group(1))
            unit = layers.setdefault(idx, Unit(f"layer.{idx}"))
        elif p is tied:
            unit = head
        elif _EMBED_RE.search(name):
            unit = embed
        else:
            unit = head
        unit.params.append(p)
        unit.names.append(name)
    if tied is not None and any(p is tied for p in head.params):
        embed.tied_input = model.get_input_embeddings()
    ordered = [head] + [layers[i] for i in sorted(layers, reverse=True)] + [embed]
    return [u for u in ordered if u.params or u.tied_input is not None]

