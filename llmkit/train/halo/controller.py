"""Apply per-unit weights lambda_k to an optimizer that holds every unit from the start.

Why update scaling rather than gradient scaling: Adam-type optimizers divide by the gradient's running RMS, so
multiplying a gradient by lambda barely changes the step, and decoupled weight decay moves a parameter even
when its gradient is zero. Scaling the *update* works for any optimizer:

    theta_k <- theta_k + lambda_k(t) * (optimizer_step(theta_k) - theta_k)

  * lambda_k = 0: the unit's gradient is set to None before the step, which torch optimizers treat as "skip
    this parameter": no update, no weight decay, and no optimizer state is ever allocated for it (the memory
    saving of layer-wise training).
  * 0 < lambda_k < 1: the unit is snapshotted, stepped, and blended back (only ramping units pay for the
    snapshot).
  * lambda_k = 1: untouched: with every lambda at 1 the step is the plain optimizer's (full finetuning).

Optionally (``skip_frozen_backward``) units with lambda = 0 get ``requires_grad=False`` before the forward
pass so backpropagation stops at the lowest unit that trains -- the compute saving. Under DDP that would break
the gradient reducer's bookkeeping, so callers turn it off there (gradients are computed and discarded).

Gradient clipping: the HF Trainer clips the global gradient norm before any optimizer-step callback runs.
``drop_frozen_grads`` is therefore called by ``HaloTrainerMixin`` just before the norm is taken, so the norm
(and the clipping factor) covers only the units that update; frozen units' gradients (present under DDP, after
the all-reduce of the last micro-batch) never shrink the active units' step. Units on their ramp count in
full: their gradient is what the optimizer sees, only their update is scaled.

Why not per-unit param groups with learning-rate multipliers (the same update for AdamW): they would replace
the optimizer, scheduler and decay grouping the Trainer (or ``LlmkitOptimTrainerMixin``) builds, would not skip
lambda = 0 units (a zero learning rate still allocates state) nor fix the clipping above, and differ for
optimizers whose update is not proportional to the learning rate (schedule-free averaging).

Tied LM head / input embedding (SmolLM2, Qwen2.5-0.5B/1.5B, Gemma tie them): the one matrix W gets g = g_head
+ g_lookup. The head role is unit 0 and trains from t = 0; the input role is the last unit
(``Unit.tied_input``), which owns no parameter. A forward hook on the embedding module gates the lookup's
share: lambda_e = 0 -> the lookup output is detached (W gets g_head only, and backprop can stop at the lowest
trained layer); 0 < lambda_e < 1 -> its gradient is multiplied by lambda_e (W gets g_head + lambda_e
g_lookup); lambda_e = 1 -> untouched. So the input role joins last, as the order says. This is a
gradient-level homotopy for that one role (W has a single update, which cannot be split by role); untying
instead would change the model (a second 28M-parameter matrix for SmolLM2-135M, 21% of it, with its Adam
state) and the comparison with full finetuning of the tied model. W's *values* still move from t = 0 through
the head's updates: that is what tying means.
"""

from __future__ import annotations

import torch

from llmkit.train.halo.schedule import Schedule
from llmkit.train.halo.units import Unit


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer


def optimizer_state_bytes(optimizer) -> int:
    total = 0
    for state in _inner(optimizer).state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


class HaloController:
    def __init__(self, units: list[Unit], schedule: Schedule, total_steps: int,
                 skip_frozen_backward: bool = True, drop_frozen_state: bool | None = None):
        if schedule.num_units != len(units):
            raise ValueError(f"schedule has {schedule.num_units} units but the model has {len(units)}")
        self.units = units
        self.schedule = schedule
        self.total_steps = total_steps
        self.skip_frozen_backward = skip_frozen_backward
        # LISA re-creates its optimizer at each re-draw, so frozen layers keep no state; do the same.
        self.drop_frozen_state = schedule.method == "lisa" if drop_frozen_state is None else drop_frozen_state
        self.current: list[float] = [1.0] * len(units)
        self._snapshots: list[tuple[torch.nn.Parameter, torch.Tensor, float]] = []
        # reentrant gradient checkpointing needs the lookup output to require grad (set by HaloCallback)
        self.keep_input_requires_grad = False
        self._tied_k = next((k for k, u in enumerate(units) if u.tied_input is not None), None)
        self._tied_hook = None
        if self._tied_k is not None:
            self._tied_hook = units[self._tied_k].tied_input.register_forward_hook(self._gate_tied_input)

    def _gate_tied_input(self, module, args, out):
        """Forward hook on the tied input embedding: scale (or cut) the gradient its lookup sends to W."""
        lam = self.current[self._tied_k]
        if lam >= 1 or not torch.is_tensor(out) or not out.requires_grad:
            return out
        if lam <= 0:
            cut = out.detach()
            return cut.requires_grad_(True) if self.keep_input_requires_grad else cut
        out.register_hook(lambda g: g * lam)
        return out

    def lambdas(self, step: int) -> list[float]:
        return self.schedule.lambdas(step, self.total_steps)

    def before_forward(self, step: int) -> None:
        """Call before the forward/backward passes of the step that follows ``step`` completed steps."""
        self.current = self.lambdas(step)
        if not self.skip_frozen_backward:
            return
        for unit, lam in zip(self.units, self.current):
            for p in unit.params:
                p.requires_grad_(lam > 0)

    def drop_frozen_grads(self, step: int) -> None:
        """Set the gradients of lambda = 0 units to None for the step that follows ``step`` completed steps.

        Called before the global gradient norm is taken (``HaloTrainerMixin``), so norm and clipping
        cover only the units that update: when frozen units run backward (DDP, or
        ``skip_frozen_backward=False``), their gradients would otherwise inflate the norm and shrink
        the active units' clipped step. Idempotent; ``before_step`` calls it again."""
        self.current = self.lambdas(step)
        for unit, lam in zip(self.units, self.current):
            if lam <= 0:
                for p in unit.params:
                    p.grad = None

    def before_step(self, step: int, optimizer) -> None:
        self.drop_frozen_grads(step)
        self._snapshots = []
        for unit, lam in zip(self.units, self.current):
            if 0 < lam < 1:
                self._snapshots.extend((p, p.detach().clone(), lam) for p in unit.params if p.grad is not None)

    @torch.no_grad()
    def after_step(self, optimizer) -> None:
        for p, old, lam in self._snapshots:
            p.lerp_(old, 1.0 - lam)  # = old + lam * (stepped - old)
        self._snapshots = []
        if self.drop_frozen_state:
            state = _inner(optimizer).state
            for unit, lam in zip(self.units, self.current):
                if lam <= 0:
                    for p in unit.params:
                        state.pop(p, None)

    def restore_requires_grad(self) -> None:
        """End of training: every parameter trainable again and the tied-input gate removed."""
        if self._tied_hook is not None:
            self._tied_hook.remove()
            self._tied_hook = None
        for unit in self.units:
            for p in unit.params:
                p.requires_grad_(True)

    def stats(self) -> dict[str, float]:
        active = sum(1 for lam in self.current if lam > 0)
        return {
            "halo_active_units": float(active),
            "halo_mean_lambda": sum(self.current) / len(self.current),
        }
