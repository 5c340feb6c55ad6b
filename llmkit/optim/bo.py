"""Batched Bayesian optimization with ask/tell: GP batched Thompson sampling and a randomized neural variant.

**GP-BTS** (seed: "parallel Gaussian process bandit optimization ... GP batched Thompson sampling
(GP-BTS) ... the regret bound without the multiplicative factor on the batch size Q can be achieved
without the initial uncertainty-sampling phase"). ``BatchedThompsonSampling(bounds, batch_size)``:
each ``ask()`` fits a GP (botorch ``SingleTaskGP``, inputs scaled to the unit cube, outputs standardized,
hyperparameters by marginal likelihood) to everything told so far and returns ``batch_size`` points, each
the minimizer of an independent posterior sample path over a candidate set (scrambled Sobol points plus
Gaussian perturbations of the best points seen); botorch's ``MaxPosteriorSampling`` draws the joint
samples. There is no initial uncertainty-sampling phase: the first batch is Thompson sampling from the
prior (before any data a prior sample's minimizer is a uniformly placed point), and every later batch is
Thompson sampling from the posterior, as in the paper. Deviation: the sample paths are drawn on a finite
candidate set rather than maximized over the continuous domain (the usual practical discretization).

**Randomized neural BO** (seed: "kernel-based framework ... regularized nonlinear parametric models
trained on adaptively collected data ... randomized regularized policies that select points by
maximizing a trained random model"). ``RandomizedNeuralBO(bounds, batch_size)``: for each point of a
batch, draw a fresh random MLP ``g_theta0`` and random target perturbations ``e_i ~ N(0, noise^2)``,
train ``theta`` on ``sum_i (g_theta(x_i) - y_i - e_i)^2 + lam ||theta - theta0||^2`` (regularized toward the
random initialization: randomized regularized least squares, which is exact posterior sampling for a
linear model), and return the minimizer of the trained random model over a candidate set (we minimize,
the paper maximizes). Targets are standardized.

Both minimize. ``ask() -> list[list[float]]``, ``tell(points, values)``; ``best`` gives the best point
told so far. ``random_search`` is the baseline the tests compare with at equal evaluations.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch


class _AskTell:
    def __init__(self, bounds, batch_size: int, num_candidates: int | None, seed: int | None):
        b = np.asarray(bounds, dtype=float)
        if b.ndim != 2 or b.shape[1] != 2 or not np.all(b[:, 1] > b[:, 0]):
            raise ValueError("bounds must be a list of (low, high) pairs with low < high")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.bounds = b
        self.dim = b.shape[0]
        self.batch_size = int(batch_size)
        self.num_candidates = int(num_candidates or min(2048, 256 * self.dim))
        self.seed = 0 if seed is None else int(seed)
        self.rng = np.random.default_rng(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)
        self.X: list[list[float]] = []  # in the user's units
        self.y: list[float] = []
        self._round = 0

    def _to_unit(self, x):
        return (np.asarray(x, dtype=float) - self.bounds[:, 0]) / (self.bounds[:, 1] - self.bounds[:, 0])

    def _from_unit(self, u):
        return self.bounds[:, 0] + np.asarray(u) * (self.bounds[:, 1] - self.bounds[:, 0])

    def tell(self, points, values) -> None:
        points = [list(map(float, p)) for p in points]
        values = [float(v) for v in values]
        if len(points) != len(values):
            raise ValueError("tell() needs one value per point")
        for p in points:
            if len(p) != self.dim:
                raise ValueError(f"each point needs {self.dim} coordinates")
        self.X += points
        self.y += values

    @property
    def best(self) -> tuple[list[float], float] | None:
        if not self.y:
            return None
        i = int(np.argmin(self.y))
        return self.X[i], self.y[i]

    def _candidates(self) -> np.ndarray:
        from torch.quasirandom import SobolEngine

        sob = SobolEngine(self.dim, scramble=True, seed=self.seed * 1000 + self._round)
        cand = sob.draw(self.num_candidates).double().numpy()
        if self.y:  # local candidates around the best points seen (standard for Thompson sampling)
            order = np.argsort(self.y)[: min(5, len(self.y))]
            centers = self._to_unit(np.asarray(self.X)[order])
            k = self.num_candidates // 4
            loc = centers[self.rng.integers(0, len(centers), k)] + 0.05 * self.rng.standard_normal((k, self.dim))
            cand = np.vstack([cand, np.clip(loc, 0.0, 1.0)])
        self._round += 1
        return cand


class BatchedThompsonSampling(_AskTell):
    """GP batched Thompson sampling (GP-BTS), minimizing; no initial uncertainty-sampling phase."""

    def __init__(self, bounds, batch_size: int, *, num_candidates: int | None = None, seed: int | None = None):
        super().__init__(bounds, batch_size, num_candidates, seed)

    def ask(self) -> list[list[float]]:
        cand = self._candidates()
        if len(self.y) < 2:  # the prior has no information about location: its sample minimizers are uniform
            idx = self.rng.choice(len(cand[: self.num_candidates]), self.batch_size, replace=False)
            return [list(map(float, self._from_unit(cand[i]))) for i in idx]
        from botorch.fit import fit_gpytorch_mll
        from botorch.generation.sampling import MaxPosteriorSampling
        from botorch.models import SingleTaskGP
        from botorch.models.transforms.outcome import Standardize
        from gpytorch.mlls import ExactMarginalLogLikelihood

        torch.manual_seed(self.seed * 7919 + self._round)
        X = torch.tensor(self._to_unit(np.asarray(self.X)), dtype=torch.double)
        Y = -torch.tensor(self.y, dtype=torch.double).unsqueeze(-1)  # botorch maximizes
        model = SingleTaskGP(X, Y, outcome_transform=Standardize(m=1))
        with contextlib.suppress(Exception):  # a failed fit keeps the default hyperparameters
            fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
        sampler = MaxPosteriorSampling(model=model, replacement=False)
        with torch.no_grad():
            picks = sampler(torch.tensor(cand, dtype=torch.double), num_samples=self.batch_size)
        return [list(map(float, self._from_unit(p.numpy()))) for p in picks]


class RandomizedNeuralBO(_AskTell):
    """Randomized regularized neural policy: each batch point minimizes a trained random MLP."""

    def __init__(self, bounds, batch_size: int, *, hidden: int = 32, reg: float = 1e-2, noise: float = 0.1,
                 steps: int = 150, lr: float = 1e-2, num_candidates: int | None = None, seed: int | None = None):
        super().__init__(bounds, batch_size, num_candidates, seed)
        self.hidden, self.reg, self.noise, self.steps, self.lr = hidden, reg, noise, steps, lr

    def _random_model(self, X: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
        net = torch.nn.Sequential(torch.nn.Linear(self.dim, self.hidden), torch.nn.Tanh(),
                                  torch.nn.Linear(self.hidden, self.hidden), torch.nn.Tanh(),
                                  torch.nn.Linear(self.hidden, 1)).double()
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=self.gen, dtype=torch.double)
                        * (1.0 / math.sqrt(max(p.shape[-1], 1))))
        theta0 = [p.detach().clone() for p in net.parameters()]
        if len(y):
            target = y + self.noise * torch.randn(y.shape, generator=self.gen, dtype=torch.double)
            opt = torch.optim.Adam(net.parameters(), lr=self.lr)
            for _ in range(self.steps):
                opt.zero_grad()
                loss = ((net(X).squeeze(-1) - target) ** 2).sum()
                loss = loss + self.reg * sum(((p - p0) ** 2).sum() for p, p0 in zip(net.parameters(), theta0))
                loss.backward()
                opt.step()
        return net

    def ask(self) -> list[list[float]]:
        cand = torch.tensor(self._candidates(), dtype=torch.double)
        X = torch.tensor(self._to_unit(np.asarray(self.X, dtype=float).reshape(-1, self.dim)), dtype=torch.double)
        y = torch.tensor(self.y, dtype=torch.double)
        if len(y) > 1:
            y = (y - y.mean()) / (y.std() + 1e-12)
        out, taken = [], set()
        for _ in range(self.batch_size):
            net = self._random_model(X, y)
            with torch.no_grad():
                vals = net(cand).squeeze(-1).numpy()
            for i in np.argsort(vals):
                if int(i) not in taken:
                    taken.add(int(i))
                    out.append(list(map(float, self._from_unit(cand[int(i)].numpy()))))
                    break
        return out


def random_search(f, bounds, budget: int, seed: int | None = None) -> tuple[list[float], float, list[float]]:
    """Baseline: ``budget`` uniform points; returns (best point, best value, best-so-far history)."""
    rng = np.random.default_rng(seed)
    b = np.asarray(bounds, dtype=float)
    best, bx, hist = math.inf, None, []
    for _ in range(budget):
        x = b[:, 0] + rng.random(len(b)) * (b[:, 1] - b[:, 0])
        v = float(f(list(x)))
        if v < best:
            best, bx = v, list(map(float, x))
        hist.append(best)
    return bx, best, hist


def run_ask_tell(opt, f, budget: int) -> tuple[list[float], float, list[float]]:
    """Drive an ask/tell optimizer for ``budget`` evaluations of ``f(point) -> float``; best-so-far history."""
    hist: list[float] = []
    while len(hist) < budget:
        pts = opt.ask()[: budget - len(hist)]
        vals = [float(f(p)) for p in pts]
        opt.tell(pts, vals)
        for v in vals:
            hist.append(min(v, hist[-1]) if hist else v)
    x, v = opt.best
    return x, v, hist


def branin(x) -> float:
    """Branin on [-5, 10] x [0, 15]; minimum 0.397887."""
    x1, x2 = x
    b, c, r, s, t = 5.1 / (4 * math.pi ** 2), 5 / math.pi, 6.0, 10.0, 1 / (8 * math.pi)
    return (x2 - b * x1 ** 2 + c * x1 - r) ** 2 + s * (1 - t) * math.cos(x1) + s


def hartmann3(x) -> float:
    """Hartmann-3 on [0, 1]^3; minimum -3.86278."""
    a = np.array([[3.0, 10, 30], [0.1, 10, 35], [3.0, 10, 30], [0.1, 10, 35]])
    p = 1e-4 * np.array([[3689, 1170, 2673], [4699, 4387, 7470], [1091, 8732, 5547], [381, 5743, 8828]])
    alpha = np.array([1.0, 1.2, 3.0, 3.2])
    x = np.asarray(x, dtype=float)
    return float(-np.sum(alpha * np.exp(-np.sum(a * (x - p) ** 2, axis=1))))


TEST_FUNCTIONS = {"branin": (branin, [(-5.0, 10.0), (0.0, 15.0)], 0.397887),
                  "hartmann3": (hartmann3, [(0.0, 1.0)] * 3, -3.86278)}

__all__ = ["TEST_FUNCTIONS", "BatchedThompsonSampling", "RandomizedNeuralBO", "branin", "hartmann3",
           "random_search", "run_ask_tell"]
