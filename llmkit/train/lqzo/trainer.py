"""``LQZOTrainer``: TRL's SFTTrainer with zeroth-order steps (no backward, no optimizer state).

Overrides:
* ``create_optimizer``: a ``ZOOptimizer`` holding the trainable tensors in param groups (so the HF
  schedulers drive ``lr``) and no state; its ``step()`` applies the accumulated ZO update.
* ``training_step``: for each of q directions, two forwards under ``torch.no_grad()`` at
  ``x + mu z`` and ``x - mu z`` (z regenerated from ``seed(global_step, k)``); the projected derivatives
  of the micro-batches of one optimizer step are accumulated (same seeds, so accumulation = a larger
  batch), averaged across processes at the step (a q-float all-reduce), clipped, applied. Each forward
  projects through the LM head only the positions that have a label (``label_positions_loss``: the same
  loss as SFTTrainer's, which on CPU scores every position; completion-only data labels a few).
* ``_save`` / ``_load_from_checkpoint``: checkpoints are normal HF folders (dense dequantized weights
  via ``save_pretrained``, loadable by ``llmkit eval/chat/serve``) plus ``lqzo_quant.safetensors`` (codes,
  zero points, trained scales) that resuming and ``model_name_or_path`` reload exactly.
* ``_clip_grad_norm`` / ``_get_grad_norm``: there is no gradient; ``grad_norm`` logs the RMS of the
  step's projected derivatives instead.

The seed stream depends only on (seed, global_step, k, tensor), so a resumed run continues it exactly.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import torch
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl import SFTTrainer

from llmkit.optim.zo import SeedZO
from llmkit.train.lqzo.quant import QUANT_CONFIG, QUANT_FILE, QuantLinear, dequantized_state_dict, quant_state
from llmkit.train.lqzo.task import accepts_logits_to_keep


def zo_trainable(model: nn.Module, settings: dict) -> tuple[list[str], list[torch.Tensor], list[str], list[float]]:
    """``(names, tensors, modes, decay)`` that the ZO step perturbs and updates.

    Quantized model: every QuantLinear's ``scale`` (``mul``, a step on log s, when ``scale_mode`` is log;
    ``add_nonneg``, QZO's additive step projected onto s >= 0, when add), plus 1-D norm weights and biases
    when ``train_norms`` (additive). Full precision (MeZO): every floating parameter, additive;
    2-D matrices decay with weight_decay, 1-D tensors do not (the HF Trainer's rule).
    """
    names, tensors, modes, decay = [], [], [], []
    quantized = any(isinstance(m, QuantLinear) for m in model.modules())
    for n, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        if quantized:
            if n.endswith(".scale"):
                mode = "add_nonneg" if settings.get("scale_mode", "log") == "add" else "mul"
                names.append(n), tensors.append(p), modes.append(mode), decay.append(0.0)
            elif settings.get("train_norms") and p.dim() == 1:
                names.append(n), tensors.append(p), modes.append("add"), decay.append(0.0)
        else:
            if p.dim() == 1 and not settings.get("train_norms", True):
                continue
            names.append(n), tensors.append(p), modes.append("add"), decay.append(1.0 if p.dim() >= 2 else 0.0)
    return names, tensors, modes, decay


def label_positions_loss(model: nn.Module, inputs: dict, num_items_in_batch=None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)``: the causal-LM loss of ``inputs["labels"]`` (-100 = ignored) with the LM head applied
    only where some row of the batch has a label to predict (``logits_to_keep``), so a prompt-heavy batch skips
    most of the head's work. The loss is the summed token NLL over ``num_items_in_batch`` (else the label
    count), as SFTTrainer's; ``metrics``: the label count, the summed entropy and the count of top-1 hits."""
    import torch.nn.functional as F

    target = inputs["labels"][:, 1:]
    keep = (target != -100).any(0).nonzero().squeeze(-1)  # position p predicts token p + 1
    fwd = {k: v for k, v in inputs.items() if k != "labels"} | {"use_cache": False, "logits_to_keep": keep}
    logits = model(**fwd).logits.float()
    tgt = target[:, keep].to(logits.device)
    nll = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="sum")
    mask = tgt != -100
    n = mask.sum() if num_items_in_batch is None else num_items_in_batch
    loss = nll / torch.as_tensor(n, device=nll.device).clamp(min=1)
    logp = torch.log_softmax(logits[mask], -1)
    return loss, {"count": mask.sum(), "entropy": -(logp.exp() * logp).sum(),
                  "top1": (logp.argmax(-1) == tgt[mask]).sum()}


class ZOOptimizer(torch.optim.Optimizer):
    """Stateless optimizer shell: param groups carry lr / weight_decay for the schedulers; ``step()`` applies
    the trainer's pending ZO update (``mean_k d_k z_k``). ``state`` stays empty."""

    def __init__(self, params, engine: SeedZO, lr: float, weight_decay: float, decay_mask: list[float]):
        super().__init__([{"params": list(params), "lr": lr, "weight_decay": weight_decay}],
                         {"lr": lr, "weight_decay": weight_decay})
        self.engine, self.decay_mask = engine, decay_mask
        self.pending: tuple[int, list[float]] | None = None  # (seed step, clipped projected derivatives)

    @torch.no_grad()
    def step(self, closure=None):
        if self.pending is None:
            return
        step, d = self.pending
        g = self.param_groups[0]
        self.engine.update(step, d, g["lr"], [g["weight_decay"] * m for m in self.decay_mask])
        self.pending = None
        return


class LQZOTrainer(SFTTrainer):
    """SFTTrainer whose steps are zeroth-order (see the module docstring). ``zo_settings`` = ``LQZOArguments.resolved()``."""

    def __init__(self, *args, zo_settings: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.zo_settings = dict(zo_settings)
        names, tensors, modes, decay = zo_trainable(self.model, self.zo_settings)
        if not tensors:
            raise ValueError("nothing to train: the model has no quantization scales and zo_train_norms is off")
        s = self.zo_settings
        self.zo = SeedZO(tensors, modes=modes, mu=s["mu"], num_directions=s["num_directions"], clip=s["clip"],
                         distribution=s["distribution"], rank=s["rank"], isotropic=s["isotropic"],
                         v_interval=s["v_interval"], seed=self.args.seed,
                         exact_restore=any(m != "add" for m in modes))  # MeZO on raw weights: regenerate, no copy
        self.zo_names, self._decay_mask = names, decay
        self._acc: list[float] | None = None
        self._last_d: list[float] = []

    # ---------------------------------------------------------------- optimizer

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = ZOOptimizer(self.zo.params, self.zo, self.args.learning_rate, self.args.weight_decay,
                                         self._decay_mask)
        return self.optimizer

    def _zo_optimizer(self) -> ZOOptimizer:
        opt = self.optimizer
        while not isinstance(opt, ZOOptimizer):  # accelerate wraps it
            opt = opt.optimizer
        return opt

    # ---------------------------------------------------------------- the ZO step

    def training_step(self, model, inputs, num_items_in_batch=None):
        # eval mode, as MeZO: with dropout on, the +mu and -mu passes would see different masks and their
        # difference would measure the masks, not the perturbation. SFTTrainer files a forward's metrics (and
        # log() reads them) by the model's mode: the step's go to "train", and the step ends in train mode, as
        # Trainer.training_step (which sets it) leaves the model.
        model.eval()
        ev = self._metrics["eval"]
        seen = {k: len(v) for k, v in ev.items()}
        try:
            return self._zo_step(model, inputs, num_items_in_batch)
        finally:
            model.train()
            for k in list(ev):  # what SFTTrainer.compute_loss filed under "eval" during this step
                new = ev[k][seen.get(k, 0):]
                del ev[k][seen.get(k, 0):]
                if k != "num_tokens":
                    self._metrics["train"][k].extend(new)
                if not ev[k]:
                    del ev[k]

    def _zo_step(self, model, inputs, num_items_in_batch):
        inputs = self._prepare_inputs(inputs)
        step = self.state.global_step
        loss_is_scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        ga = 1.0 if loss_is_scaled else float(self.current_gradient_accumulation_steps)

        # SFTTrainer's plain NLL loss, computed on the labelled positions only; anything else goes through it
        compact = ("labels" in inputs and accepts_logits_to_keep(self.accelerator.unwrap_model(model))
                   and self.compute_loss_func is None and self.label_smoother is None
                   and getattr(self.args, "loss_type", "nll") == "nll" and not getattr(self, "aux_loss_enabled", False))

        def loss_fn():
            with self.compute_loss_context_manager():
                if not compact:
                    return self.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch).detach()
                loss, m = label_positions_loss(model, dict(inputs), num_items_in_batch)
                if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                    loss = loss * self.accelerator.num_processes  # as SFTTrainer.compute_loss
                self._log_forward_metrics(m)
                return loss.detach()

        tokens_before = getattr(self, "_total_train_tokens", None)
        with torch.no_grad():
            d, losses = [], []
            for k in range(self.zo.q):
                dk, lp, lm = self.zo.projected(loss_fn, step, k)
                d.append(dk / ga)
                losses += [lp, lm]
        if tokens_before is not None:  # once per batch (SFTTrainer counts only train-mode forwards, ours are not)
            local = (inputs["attention_mask"].sum() if "attention_mask" in inputs
                     else torch.tensor(inputs["input_ids"].numel(), device=self.args.device))
            self._total_train_tokens = tokens_before + int(self.accelerator.gather_for_metrics(local).sum())
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        self._acc = d if self._acc is None else [a + b for a, b in zip(self._acc, d)]
        if self.accelerator.gradient_state.sync_gradients:  # last micro-batch of this optimizer step
            acc = torch.tensor(self._acc, dtype=torch.float64, device=self.args.device)
            if self.accelerator.num_processes > 1:
                acc = self.accelerator.reduce(acc, reduction="mean")
            dd = self.zo.clipped(acc.tolist())
            self._last_d = dd
            self._zo_optimizer().pending = (step, dd)
            self._acc = None
        mean_loss = sum(losses) / len(losses)
        return torch.tensor(mean_loss / ga, device=self.args.device)

    def _log_forward_metrics(self, m: dict) -> None:
        """SFTTrainer's per-forward entropy and token accuracy, from the label positions' logits."""
        n, ent, top1 = (self.accelerator.gather_for_metrics(m[k].reshape(1).float()).sum()
                        for k in ("count", "entropy", "top1"))
        metrics = self._metrics["train"]  # only training_step's forwards come here
        metrics["entropy"].append((ent / n).item() if n > 0 else 0.0)
        metrics["mean_token_accuracy"].append((top1 / n).item() if n > 0 else 0.0)

    def _clip_grad_norm(self, model):
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        d = self._last_d
        return math.sqrt(sum(x * x for x in d) / len(d)) if d else 0.0

    # ---------------------------------------------------------------- save / resume

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        if not self.args.should_save:
            return
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        quantized = any(isinstance(m, QuantLinear) for m in model.modules())
        save_dense(model, output_dir)
        if quantized:
            save_quant(model, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = model if model is not None else self.accelerator.unwrap_model(self.model)
        load_checkpoint_into(model, resume_from_checkpoint)


def save_dense(model: nn.Module, output_dir: str) -> None:
    """An ordinary HF checkpoint: dense (dequantized) weights in the model's dtype via ``save_pretrained``."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    sd = dequantized_state_dict(model, emb.weight.dtype if emb is not None else None)
    model.save_pretrained(output_dir, state_dict=sd, safe_serialization=True)


def save_quant(model: nn.Module, output_dir: str) -> None:
    from safetensors.torch import save_file

    tensors, meta = quant_state(model)
    save_file(tensors, os.path.join(output_dir, QUANT_FILE), metadata={"format": "pt"})
    with open(os.path.join(output_dir, QUANT_CONFIG), "w") as f:
        json.dump({"modules": meta, "format": "W = (codes - zero) * scale, groups along the input dim"}, f, indent=1)


@torch.no_grad()
def load_checkpoint_into(model: nn.Module, folder: str) -> None:
    """Load a folder written by ``LQZOTrainer._save``: scales/codes from the quant file, the rest from the weights."""
    from safetensors.torch import load_file

    from llmkit.train.lqzo.quant import load_quant_state

    qfile = os.path.join(folder, QUANT_FILE)
    if os.path.isfile(qfile):
        with open(os.path.join(folder, QUANT_CONFIG)) as f:
            meta = json.load(f)["modules"]
        load_quant_state(model, load_file(qfile), meta)
    weights = os.path.join(folder, "model.safetensors")
    if os.path.isfile(weights):
        sd = load_file(weights)
        own = model.state_dict()
        for k, v in sd.items():
            if k in own and own[k].shape == v.shape:
                own[k].copy_(v.to(own[k].dtype))
