"""TRL's SFTTrainer with source weights: a sampler that draws each example's source from the current
weights, and a weight update every ``weights_update_interval`` optimizer steps.

Why sampling and not per-source loss weights: at a matched budget every method must train the final
model on the same number of tokens. Sampling keeps each step's batch the same size for every method
(and is what DoReMi/DoGE/ODM do for their final models); weighting per-source losses would need a
batch from every source at every step, K times the tokens of the uniform baseline.

Pieces (all usable with accelerate/DDP: weight updates are all-reduced so every process holds the same
weights and the sampler, seeded alike, draws the same index stream, of which each process takes its
shard; a checkpoint holds ``hgms_state.json`` so a resumed run continues with the saved weights):

* ``WeightController``: the weights, their history, the method's update rule, pass/time counters.
* ``MixtureSampler``: infinite-style sampler over the concatenated sources, reading the weights lazily.
* ``SourceIdCollator``: keeps each row's ``source_id`` through TRL's collator (ODM and token counts).
* ``HgmsSFTTrainer``: runs the update before the step that is due, applies the optimistic selection
  step for ``hgms``, feeds ODM the per-example training losses, logs ``weight/<source>``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Sampler
from transformers import TrainerCallback
from trl import SFTTrainer

from llmkit.optim.hf import LlmkitOptimTrainerMixin
from llmkit.train.hgms import signals
from llmkit.train.hgms.weights import (
    Exp3,
    doremi_score,
    exponentiated_step,
    hgms_score,
    hgms_trust,
    project_simplex_floor,
)

STATE_FILE = "hgms_state.json"


class WeightController:
    def __init__(self, names: list[str], method: str = "hgms", *, initial: list[float] | None = None,
                 lr: float = 1.0, smoothing: float = 0.05, normalize: bool = True, interval: int = 5,
                 odm_decay: float = 0.9):
        self.names, self.k, self.method = list(names), len(names), method
        self.lr, self.smoothing, self.normalize, self.interval = lr, smoothing, normalize, interval
        w0 = torch.tensor(initial, dtype=torch.float64) if initial else torch.full((self.k,), 1.0 / self.k)
        self.w = project_simplex_floor(w0, 0.0)
        self.exp3 = Exp3(self.k, decay=odm_decay) if method == "odm" else None
        if self.exp3 is not None:
            self.w = self.exp3.probs()
        self.history: list[dict] = [{"step": 0, "weights": self.weights_dict()}]
        self.passes = {"forward": 0, "backward": 0, "double_backward": 0}
        self.select_examples = 0
        self.update_seconds = 0.0
        self.updates = 0
        self.source_examples = [0] * self.k
        self.info: dict[str, float] = {}
        self.refused = 0
        self.inner_grad_ref: float | None = None
        self.inner_grad_ema: float | None = None
        self.readings: dict[str, float] = {}

    # -- state
    def weights_dict(self) -> dict[str, float]:
        return {n: float(x) for n, x in zip(self.names, self.w)}

    def probs(self) -> np.ndarray:
        p = self.w.numpy().astype(np.float64)
        return p / p.sum()

    def due(self, step: int) -> bool:
        return self.method in ("hgms", "doremi", "doge") and step % self.interval == 0

    def apply_score(self, step: int, score: torch.Tensor, trust: float = 1.0, min_trust: float = 0.0) -> bool:
        """One mirror step at ``lr * trust``; refused (weights unchanged, counted) when trust <= min_trust."""
        if trust <= min_trust:
            self.refused += 1
            self.record(step)
            return False
        self.w = exponentiated_step(self.w, score, self.lr * trust, self.smoothing, self.normalize)
        self.record(step)
        return True

    def grad_ratio(self, inner_grad_norm: float, decay: float = 0.7) -> float:
        """Smoothed inner gradient norm over its first value (probe batches are small and noisy)."""
        x = float(inner_grad_norm)
        if self.inner_grad_ref is None:
            self.inner_grad_ref = self.inner_grad_ema = x
        else:
            self.inner_grad_ema = decay * self.inner_grad_ema + (1 - decay) * x
        return self.inner_grad_ema / max(self.inner_grad_ref, 1e-30)

    def smooth(self, name: str, x: float, decay: float = 0.7) -> float:
        """Moving average of a trust reading: one lucky probe batch must not open the gate."""
        prev = self.readings.get(name)
        self.readings[name] = float(x) if prev is None else decay * prev + (1 - decay) * float(x)
        return self.readings[name]

    def observe_odm(self, step: int, counts: list[int], mean_losses: list[float]) -> None:
        self.w = self.exp3.observe(counts, mean_losses)
        self.updates += 1
        self.record(step)

    def record(self, step: int) -> None:
        """Weights in force from optimizer step ``step`` on (one entry per step: a later update overwrites),
        with the update's signals (hypergradient, trust readings) so a refused or damped update says why."""
        entry = {"step": int(step), "weights": self.weights_dict()}
        if self.info:
            entry["signals"] = dict(self.info)
        if self.history and self.history[-1]["step"] == int(step):
            self.history[-1] = entry
        else:
            self.history.append(entry)

    def add_passes(self, passes: dict) -> None:
        for k, v in passes.items():
            self.passes[k] = self.passes.get(k, 0) + int(v)

    def state(self) -> dict:
        return {"names": self.names, "method": self.method, "weights": [float(x) for x in self.w],
                "history": self.history, "passes": self.passes, "select_examples": self.select_examples,
                "update_seconds": self.update_seconds, "updates": self.updates,
                "source_examples": self.source_examples, "exp3": self.exp3.state() if self.exp3 else None,
                "refused": self.refused, "inner_grad_ref": self.inner_grad_ref, "inner_grad_ema": self.inner_grad_ema,
                "readings": self.readings}

    def load(self, state: dict) -> None:
        if state.get("names") != self.names or state.get("method") != self.method:
            raise ValueError(f"checkpoint weights are for sources {state.get('names')} / {state.get('method')}, "
                             f"this run has {self.names} / {self.method}")
        self.w = torch.tensor(state["weights"], dtype=torch.float64)
        self.history, self.passes = state["history"], state["passes"]
        self.select_examples, self.update_seconds = state["select_examples"], state["update_seconds"]
        self.updates, self.source_examples = state["updates"], state["source_examples"]
        self.refused = state.get("refused", 0)
        self.inner_grad_ref, self.inner_grad_ema = state.get("inner_grad_ref"), state.get("inner_grad_ema")
        self.readings = dict(state.get("readings") or {})
        if self.exp3 is not None and state.get("exp3"):
            self.exp3.load(state["exp3"])

    def save_weights(self, path: str | Path) -> Path:
        """``{"final": {name: w}, "history": [{"step": s, "weights": {...}}, ...]}``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"final": self.weights_dict(), "history": self.history}, indent=1) + "\n")
        return path

    def plot(self, path: str | Path, title: str = "") -> Path:
        from llmkit.train.common import plot_curves

        steps = [h["step"] for h in self.history]
        series = {n: (steps, [h["weights"][n] for h in self.history]) for n in self.names}
        return plot_curves(series, path, title=title or f"source weights ({self.method})", ylabel="weight")


class MixtureSampler(Sampler):
    """Index stream over concatenated sources: source ~ current weights, then a uniform row of that source."""

    def __init__(self, sizes: list[int], controller: WeightController, num_samples: int, seed: int = 0):
        self.sizes, self.controller, self.num_samples, self.seed = sizes, controller, num_samples, seed
        self.offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        self.epoch = 0

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        self.epoch += 1
        for _ in range(self.num_samples):
            k = int(rng.choice(len(self.sizes), p=self.controller.probs()))
            yield self.offsets[k] + int(rng.integers(self.sizes[k]))


class SourceIdCollator:
    def __init__(self, base):
        self.base = base

    def __call__(self, examples):
        ids = [int(e.get("source_id", -1)) for e in examples]
        batch = self.base([{k: v for k, v in e.items() if k != "source_id"} for e in examples])
        batch["source_id"] = torch.tensor(ids)
        return batch


class _StateCallback(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kw):
        if state.is_world_process_zero:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                (ckpt / STATE_FILE).write_text(json.dumps(self.trainer.hgms.state()))


class HgmsSFTTrainer(LlmkitOptimTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` drawing each example's source from ``controller``'s weights and updating them (see
    the module docstring); the keyword arguments after ``source_sizes`` are ``HgmsArguments``' settings."""

    def __init__(self, *args, controller: WeightController, source_sizes: list[int], probe_batch_size: int = 4,
                 param_last_layers: int = 2, param_regex: str | None = None, lanczos_iters: int = 8,
                 rtol: float = 1e-3, select_lr: float = 0.0, select_probes: int = 1, reference_model=None,
                 trust: dict | None = None, min_trust: float = 0.0, **kwargs):
        self.hgms = controller
        self.source_sizes = list(source_sizes)
        self.probe_batch_size = probe_batch_size
        self.param_last_layers, self.param_regex = param_last_layers, param_regex
        self.lanczos_iters, self.rtol, self.select_lr = lanczos_iters, rtol, select_lr
        self.select_probes = select_probes
        self.trust, self.min_trust = trust, min_trust  # hgms_trust's thresholds; None: never damp
        self.reference_model = reference_model
        self._last_update = -1
        super().__init__(*args, **kwargs)
        self.data_collator = SourceIdCollator(self.data_collator)
        # TRL drops rows whose completion is truncated away; count what is left of each source
        sid = np.asarray(list(self.train_dataset["source_id"]))
        if (np.diff(sid) < 0).any():
            raise ValueError("hgms: the prepared training rows are not in source order (shuffle_dataset?)")
        self.source_sizes = np.bincount(sid, minlength=controller.k).tolist()
        empty = [n for n, c in zip(controller.names, self.source_sizes) if c == 0]
        if empty:
            raise ValueError(f"hgms: no usable rows in source(s) {empty} after tokenization "
                             f"(max_length {self.args.max_length} leaves no completion token?)")
        ev = self.eval_dataset
        self.target_dataset = ev.get("target") if isinstance(ev, dict) else ev
        self._probe_rng = random.Random(self.args.seed * 1000 + self.args.process_index)
        self._select_gen = torch.Generator().manual_seed(self.args.seed * 1000 + self.args.process_index)
        self.add_callback(_StateCallback(self))
        if controller.method in ("hgms", "doge") and self.target_dataset is None:
            raise ValueError(f"weighting {controller.method} needs target_data")

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "source_id" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "source_id"]

    def _get_train_sampler(self, train_dataset=None):
        a = self.args
        if a.max_steps and a.max_steps > 0:
            n = a.max_steps * a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size
        else:
            n = sum(self.source_sizes)
        return MixtureSampler(self.source_sizes, self.hgms, n, seed=a.seed)

    # ---------------------------------------------------------------- probes
    def _device(self):
        return next(self.model.parameters()).device

    def _collate(self, rows):
        batch = self.data_collator(rows)
        batch.pop("source_id", None)
        dev = self._device()
        return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _probe_rows(self, k: int):
        off = sum(self.source_sizes[:k])
        idx = [off + self._probe_rng.randrange(self.source_sizes[k]) for _ in range(self.probe_batch_size)]
        return self._collate([self.train_dataset[i] for i in idx])

    def _target_batch(self):
        n = len(self.target_dataset)
        return self._collate([self.target_dataset[self._probe_rng.randrange(n)]
                              for _ in range(self.probe_batch_size)])

    def _reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes > 1:
            t = self.accelerator.reduce(t.to(self._device()), reduction="mean")
        return t.cpu()

    def _model_for_probes(self):
        return self.accelerator.unwrap_model(self.model)

    def update_weights(self, step: int) -> None:
        t0 = time.perf_counter()
        model = self._model_for_probes()
        method = self.hgms.method
        batches = [self._probe_rows(k) for k in range(self.hgms.k)]
        trust = 1.0
        if method == "doremi":
            losses, p = signals.per_source_losses(model, batches)
            if self.reference_model is not None:
                ref, p2 = signals.per_source_losses(self.reference_model, batches)
            else:  # peft: the base model is the adapter switched off
                with model.disable_adapter():
                    ref, p2 = signals.per_source_losses(model, batches)
            self.hgms.add_passes(p)
            self.hgms.add_passes(p2)
            score = self._reduce_mean(doremi_score(losses, ref))
            self.hgms.info = {"excess_" + n: float(x) for n, x in zip(self.hgms.names, score)}
        else:
            params = [p for _, p in signals.param_subset(model, self.param_last_layers, self.param_regex)]
            target = self._target_batch()
            if method == "doge":
                score, p = signals.doge_signal(model, params, batches, target)
                score = self._reduce_mean(score)
                self.hgms.add_passes(p)
                self.hgms.info = {"align_" + n: float(x) for n, x in zip(self.hgms.names, score)}
            else:
                hg, direction, info, p = signals.hgms_signal(
                    model, params, batches, target, self.hgms.w, iters=self.lanczos_iters, rtol=self.rtol,
                    select=self.select_lr > 0, probes=self.select_probes, generator=self._select_gen)
                hg = self._reduce_mean(hg)
                self.hgms.add_passes(p)
                score = hgms_score(hg)
                self.hgms.info = {"hypergrad_" + n: float(x) for n, x in zip(self.hgms.names, hg)}
                self.hgms.info.update({f"hgms_{k}": float(v) for k, v in info.items()})
                if self.trust is not None:  # every process must reach the same trust: reduce its inputs
                    gn, neg, res, gap = self._reduce_mean(torch.tensor(
                        [info["inner_grad_norm"], -info["ritz_min_rel"], info["solve_residual"],
                         info["newton_gap"]], dtype=torch.float64)).tolist()
                    c = self.hgms
                    t = hgms_trust(c.grad_ratio(gn), c.smooth("negative_curvature", max(neg, 0.0)),
                                   c.smooth("solve_residual", res), newton_gap=c.smooth("newton_gap", gap),
                                   **self.trust)
                    self.hgms.info.update({f"hgms_{k}": v for k, v in t.items()})
                    trust = t["trust"]
                if self.select_lr > 0:
                    direction = self._reduce_mean(direction).to(params[0].device)
                    with torch.no_grad():
                        for prm, d in zip(params, signals.bilevel.unflatten(direction, params)):
                            prm.sub_(self.select_lr * d)
                    self.hgms.select_examples += self.probe_batch_size
        self.hgms.apply_score(step, score, trust, self.min_trust)
        self.hgms.updates += 1
        self.hgms.update_seconds += time.perf_counter() - t0

    # ---------------------------------------------------------------- training
    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self.state.global_step
        if self.hgms.due(step) and step != self._last_update:
            self._last_update = step
            self.update_weights(step)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sid = inputs.pop("source_id", None)
        if sid is None or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        sid = sid.to(self._device())
        counts = torch.bincount(sid.clamp_min(0), minlength=self.hgms.k).double()
        captured = {}
        handle = None
        if self.hgms.method == "odm":
            def hook(_m, _i, out):
                captured["out"] = out
            handle = self.accelerator.unwrap_model(model).register_forward_hook(hook)
        try:
            res = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            if handle is not None:
                handle.remove()
        if self.hgms.method == "odm":
            out = captured.get("out")
            per_ex = self._per_example_loss(out, inputs)
            sums = torch.zeros(self.hgms.k, dtype=torch.float64, device=sid.device)
            sums.index_add_(0, sid.clamp_min(0), per_ex.double())
            stats = torch.cat([counts, sums])
            if self.accelerator.num_processes > 1:
                stats = self.accelerator.reduce(stats, reduction="sum")
            c, s = stats[:self.hgms.k].cpu(), stats[self.hgms.k:].cpu()
            mean = [float(s[i] / c[i]) if c[i] > 0 else 0.0 for i in range(self.hgms.k)]
            self.hgms.observe_odm(self.state.global_step, [int(x) for x in c], mean)
        for i in range(self.hgms.k):
            self.hgms.source_examples[i] += int(counts[i])
        return res

    @staticmethod
    def _per_example_loss(out, inputs) -> torch.Tensor:
        lp = getattr(out, "log_probs", None)
        if lp is not None and getattr(out, "label_mask", None) is not None:
            return (-lp.detach().float()).sum(-1) / out.label_mask.float().sum(-1).clamp_min(1)
        logits = out.logits[:, :-1].detach().float()
        target = inputs["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                reduction="none")
        return nll.sum(-1) / (target != -100).sum(-1).clamp_min(1)

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            logs.update({f"weight/{n}": w for n, w in self.hgms.weights_dict().items()})
            logs.update(self.hgms.info)
        return super().log(logs, *args, **kwargs)


def trainer_class() -> type:
    """``HgmsSFTTrainer`` (kept for callers of the older factory)."""
    return HgmsSFTTrainer
