"""Layer-trainability schedules: HALO's homotopy ramps and the three baselines.

Every schedule maps (optimizer step, total steps) to one weight per *unit*,
lambda_k in [0, 1]. Units are ordered output -> input (see ``units.py``):
unit 0 is the output head (+ final norm), then the decoder layers from the
last to the first, then the input embeddings.

HALO (the formulation used here; the paper's abstract only says "a continuous
homotopy parameter and a sequence of monotonically increasing auxiliary
functions"):

    t(s)        = min(1, s / (f * S))            (f = homotopy_fraction, S = total steps; f = 0 -> t = 1)
    lambda_k(t) = 1                                   for k < m (the m initial units)
    lambda_k(t) = smoothstep((t - a_k) / w)           otherwise, clipped to [0, 1]
    a_k         = (k - m) / (n - 1) * (1 - w)         (n = K - m ramping units; a_k = 0 if n == 1)
    smoothstep(x) = 3x^2 - 2x^3                       (C^1: lambda and d lambda/dt are continuous)

so each lambda_k is non-decreasing in t, lambda_k(t) >= lambda_{k+1}(t)
(output layers lead), lambda_k(0) = 0 for every ramping unit and
lambda_k(1) = 1 for all: at t = 0 only the output unit(s) train, at t = 1 the
problem is full finetuning. ``w`` (ramp_width, a fraction of the t range)
sets how many units are mid-ramp at once.

Baselines, same interface:
  * ``full``     lambda = 1 everywhere.
  * ``stepwise`` the same unfreezing order with hard steps: unit k switches
                 from 0 to 1 when HALO's ramp for it reaches one half
                 (t >= a_k + w/2) -- layer-wise unfreezing without homotopy.
  * ``lisa``     LISA-style sampling: the output and input units always train;
                 every ``lisa_interval`` steps a fresh random set of
                 ``lisa_layers`` decoder layers is active, the rest frozen. The
                 draw is a pure function of (seed, step // interval), so every
                 process of a distributed run and a resumed run agree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

METHODS = ("halo", "full", "stepwise", "lisa")


def smoothstep(x: float) -> float:
    x = min(1.0, max(0.0, x))
    return x * x * (3.0 - 2.0 * x)


def homotopy_t(step: int, total_steps: int, fraction: float) -> float:
    """The homotopy parameter t in [0, 1] after ``step`` completed optimizer steps."""
    if fraction <= 0 or total_steps <= 0:
        return 1.0
    return min(1.0, step / (fraction * total_steps))


@dataclass(frozen=True)
class Schedule:
    """Per-unit trainability weights for one of ``METHODS``."""

    method: str = "halo"
    num_units: int = 1
    homotopy_fraction: float = 0.5
    ramp_width: float = 0.25
    initial_units: int = 1
    lisa_layers: int = 2
    lisa_interval: int = 5
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown schedule method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.num_units < 1:
            raise ValueError("a schedule needs at least one unit")
        if not 0 < self.ramp_width <= 1:
            raise ValueError(f"ramp_width must be in (0, 1], got {self.ramp_width}")
        if not 0 <= self.homotopy_fraction <= 1:
            raise ValueError(f"homotopy_fraction must be in [0, 1], got {self.homotopy_fraction}")
        if self.initial_units < 1:
            raise ValueError(f"initial_units must be >= 1, got {self.initial_units}")
        if self.lisa_interval < 1 or self.lisa_layers < 0:
            raise ValueError("lisa_interval must be >= 1 and lisa_layers >= 0")

    def _ramp_starts(self) -> list[float]:
        m = min(self.initial_units, self.num_units)
        n = self.num_units - m
        w = self.ramp_width
        return [(k - m) / (n - 1) * (1 - w) if n > 1 else 0.0 for k in range(m, self.num_units)]

    def lambdas_at(self, t: float) -> list[float]:
        """lambda_k(t) for halo/stepwise/full (LISA depends on the step, use ``lambdas``)."""
        if self.method in ("full", "lisa"):
            return [1.0] * self.num_units
        m = min(self.initial_units, self.num_units)
        w = self.ramp_width
        lam = [1.0] * m
        for a in self._ramp_starts():
            if self.method == "halo":
                lam.append(smoothstep((t - a) / w))
            else:  # stepwise: the same order, a hard switch at the ramp's midpoint
                lam.append(1.0 if t >= a + w / 2 else 0.0)
        # ramps that start 1e-16 apart can come out one ulp in the wrong order (smoothstep is not
        # monotone in floating point); the running minimum keeps output-before-input exact
        for k in range(1, len(lam)):
            lam[k] = min(lam[k], lam[k - 1])
        return lam

    def lambdas(self, step: int, total_steps: int) -> list[float]:
        """Weights for the optimizer step that follows ``step`` completed steps."""
        if self.method == "lisa":
            return self._lisa(step)
        return self.lambdas_at(homotopy_t(step, total_steps, self.homotopy_fraction))

    def _lisa(self, step: int) -> list[float]:
        if self.num_units <= 2:
            return [1.0] * self.num_units
        middle = list(range(1, self.num_units - 1))  # decoder layers; 0 = head, last = embeddings
        rng = random.Random(self.seed * 1_000_003 + step // self.lisa_interval)
        active = set(rng.sample(middle, min(self.lisa_layers, len(middle))))
        return [1.0 if k in active or k in (0, self.num_units - 1) else 0.0 for k in range(self.num_units)]
