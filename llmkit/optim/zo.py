"""Zeroth-order (ZO) gradient estimators: MeZO's seed trick, LQZO's structured perturbations, RSC-ZO clipping.

Papers (NeurIPS 2026):

* **RSC-ZO** ("Robust Scalar-Clipped Zeroth-Order method" for heavy-tailed noise, NeurIPS 2026): a two-point
  estimator that clips each *scalar* directional derivative before aggregation, which keeps high-probability
  convergence under heavy-tailed (possibly infinite-variance) gradient noise; a momentum variant too.
* **LQZO** ("Low-rank Quantized Zeroth-Order optimizer" for quantized LLM finetuning, NeurIPS 2026): perturbations
  of each (scale) matrix are low-rank ``U V^T`` with Rademacher ("binary-aggregated Gaussian") factors, and
  matrices are regrouped into a more isotropic shape before factorization.
* Anchors: MeZO (in-place perturbation regenerated from a seed, projected gradient ``(l+ - l-) / 2 mu``, no
  optimizer state) and LOZO (low-rank perturbations, V resampled lazily).

Algorithm (one step, ``q`` directions)::

    for k in 1..q:   z_k = direction(seed_k)           # regenerated from the seed, never stored
                     d_k = (L(x + mu z_k) - L(x - mu z_k)) / (2 mu)
                     d_k = clip(d_k, -c, c)             # RSC-ZO / QZO; c = None: no clipping
    g_hat = (1/q) sum_k d_k z_k ;  x <- x - lr * g_hat

With Gaussian ``z`` and no clipping ``E[g_hat] = grad L_mu(x)``, the gradient of the Gaussian-smoothed loss
(Stein's identity); any ``z`` with ``E[z z^T] = I`` gives the same expectation up to ``O(mu^2)``.

Public pieces: ``rsc_zo_gradient(loss_fn, params, num_directions, mu, clip)`` (the estimate, params perturbed in
place and restored bit-exactly); ``RSCZO`` (an optimizer with RSC-ZO's momentum, ``step(closure)`` with a
loss-only closure); ``direction(shape, seed, ...)`` (iid Gaussian / Rademacher, or low-rank ``U V^T / sqrt(r)``
with unit-variance entries, optionally on ``isotropic_shape``); ``SeedZO``, MeZO's seed trick over any list of
tensors: ``estimate`` returns the q projected derivatives and ``update`` applies ``x -= lr * mean_k d_k z_k``
regenerating each ``z_k``. A tensor is perturbed additively (``add_nonneg`` also projects onto ``x >= 0``,
QZO's rule for its scales) or multiplicatively (``x * (1 + mu z)``, a step on ``log |x|``, for quantization
scales spanning decades: a scale never dies); restore is exact (a copy, cheap for scales) or MeZO's
regenerate-and-subtract (no copy, a few ulps of drift per step).

Isotropy-enhanced regrouping (LQZO's third piece; the abstract gives no formula, this is our reading). A
group-wise scale matrix is very elongated, and at rank r the random factor on its short side spans most of
it while the long side gets only r directions. The low-rank directional derivative ``<U V^T, G>`` has excess
kurtosis growing with ``||G^T G||_F^2 / ||G||_F^4``, about ``1/m + 1/n`` for a generic m x n matrix:
dominated by the short side. ``isotropic_shape`` regroups the matrix, whole rows together, into the
``(m / k, k n)`` shape closest to square: still unbiased, the projected derivative closer to Gaussian, so the
variance drops (the isotropy tests of the ZO estimators check both). The paper may regroup otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

DISTRIBUTIONS = ("gaussian", "rademacher")
MODES = ("add", "add_nonneg", "mul")
_MASK = (1 << 63) - 1


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (SplitMix64 steps), so streams for (step, k, tensor) differ."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & _MASK


def _generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def sample(shape, generator: torch.Generator, distribution: str = "gaussian", device=None,
           dtype=torch.float32) -> torch.Tensor:
    """iid entries with mean 0 and variance 1: standard normal or Rademacher (+-1 with probability 1/2)."""
    if distribution == "gaussian":
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if distribution == "rademacher":
        bits = torch.randint(0, 2, shape, generator=generator, device=device, dtype=torch.int8)
        return bits.to(dtype).mul_(2).sub_(1)
    raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}")


def isotropic_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D regrouping used by isotropy-enhanced estimation: ``(m/k, k*n)`` closest to square.

    Whole rows of the ``(m, n)`` matrix stay together (k consecutive rows form one regrouped row),
    k divides m, and k minimises ``|log(m/k) - log(k n)|``. A tensor with more than 2 dims is first
    viewed as ``(shape[0], prod(rest))``; a 1-D tensor as ``(1, n)``.
    """
    if len(shape) == 0:
        return (1, 1)
    m = int(shape[0])
    n = int(math.prod(shape[1:])) if len(shape) > 1 else 1
    if len(shape) == 1:
        m, n = 1, m
    best, best_k = None, 1
    for k in range(1, m + 1):
        if m % k:
            continue
        gap = abs(math.log(m / k) - math.log(k * n))
        if best is None or gap < best - 1e-12:
            best, best_k = gap, k
    return (m // best_k, best_k * n)


def direction(shape: Sequence[int], seed: int, *, distribution: str = "gaussian", rank: int = 0,
              isotropic: bool = False, v_seed: int | None = None, device=None,
              dtype=torch.float32) -> torch.Tensor:
    """One perturbation tensor of ``shape``, entirely determined by ``seed`` (and ``v_seed``).

    ``rank == 0`` (or a tensor with fewer than 2 dims, or rank >= the short side): iid entries.
    ``rank > 0``: ``U V^T / sqrt(rank)`` on the 2-D view (``isotropic_shape`` when ``isotropic``,
    else ``(shape[0], prod(rest))``), U and V with iid ``distribution`` entries; U comes from ``seed``,
    V from ``v_seed`` (LOZO's lazily resampled factor; defaults to a stream derived from ``seed``).
    Every entry has mean 0 and variance 1 either way.
    """
    shape = tuple(int(s) for s in shape)
    if rank and len(shape) >= 2:
        m, n = isotropic_shape(shape) if isotropic else (shape[0], int(math.prod(shape[1:])))
        if rank < min(m, n):
            u = sample((m, rank), _generator(seed, device), distribution, device, dtype)
            vs = v_seed if v_seed is not None else mix_seed(seed, 0x56)
            v = sample((n, rank), _generator(vs, device), distribution, device, dtype)
            return (u @ v.T).mul_(1.0 / math.sqrt(rank)).reshape(shape)
    return sample(shape, _generator(seed, device), distribution, device, dtype)


# ----------------------------------------------------------------------------- RSC-ZO, generic API


def _clip(d: float, clip: float | None) -> float:
    if clip is None:
        return d
    if clip <= 0:
        raise ValueError(f"clip must be positive or None, got {clip}")
    return max(-clip, min(clip, d))


@torch.no_grad()
def rsc_zo_gradient(loss_fn: Callable[[], torch.Tensor | float], params: Sequence[torch.Tensor],
                    num_directions: int, mu: float, clip: float | None, *,
                    generator: torch.Generator | None = None, distribution: str = "gaussian") -> list[torch.Tensor]:
    """RSC-ZO's two-point estimate of the gradient of ``loss_fn`` with respect to ``params``.

    ``g = (1/q) sum_k clip((f(x + mu u_k) - f(x - mu u_k)) / (2 mu)) u_k`` with ``u_k ~ N(0, I)`` over
    all params jointly (``distribution='rademacher'`` for +-1 entries). ``loss_fn()`` must return the
    loss at the params' current values; it is called ``2 * num_directions`` times, in (+, -) pairs,
    so a stochastic loss can bind one sample per pair (or per call of this function). Params are
    perturbed in place and restored exactly from a copy. ``clip=None``: no clipping, and the result
    is an unbiased estimate of the gradient of the Gaussian-smoothed loss. Returns float tensors
    shaped like ``params``.
    """
    if num_directions < 1:
        raise ValueError(f"num_directions must be >= 1, got {num_directions}")
    if mu <= 0:
        raise ValueError(f"mu must be positive, got {mu}")
    params = list(params)
    backup = [p.detach().clone() for p in params]
    grads = [torch.zeros(p.shape, dtype=torch.float32 if not p.is_floating_point() or p.element_size() < 4
                         else p.dtype, device=p.device) for p in params]
    try:
        for _ in range(num_directions):
            us = [sample(tuple(p.shape), generator, distribution, p.device, g.dtype) if generator is not None
                  else (torch.randn_like(g) if distribution == "gaussian"
                        else torch.randint_like(g, 0, 2).mul_(2).sub_(1)) for p, g in zip(params, grads)]
            for p, b, u in zip(params, backup, us):
                p.copy_(b + mu * u)
            lp = float(loss_fn())
            for p, b, u in zip(params, backup, us):
                p.copy_(b - mu * u)
            lm = float(loss_fn())
            d = _clip((lp - lm) / (2 * mu), clip)
            for g, u in zip(grads, us):
                g.add_(u, alpha=d / num_directions)
    finally:
        for p, b in zip(params, backup):
            p.copy_(b)
    return grads


class RSCZO(torch.optim.Optimizer):
    """Zeroth-order SGD over ``rsc_zo_gradient`` with RSC-ZO's momentum variant.

    ``step(closure)``: ``closure()`` returns the loss at the current params (called under no_grad, no
    backward). ``g = rsc_zo_gradient(...)``; ``m <- momentum * m + (1 - momentum) * g`` (``momentum=0``:
    plain RSC-ZO, no state kept); ``x <- x - lr (m + weight_decay x)``. Returns the loss at x (the mean
    of the first pair's two evaluations is not used: one extra evaluation is made at x only if
    ``return_loss`` is true).
    """

    def __init__(self, params, lr: float, mu: float = 1e-3, num_directions: int = 1, clip: float | None = None,
                 momentum: float = 0.0, weight_decay: float = 0.0, distribution: str = "gaussian",
                 generator: torch.Generator | None = None, return_loss: bool = False):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(params, {"lr": lr, "mu": mu, "num_directions": num_directions, "clip": clip, "momentum": momentum,
                                      "weight_decay": weight_decay, "distribution": distribution})
        self.generator = generator
        self.return_loss = return_loss

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            raise ValueError("RSCZO.step needs a closure that returns the loss")
        loss = None
        for group in self.param_groups:
            params = group["params"]
            grads = rsc_zo_gradient(closure, params, group["num_directions"], group["mu"], group["clip"],
                                    generator=self.generator, distribution=group["distribution"])
            for p, g in zip(params, grads):
                if group["momentum"] > 0:
                    st = self.state[p]
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = torch.zeros_like(g)
                    g = st["momentum_buffer"].mul_(group["momentum"]).add_(g, alpha=1 - group["momentum"])
                if group["weight_decay"]:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])
                p.add_(g.to(p.dtype), alpha=-group["lr"])
        if self.return_loss:
            loss = closure()
        return loss


# ----------------------------------------------------------------------------- seed-trick engine


class SeedZO:
    """MeZO-style estimator over a list of tensors: perturbations regenerated from seeds, never stored.

    Args:
        params: the tensors to perturb and update (modified in place).
        modes: per tensor ``"add"`` (``x + mu z``), ``"add_nonneg"`` (additive, projected onto ``x >= 0`` after
            each update: QZO's scales) or ``"mul"`` (``x * (1 + mu z)``, updated on ``log |x|``); default all add.
        mu: perturbation size. num_directions: q. clip: RSC-ZO/QZO clip of each projected derivative.
        distribution: ``gaussian`` | ``rademacher``. rank: 0 = full-rank iid entries; r > 0 = low-rank
        ``U V^T / sqrt(r)`` for 2-D+ tensors. isotropic: regroup before factorizing (``isotropic_shape``).
        v_interval: LOZO's lazy V: the V factor is redrawn every ``v_interval`` steps (1 = every step).
        seed: base seed. exact_restore: hold a copy of the tensors for bit-exact restore (required for
        ``mul``); else MeZO's regenerate-and-subtract.
    """

    def __init__(self, params: Sequence[torch.Tensor], *, modes: Sequence[str] | None = None, mu: float = 1e-3,
                 num_directions: int = 1, clip: float | None = None, distribution: str = "gaussian",
                 rank: int = 0, isotropic: bool = False, v_interval: int = 1, seed: int = 0,
                 exact_restore: bool = True):
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}")
        if num_directions < 1 or mu <= 0 or rank < 0 or v_interval < 1:
            raise ValueError("need num_directions >= 1, mu > 0, rank >= 0, v_interval >= 1")
        if clip is not None and clip <= 0:
            raise ValueError(f"clip must be positive or None, got {clip}")
        self.params = list(params)
        self.modes = list(modes) if modes is not None else ["add"] * len(self.params)
        if len(self.modes) != len(self.params) or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must give one of {', '.join(MODES)} for each tensor, got {self.modes}")
        if not exact_restore and "mul" in self.modes:
            raise ValueError("multiplicative perturbation needs exact_restore=True")
        self.mu, self.q, self.clip = float(mu), int(num_directions), clip
        self.distribution, self.rank, self.isotropic = distribution, int(rank), bool(isotropic)
        self.v_interval, self.seed, self.exact_restore = int(v_interval), int(seed), bool(exact_restore)
        self._backup: list[torch.Tensor] | None = None
        self._current: tuple[int, int, float] | None = None

    # -- directions

    def z(self, step: int, k: int, i: int) -> torch.Tensor:
        p = self.params[i]
        return direction(tuple(p.shape), mix_seed(self.seed, step, k, i), distribution=self.distribution,
                         rank=self.rank, isotropic=self.isotropic,
                         v_seed=mix_seed(self.seed, 0x5EED, step // self.v_interval, i),
                         device=p.device, dtype=torch.float32)

    def num_elements(self) -> int:
        return sum(p.numel() for p in self.params)

    def backup_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._backup) if self._backup else 0

    # -- perturb / restore

    @torch.no_grad()
    def perturb(self, step: int, k: int, scale: float) -> None:
        """Move every tensor to ``x0 + scale * mu z`` (add) or ``x0 (1 + scale * mu z)`` (mul), x0 the unperturbed value."""
        if self.exact_restore and getattr(self, "_current", None) is None:  # fresh start: copy the clean values
            if self._backup is None:
                self._backup = [p.detach().clone() for p in self.params]
            else:
                for p, b in zip(self.params, self._backup):
                    b.copy_(p.data)
        for i, p in enumerate(self.params):
            z = self.z(step, k, i)
            c = scale * self.mu
            if self.exact_restore:
                b = self._backup[i]
                if self.modes[i] == "mul":
                    torch.mul(b, (z.mul_(c).add_(1.0)).to(p.dtype), out=p.data)
                else:
                    torch.add(b, z.to(p.dtype), alpha=c, out=p.data)
            else:
                p.data.add_(z.to(p.dtype), alpha=c)
        self._current = (step, k, scale)

    @torch.no_grad()
    def restore(self) -> None:
        """Back to the unperturbed values: bit-exact from the held copy, else by subtracting the regenerated z."""
        cur = getattr(self, "_current", None)
        if cur is None:
            return
        if self.exact_restore:
            for p, b in zip(self.params, self._backup):
                p.data.copy_(b)
        else:
            step, k, scale = cur
            for i, p in enumerate(self.params):
                p.data.add_(self.z(step, k, i).to(p.dtype), alpha=-scale * self.mu)
        self._current = None

    def release(self) -> None:
        """Drop the held copy (it is re-taken at the next perturbation)."""
        self._backup = None

    # -- estimate / update

    @torch.no_grad()
    def projected(self, loss_fn: Callable[[], torch.Tensor | float], step: int, k: int) -> tuple[float, float, float]:
        """``(d_k, l+, l-)`` for direction k of ``step`` (unclipped); params are restored afterwards."""
        try:
            self.perturb(step, k, +1.0)
            lp = float(loss_fn())
            self.perturb(step, k, -1.0) if self.exact_restore else self._flip(step, k)
            lm = float(loss_fn())
        finally:
            self.restore()
        return (lp - lm) / (2 * self.mu), lp, lm

    def _flip(self, step: int, k: int) -> None:  # regenerate mode: +mu z -> -mu z in one pass
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.data.add_(self.z(step, k, i).to(p.dtype), alpha=-2 * self.mu)
        self._current = (step, k, -1.0)

    def clipped(self, d: Sequence[float]) -> list[float]:
        return [_clip(float(x), self.clip) for x in d]

    @torch.no_grad()
    def estimate(self, loss_fn: Callable[[], torch.Tensor | float], step: int) -> list[float]:
        """The q clipped projected derivatives of ``step``; params unchanged afterwards."""
        return self.clipped([self.projected(loss_fn, step, k)[0] for k in range(self.q)])

    @torch.no_grad()
    def update(self, step: int, d: Sequence[float], lr: float, weight_decay: float | Sequence[float] = 0.0) -> None:
        """Apply ``g = mean_k d_k z_k`` to every tensor, by its mode:

        * ``add``: ``x -= lr * (g + wd x)``.
        * ``add_nonneg`` (QZO): the same, then ``x = max(x, 0)``: QZO's projection of the scales.
        * ``mul``: ``x *= exp(-lr * (g + wd))``, a step on ``log |x|``. The perturbation ``x (1 + mu z)``
          makes ``d_k`` the directional derivative in log coordinates (``x * grad``), so this is plain ZO-SGD
          on ``log |x|``: a scale keeps its sign and can never reach 0, however large a step (the earlier
          ``x *= max(1 - lr g, 0)`` zeroed a scale for good after one large step, and a zero scale has a zero
          relative perturbation, so it never moved again). To first order in ``lr g`` both are the same step.
        """
        wds = list(weight_decay) if isinstance(weight_decay, (list, tuple)) else [weight_decay] * len(self.params)
        q = len(d)
        for i, p in enumerate(self.params):
            delta = None
            for k, dk in enumerate(d):
                if dk == 0.0:
                    continue
                zk = self.z(step, k, i)
                delta = zk.mul_(dk / q) if delta is None else delta.add_(zk, alpha=dk / q)
            if self.modes[i] == "mul":
                if delta is None and not wds[i]:
                    continue
                log_step = torch.full(p.shape, -lr * wds[i], device=p.device) if delta is None \
                    else delta.mul_(-lr).sub_(lr * wds[i])
                p.data.mul_(log_step.exp_().to(p.dtype))
            else:
                if wds[i]:
                    p.data.mul_(1.0 - lr * wds[i])
                if delta is not None:
                    p.data.add_(delta.to(p.dtype), alpha=-lr)
                if self.modes[i] == "add_nonneg":
                    p.data.clamp_(min=0.0)
