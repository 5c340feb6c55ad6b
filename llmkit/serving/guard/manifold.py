"""The compliant manifold of one layer: a probabilistic-PCA Gaussian over hidden states.

Fitted on the token states of compliant responses: mean ``mu``, the top-``k``
principal directions ``U`` (k x d) with their variances ``lam``, and one
isotropic variance ``noise`` for everything off the subspace (the PPCA maximum-
likelihood value: the mean of the discarded eigenvalues). So the covariance is
``U^T diag(lam) U + noise (I - U^T U)``: low-rank plus isotropic, invertible
with ``d`` above the number of samples, and cheap to store (k x d).

``energy(x)`` is the per-dimension Mahalanobis energy of each row under that
Gaussian, which is the negative log-likelihood up to constants:
``(sum_k z_k^2 / lam_k + |r|^2 / noise) / d`` with ``z = U (x - mu)`` and
``r = (x - mu) - U^T z``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Manifold:
    mean: torch.Tensor  # (d,)
    components: torch.Tensor  # (k, d), orthonormal rows
    variances: torch.Tensor  # (k,)
    noise: torch.Tensor  # () scalar

    @property
    def dim(self) -> int:
        return int(self.mean.numel())

    @classmethod
    def fit(cls, x: torch.Tensor, n_components: int = 32, eps: float = 1e-6) -> Manifold:
        """Fit on rows of ``x`` (n x d); ``k`` is capped by the rank the data can support."""
        if x.ndim != 2 or x.shape[0] < 2:
            raise ValueError(f"need at least 2 states to fit a manifold, got shape {tuple(x.shape)}")
        x = x.double()
        n, d = x.shape
        mu = x.mean(0)
        xc = x - mu
        cov = xc.T @ xc / (n - 1)
        evals, evecs = torch.linalg.eigh(cov)  # ascending
        evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
        k = max(1, min(n_components, n - 1, d - 1))
        floor = eps * max(float(evals[0]), eps)  # relative floor keeps tiny data sets invertible
        rest = evals[k:]
        noise = rest.mean().clamp_min(floor) if rest.numel() else torch.tensor(floor, dtype=torch.float64)
        return cls(mean=mu.float(), components=evecs[:, :k].T.contiguous().float(),
                   variances=evals[:k].clamp_min(float(noise)).float(), noise=noise.float().reshape(()))

    def energy(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row energy (n,) of states ``x`` (n x d)."""
        xc = x.double() - self.mean.double()
        z = xc @ self.components.double().T
        resid = (xc * xc).sum(-1) - (z * z).sum(-1)
        e = (z * z / self.variances.double()).sum(-1) + resid.clamp_min(0) / self.noise.double()
        return (e / self.dim).float()

    def whiten(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``z``, ``r``): coordinates of ``x - mu`` in the principal subspace divided by their standard
        deviations (k columns), and the off-subspace residual divided by ``sqrt(noise)`` (d columns).

        Under the manifold's Gaussian both have identity covariance, and
        ``energy(x) = (|z|^2 + |r|^2) / d``.
        """
        xc = x.double() - self.mean.double()
        comps = self.components.double()
        proj = xc @ comps.T
        r = (xc - proj @ comps) / self.noise.double().sqrt()
        return proj / self.variances.double().sqrt(), r

    def pull(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """Move states a fraction ``alpha`` of the way back to the manifold mean (for steering)."""
        return x + alpha * (self.mean.to(x) - x)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.mean": self.mean, f"{prefix}.components": self.components,
                f"{prefix}.variances": self.variances, f"{prefix}.noise": self.noise.reshape(1)}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> Manifold:
        return cls(mean=t[f"{prefix}.mean"], components=t[f"{prefix}.components"],
                   variances=t[f"{prefix}.variances"], noise=t[f"{prefix}.noise"].reshape(()))
