"""Pick an llmkit optimizer by name in any Hugging Face / TRL recipe: ``optim: llmkit_muon``.

HF ``TrainingArguments`` validates ``optim`` against its own enum, so the llmkit names go through two mixins
(stable public names; recipes other than HALO and VSPO reuse them as they are):

``LlmkitOptimMixin``  (config dataclass mixin; put it FIRST among the bases of a TrainingArguments subclass)
    ``class MyConfig(LlmkitOptimMixin, GRPOConfig)`` decorated with ``@dataclass``. It re-declares ``optim``
    as a plain string (HF's enum would make argparse refuse other names), and its ``__post_init__``
    moves an ``optim: llmkit_*`` value into the field ``llmkit_optim`` and hands the parent a valid
    placeholder (``adamw_torch``), so YAML and ``--optim llmkit_lion`` both work and the saved config
    reloads. Extra fields: ``llmkit_lr`` (learning rate of the llmkit-optimized parameters; default
    ``learning_rate``) and ``optim_args`` (HF's own field) read as ``key=value,...`` keyword arguments of the
    llmkit optimizer (e.g. ``momentum=0.9,ns_steps=6`` or ``betas=0.95 0.98``).

``LlmkitOptimTrainerMixin``  (trainer mixin; FIRST among the bases of a Trainer subclass)
    ``class MyTrainer(LlmkitOptimTrainerMixin, GRPOTrainer)``. Overrides ``create_optimizer``: when
    ``args.llmkit_optim`` is set it builds the optimizer with ``build_optimizer`` below, otherwise the
    Trainer's own (``adamw_torch`` etc. keep working). The LR scheduler, gradient accumulation, clipping and
    checkpointing are the Trainer's as usual.

Names (``LLMKIT_OPTIMIZERS``):
  * ``llmkit_signsgd``, ``llmkit_lion``: element-wise sign methods on every trainable parameter
    (weight decay on the Trainer's decay parameters only). Lion's authors use a 3-10x smaller lr than AdamW.
  * ``llmkit_muon``, ``llmkit_muonlight``: Muon / MuonLight on the 2-D hidden weight matrices; AdamW
    (the Trainer's betas, eps, weight decay) on embeddings, the LM head, norms and biases, as Muon's
    authors recommend. MuonLight's update is RMS-matched to AdamW so it shares ``learning_rate``; Muon's lr
    is on its own scale (set ``llmkit_lr``).
  * ``llmkit_imuon``: intrinsic Muon. With LoRA adapters (``use_peft``) each (A, B) pair is one point on
    the fixed-rank manifold (``imuon_lora_param_groups``); without adapters the hidden matrices are points of
    the flat (Euclidean) manifold, where iMuon's spectral LMO is Muon's orthogonalized step. AdamW does the rest.

The Muon-type choices return a ``HybridOptimizer``: one ``torch.optim.Optimizer`` over the two inner
optimizers, sharing their param-group dicts (so LR schedulers scale both) and their states.
"""

from __future__ import annotations

import itertools
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ._closure import evaluate_closure

__all__ = [
    "LLMKIT_OPTIMIZERS",
    "HybridOptimizer",
    "LlmkitOptimMixin",
    "LlmkitOptimTrainerMixin",
    "build_optimizer",
    "parse_optim_args",
    "split_matrix_params",
]

LLMKIT_OPTIMIZERS = ("llmkit_signsgd", "llmkit_lion", "llmkit_muon", "llmkit_muonlight", "llmkit_imuon")
PLACEHOLDER = "adamw_torch"


def _hf_optim_default() -> str:
    try:
        from transformers import TrainingArguments

        default = TrainingArguments.__dataclass_fields__["optim"].default
        return getattr(default, "value", default)
    except (ImportError, KeyError, AttributeError):  # pragma: no cover - transformers is always present
        return PLACEHOLDER


_HF_OPTIM_DEFAULT = _hf_optim_default()


def _check_name(name: str) -> str:
    if name not in LLMKIT_OPTIMIZERS:
        raise ValueError(f"unknown llmkit optimizer {name!r}: choose one of {', '.join(LLMKIT_OPTIMIZERS)} "
                         "(or one of the Hugging Face Trainer's own names such as adamw_torch)")
    return name


@dataclass
class LlmkitOptimMixin:
    """Lets ``optim`` take an llmkit optimizer name (see the module docstring)."""

    optim: str = field(default=_HF_OPTIM_DEFAULT, metadata={
        "help": "optimizer: one of the Hugging Face Trainer's (adamw_torch, adamw_torch_fused, sgd, ...) or an llmkit "
                "one: " + " | ".join(LLMKIT_OPTIMIZERS)})
    llmkit_optim: str | None = field(default=None, metadata={
        "help": "llmkit optimizer in use (set it through optim: " + " | ".join(LLMKIT_OPTIMIZERS) + ")"})
    llmkit_lr: float | None = field(default=None, metadata={
        "help": "learning rate of the parameters the llmkit optimizer owns (Muon-type: 2-D hidden matrices; "
                "sign methods: all); default: learning_rate"})

    def __post_init__(self):
        value = getattr(self, "optim", None)
        value = getattr(value, "value", value)
        if isinstance(value, str) and value.startswith("llmkit_"):
            self.llmkit_optim = _check_name(value)
            self.optim = PLACEHOLDER
        elif self.llmkit_optim:
            _check_name(self.llmkit_optim)
        super().__post_init__()


# ---------------------------------------------------------------------------------------------- building

def parse_optim_args(text: str | None) -> dict:
    """``"momentum=0.9,ns_steps=6,betas=0.95 0.98"`` -> ``{"momentum": 0.9, "ns_steps": 6, "betas": (0.95, 0.98)}``."""
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"optim_args: expected key=value, got {item!r}")
        key, raw = (s.strip() for s in item.split("=", 1))
        parts = raw.split()
        vals = [_scalar(p) for p in parts]
        out[key] = tuple(vals) if len(vals) > 1 else vals[0]
    return out


def _scalar(s: str):
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


def split_matrix_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """Trainable parameters split into (2-D hidden weight matrices, everything else).

    Embeddings and the LM head (found through ``get_input_embeddings`` / ``get_output_embeddings`` and by
    name) go to the second list with norms and biases, as Muon's authors recommend."""
    special: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            mod = fn() if fn is not None else None
        except (NotImplementedError, AttributeError):
            mod = None
        if mod is not None:
            special.update(id(p) for p in mod.parameters())
    matrices, rest, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        low = name.lower()
        is_special = id(p) in special or "embed" in low or "lm_head" in low or low.endswith("wte.weight")
        (matrices if p.ndim == 2 and not is_special else rest).append((name, p))
    return matrices, rest


def _adamw(named: list[tuple[str, nn.Parameter]], args, decay_names: set[str]) -> torch.optim.Optimizer | None:
    decay = [p for n, p in named if n in decay_names]
    no_decay = [p for n, p in named if n not in decay_names]
    groups = [g for g in ({"params": decay, "weight_decay": args.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if not groups:
        return None
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon)


def build_optimizer(name: str, model: nn.Module, args, decay_names=None) -> torch.optim.Optimizer:
    """The optimizer ``optim: <name>`` stands for, over ``model``'s trainable parameters.

    ``args`` is a TrainingArguments-like object (learning_rate, weight_decay, adam_beta1/2, adam_epsilon,
    and optionally llmkit_lr, optim_args); ``decay_names`` the parameter names that get weight decay
    (the Trainer's ``get_decay_parameter_names``; default: every parameter with ndim >= 2)."""
    from llmkit.optim.imuon import IMuon, imuon_lora_param_groups
    from llmkit.optim.muon import Muon, MuonLight
    from llmkit.optim.sign import Lion, SignSGD

    _check_name(name)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameter")
    if decay_names is None:
        decay_names = {n for n, p in named if p.ndim >= 2}
    decay_names = set(decay_names)
    lr = getattr(args, "llmkit_lr", None) or args.learning_rate
    wd = args.weight_decay
    extra = parse_optim_args(getattr(args, "optim_args", None))

    if name in ("llmkit_signsgd", "llmkit_lion"):
        groups = [g for g in ({"params": [p for n, p in named if n in decay_names], "weight_decay": wd},
                              {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0})
                  if g["params"]]
        cls = SignSGD if name == "llmkit_signsgd" else Lion
        return cls(groups, lr=lr, **extra)

    if name == "llmkit_imuon":
        lora_groups = imuon_lora_param_groups(model)
        in_pairs = {id(p) for g in lora_groups for p in g["params"]}
        matrices, rest = split_matrix_params(model)
        if lora_groups:
            # LoRA: the adapter pairs are the fixed-rank points; everything else trainable goes to AdamW
            rest = [(n, p) for n, p in named if id(p) not in in_pairs]
            main_groups = lora_groups
        else:
            main_groups = [{"params": [p for _, p in matrices], "manifold": "euclidean"}] if matrices else []
        kw = {"momentum": 0.9, "adjust_lr": "match_rms_adamw", **extra}
        main = IMuon(main_groups, lr=lr, **kw) if main_groups else None
    else:
        matrices, rest = split_matrix_params(model)
        if name == "llmkit_muon":
            main = Muon([p for _, p in matrices], lr=lr, weight_decay=wd, **extra) if matrices else None
        else:
            main = MuonLight([p for _, p in matrices], lr=lr, weight_decay=wd, **extra) if matrices else None
    aux = _adamw(rest, args, decay_names)
    opts = [o for o in (main, aux) if o is not None]
    return opts[0] if len(opts) == 1 else HybridOptimizer(opts)


# ---------------------------------------------------------------------------------------------- hybrid

class _UnionState(MutableMapping):
    """The inner optimizers' ``state`` dicts seen as one mapping (keys are parameters)."""

    def __init__(self, optimizers):
        self._opts = optimizers
        self._owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}

    def _state_of(self, p):
        o = self._owner.get(id(p))
        if o is None:
            raise KeyError(p)
        return o.state

    def __getitem__(self, p):
        st = self._state_of(p)
        if p not in st:
            raise KeyError(p)
        return st[p]

    def __setitem__(self, p, value):
        self._state_of(p)[p] = value

    def __delitem__(self, p):
        del self._state_of(p)[p]

    def __iter__(self):
        return itertools.chain.from_iterable(iter(o.state) for o in self._opts)

    def __len__(self):
        return sum(len(o.state) for o in self._opts)


class HybridOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together as one ``torch.optim.Optimizer``.

    ``param_groups`` is the concatenation of the inner optimizers' group dicts (the same objects, so a
    scheduler that sets ``group["lr"]`` reaches the inner optimizers) and ``state`` a view of their states."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("HybridOptimizer needs at least one optimizer")
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("HybridOptimizer: a parameter belongs to two inner optimizers")
        super().__init__(params, {})
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.state = _UnionState(self.optimizers)

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"hybrid": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict):
        inner = state_dict["hybrid"]
        if len(inner) != len(self.optimizers):
            raise ValueError(f"state dict holds {len(inner)} optimizers, this HybridOptimizer has "
                             f"{len(self.optimizers)}")
        for o, sd in zip(self.optimizers, inner):
            o.load_state_dict(sd)
        # load_state_dict replaces the inner group dicts: share the new ones again
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    def __repr__(self):
        return "HybridOptimizer(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"


# ---------------------------------------------------------------------------------------------- trainer

class LlmkitOptimTrainerMixin:
    """Builds the optimizer named by ``args.llmkit_optim`` (see the module docstring); put it first in the bases."""

    def create_optimizer(self, model=None):
        name = getattr(self.args, "llmkit_optim", None)
        if not name:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            decay = self.get_decay_parameter_names(opt_model)
            self.optimizer = build_optimizer(name, opt_model, self.args, decay_names=decay)
        return self.optimizer
