"""HALO: Homotopy-Augmented Layer Optimization for supervised post-training (SFT and distillation).

Paper: "HALO", homotopy-based layer-wise supervised post-training (SFT and KD), NeurIPS 2026. Layer-wise
post-training saves compute but starves early features; HALO adds a homotopy
parameter t in [0, 1] and monotonically increasing auxiliary functions lambda_l(t)
so that training deforms continuously from a restricted problem (output layers
only) to full finetuning, unfreezing from the output back to the input.

Algorithm as implemented here (details in ``schedule.py`` and ``controller.py``):
  1. Group parameters into units ordered output -> input: LM head (+ final norm),
     decoder layers last to first, input embeddings (``units.py``).
  2. t = min(1, step / (fraction * max_steps)); lambda_k(t) = smoothstep((t - a_k) / w)
     with staggered starts a_k, so lambda is C^1, monotone in t, ordered output first,
     lambda(0) = 1 only for the initial unit(s), lambda(1) = 1 for all.
  3. Every unit is in the optimizer from step 0 (the HF Trainer builds its optimizer
     only from parameters that require grad at creation); each optimizer step is
     applied as theta_k += lambda_k(t) * (step_k), i.e. the update, not the gradient,
     is scaled. lambda = 0 units are skipped outright (no update, no weight decay, no
     optimizer state, and, single-process, no backward through them).
  4. Baselines on the same machinery: full finetuning, step-wise unfreezing (hard
     switches, no homotopy), LISA-style random layer sampling.

Deviations from the paper: the abstract does not give the auxiliary functions or
how lambda enters the objective. We use smoothstep ramps and scale the optimizer
update, which for SGD equals gradient flow on the homotopy objective with
per-layer preconditioner Lambda(t) and for Adam keeps lambda meaningful (Adam
normalises away a scaled gradient). A tied LM head / input embedding matrix has
two roles: the head role trains from t = 0 with the output unit, the input
role is the last unit and joins last: its share of the shared matrix's
gradient (through the embedding lookup) is cut while lambda_e = 0 and scaled
by lambda_e on its ramp (a gradient-level homotopy for that role, since the
one tensor has one update; ``controller.py`` says why we do not untie). Under DDP frozen units still run
backward (DDP needs a fixed set of parameters with gradients); their gradients are dropped before the
Trainer takes the global norm, so ``max_grad_norm`` clips over the units that update only. DeepSpeed/FSDP
(sharded parameters) are refused. The homotopy is update scaling rather than per-unit learning-rate groups
(the same update for AdamW): it works with any optimizer and schedule the Trainer builds and skips frozen
units' state (``controller.py`` says why).

Use: ``HaloSFTTrainer`` / ``HaloGKDTrainer`` (``trainer.py``), or a ``HaloCallback`` on any transformers
Trainer; the CLI recipe is ``recipe.py``. ``bench/halo.py`` compares it with the baselines (bench/results/halo.md).
"""

from llmkit.train.halo.controller import HaloController, optimizer_state_bytes
from llmkit.train.halo.schedule import METHODS, Schedule, homotopy_t, smoothstep
from llmkit.train.halo.units import Unit, layer_units

__all__ = [
           "METHODS",
           "HaloController",
           "Schedule",
           "Unit",
           "homotopy_t",
           "layer_units",
           "optimizer_state_bytes",
           "smoothstep",
]
