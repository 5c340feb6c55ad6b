"""HALO on any HF/TRL trainer: one callback, plus a mixin that wires it in and logs its state.

The callback drives a ``HaloController`` from the Trainer's own events:
``on_step_begin`` (freeze lambda = 0 units before the forward pass),
``on_pre_optimizer_step`` / ``on_optimizer_step`` (scale the update). No
Trainer event fires between the last backward pass and gradient clipping, so
``HaloTrainerMixin`` also overrides ``_clip_grad_norm`` / ``_get_grad_norm``
to drop frozen units' gradients first: the clipped (and logged) norm covers
only the units that update. A bare ``HaloCallback`` on another Trainer warns
when that matters (frozen units run backward and ``max_grad_norm > 0``). The
schedule is a pure function of ``state.global_step``, so a run resumed from a
checkpoint continues on the same path. The optimizer the Trainer builds
already holds every trainable parameter (nothing is frozen when it is
created), which is what lets units join later.

``HaloSFTTrainer`` (SFT) and ``HaloGKDTrainer`` (knowledge distillation: TRL's
GKD with ``lmbda=0`` is off-policy KD on the dataset's completions) are the
same mixin over two TRL trainers.
"""

from __future__ import annotations

import warnings

from transformers import TrainerCallback
from trl import SFTTrainer

with warnings.catch_warnings():  # TRL marks its experimental package with a warning on import
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDTrainer

from llmkit.optim.hf import LlmkitOptimTrainerMixin
from llmkit.train.halo.controller import HaloController, optimizer_state_bytes
from llmkit.train.halo.schedule import Schedule, homotopy_t
from llmkit.train.halo.units import layer_units


def sharded_engine(args) -> str | None:
    """"deepspeed" / "fsdp" when the run shards parameters, else None. Under `accelerate launch --config_file
    zero2.yaml` only ``deepspeed_plugin`` (and accelerate's env flag) is set, never ``args.deepspeed``."""
    import os

    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None \
            or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        return "deepspeed"
    if getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return "fsdp"
    return None


class HaloCallback(TrainerCallback):
    def __init__(self, method: str = "halo", homotopy_fraction: float = 0.5, ramp_width: float = 0.25,
                 initial_units: int = 1, lisa_layers: int = 2, lisa_interval: int = 5,
                 skip_frozen_backward: bool = True, seed: int = 0):
        self.schedule_kwargs = {"method": method, "homotopy_fraction": homotopy_fraction, "ramp_width": ramp_width,
                                    "initial_units": initial_units, "lisa_layers": lisa_layers,
                                    "lisa_interval": lisa_interval, "seed": seed}
        self.skip_frozen_backward = skip_frozen_backward
        self.controller: HaloController | None = None
        self.t = 0.0
        self.optimizer_bytes: list[int] = []  # after each optimizer step
        self.clips_active_units_only = False  # set by HaloTrainerMixin, which drops frozen grads before clipping

    def on_train_begin(self, args, state, control, model=None, **kw):
        units = layer_units(model)
        if not units:
            raise ValueError("HALO found no trainable parameter in the model")
        if sharded_engine(args):
            raise ValueError("HALO scales per-parameter updates and needs unsharded parameters: "
                             "run it with DDP (accelerate's default) rather than DeepSpeed or FSDP")
        schedule = Schedule(num_units=len(units), **self.schedule_kwargs)
        # DDP's reducer expects a gradient for every parameter it registered; freezing mid-run breaks it.
        skip = self.skip_frozen_backward and args.world_size == 1
        self.controller = HaloController(units, schedule, state.max_steps, skip_frozen_backward=skip)
        if args.max_grad_norm and args.max_grad_norm > 0 and not skip and not self.clips_active_units_only:
            warnings.warn("HaloCallback on a Trainer without HaloTrainerMixin: frozen units run backward and "
                          "their gradients count in the max_grad_norm clipping of the active units; use "
                          "HaloSFTTrainer / HaloGKDTrainer (or HaloTrainerMixin) to clip over active units only",
                          stacklevel=2)
        if skip and args.gradient_checkpointing:
            # reentrant checkpointing yields no parameter grads when the block input does not require grad
            model.enable_input_require_grads()
            self.controller.keep_input_requires_grad = True
        if getattr(model, "_require_grads_hook", None) is not None:  # e.g. PEFT + checkpointing set it up
            self.controller.keep_input_requires_grad = True

    def on_step_begin(self, args, state, control, **kw):
        self.t = homotopy_t(state.global_step, state.max_steps, self.controller.schedule.homotopy_fraction)
        self.controller.before_forward(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.controller.before_step(state.global_step, optimizer)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.controller.after_step(optimizer)
        self.optimizer_bytes.append(optimizer_state_bytes(optimizer))

    def on_train_end(self, args, state, control, **kw):
        if self.controller is not None:
            self.controller.restore_requires_grad()

    def stats(self) -> dict[str, float]:
        if self.controller is None:
            return {}
        out = {"halo_t": self.t, **self.controller.stats()}
        if self.optimizer_bytes:
            out["optimizer_state_mb"] = self.optimizer_bytes[-1] / 2**20
        return out


class HaloTrainerMixin:
    """Adds a ``HaloCallback`` (built from ``halo_callback_kwargs``) and logs its state with the losses."""

    def __init__(self, *args, halo_callback_kwargs: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.halo = HaloCallback(**(halo_callback_kwargs or {}))
        self.halo.clips_active_units_only = True
        self.add_callback(self.halo)

    def _drop_frozen_grads(self) -> None:
        if self.halo.controller is not None:
            self.halo.controller.drop_frozen_grads(self.state.global_step)

    def _clip_grad_norm(self, model):
        self._drop_frozen_grads()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm == 0: the logged norm is still the active units'
            self._drop_frozen_grads()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:  # training logs only; eval logs stay the trainer's own
            logs.update(self.halo.stats())
        return super().log(logs, *args, **kwargs)


class HaloSFTTrainer(LlmkitOptimTrainerMixin, HaloTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with HALO unfreezing (``halo_callback_kwargs``: ``HaloCallback``'s arguments)."""


class HaloGKDTrainer(LlmkitOptimTrainerMixin, HaloTrainerMixin, GKDTrainer):
    """TRL's ``GKDTrainer`` (``lmbda=0``: off-policy KD) with HALO unfreezing."""


def trainer_class(distill: bool) -> type:
    """``HaloGKDTrainer`` for distillation, else ``HaloSFTTrainer``."""
    return HaloGKDTrainer if distill else HaloSFTTrainer
