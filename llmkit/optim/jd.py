"""Jacobian descent (JD): combine the gradients of several objectives into one update without conflict.

Paper: "Jacobian Descent for Multi-Objective Optimization" (Quinton & Rey), NeurIPS 2026.
Built on ``torchjd`` (0.18), the authors' library.

Algorithm: for objectives L_1..L_m of the parameters theta, form the Jacobian J (row i = grad L_i) and step
along an aggregation A(J) instead of the gradient of a sum. UPGrad (the paper's aggregator) projects each
row onto the dual cone {g : J g >= 0} of the rows (a small quadratic program on the Gramian J J^T) and
averages the projections, so the result has a non-negative inner product with *every* objective's gradient
(it never increases one objective to first order) and reduces to the plain gradient when the objectives
agree. Only the m x m Gramian is needed to find the weights, which is how torchjd keeps memory low.

Instance-wise risk minimization (IWRM): each training example's loss is its own objective
(``iwrm_backward(per_example_losses, params)``), so no example's loss is traded away for the average.

``backward(losses, params, aggregator="upgrad")`` fills (accumulates into, like ``torch.autograd.backward``)
each param's ``.grad`` with the aggregated direction and returns nothing. Deviations: none; the aggregator
may be any torchjd ``Aggregator`` or a name from ``AGGREGATORS``. torchjd solves UPGrad's small QP with
quadprog, which this stack does not ship; ``BVLSProjector`` solves the same QP exactly with scipy's
bounded-variable least squares and is used when quadprog is absent. UPGrad's QP solver has a small
regularization (``reg_eps``), so "non-negative inner product" holds up to that tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["AGGREGATORS", "BVLSProjector", "aggregator_for", "backward", "backward_with_weights", "iwrm_backward"]

AGGREGATORS = ("upgrad", "mean", "sum", "mgda", "pcgrad", "dualproj", "cagrad", "imtlg", "nashmtl", "aligned_mtl")


def _projector():
    """torchjd's quadprog projector when quadprog is installed, else ``BVLSProjector`` (scipy)."""
    try:
        import qpsolvers  # noqa: F401
        import quadprog  # noqa: F401

        return None  # torchjd's default
    except ImportError:
        return BVLSProjector()


def aggregator_for(name):
    """A torchjd aggregator from its name (or the aggregator itself)."""
    import torchjd.aggregation as agg

    if not isinstance(name, str):
        return name
    key = name.lower().replace("-", "_")
    table = {"upgrad": lambda: agg.UPGrad(projector=_projector()), "mean": agg.Mean, "sum": agg.Sum,
             "mgda": agg.MGDA, "pcgrad": agg.PCGrad, "dualproj": lambda: agg.DualProj(projector=_projector()), "cagrad": lambda: agg.CAGrad(c=0.5), "imtlg": agg.IMTLG,
             "nashmtl": lambda: agg.NashMTL(n_tasks=2), "aligned_mtl": agg.AlignedMTL}
    if key not in table:
        raise ValueError(f"unknown aggregator {name!r}: choose one of {', '.join(AGGREGATORS)}")
    return table[key]()


def _bvls_projector_class():
    import numpy as np
    from scipy.optimize import lsq_linear
    from torchjd._linalg._dual_cone import DualConeProjector
    from torchjd._linalg._gramian import normalize, regularize

    class _BVLSProjector(DualConeProjector):
        """UPGrad's dual-cone projection ``min_v v^T G v s.t. v >= u`` solved exactly as a bounded-variable least
        squares problem ``min ||L^T v||^2, v >= u`` (G = L L^T) with scipy's BVLS; same normalization and
        ``reg_eps`` regularization of the Gramian as torchjd's quadprog projector."""

        def __init__(self, norm_eps: float = 1e-4, reg_eps: float = 1e-4):
            self.norm_eps, self.reg_eps = norm_eps, reg_eps

        def __call__(self, U, G):
            g = regularize(normalize(G, self.norm_eps), self.reg_eps)
            g_ = g.detach().cpu().double().numpy()
            lt = np.linalg.cholesky(0.5 * (g_ + g_.T)).T
            u_ = U.detach().cpu().double().numpy()
            flat = u_.reshape(-1, u_.shape[-1])
            m = g_.shape[0]
            out = np.stack([lsq_linear(lt, np.zeros(m), bounds=(u, np.full(m, np.inf)), method="bvls",
                                       tol=1e-12).x for u in flat])
            return torch.as_tensor(out.reshape(u_.shape), dtype=G.dtype, device=G.device)

        def __repr__(self):
            return f"BVLSProjector(norm_eps={self.norm_eps}, reg_eps={self.reg_eps})"

    return _BVLSProjector


def BVLSProjector(norm_eps: float = 1e-4, reg_eps: float = 1e-4):
    """A torchjd ``DualConeProjector`` that needs only scipy (torchjd's default needs quadprog + qpsolvers)."""
    return _bvls_projector_class()(norm_eps=norm_eps, reg_eps=reg_eps)


def backward(losses: Sequence[torch.Tensor], params: Iterable[torch.Tensor], aggregator="upgrad",
             retain_graph: bool = False, parallel_chunk_size: int | None = None) -> None:
    """Accumulate the aggregated direction of ``losses`` (scalars) into ``p.grad`` for every p in ``params``.

    With one loss this is the loss's own gradient (UPGrad of a single row is that row)."""
    backward_with_weights(losses, params, aggregator=aggregator, retain_graph=retain_graph,
                          parallel_chunk_size=parallel_chunk_size)


def backward_with_weights(losses: Sequence[torch.Tensor], params: Iterable[torch.Tensor], aggregator="upgrad",
                          retain_graph: bool = False, parallel_chunk_size: int | None = None) -> torch.Tensor | None:
    """``backward``, returning the aggregator's weights on the losses (the direction is sum_i w_i grad L_i) when
    it is a weighted aggregator (UPGrad, MGDA, mean ...), else None. Losses that do not depend on ``params``
    are left out of the Jacobian (they would be zero rows) and get weight 0."""
    from torchjd.autojac import backward as jac_backward
    from torchjd.autojac import jac_to_grad

    params = [p for p in params]
    if not params:
        raise ValueError("jd.backward needs at least one parameter")
    if any(not p.requires_grad for p in params):
        raise ValueError("jd.backward: every parameter must require grad")
    if isinstance(losses, torch.Tensor):
        losses = list(losses.reshape(-1)) if losses.dim() else [losses]
    losses = list(losses)
    if not losses:
        raise ValueError("jd.backward needs at least one loss")
    for i, loss in enumerate(losses):
        if loss.numel() != 1:
            raise ValueError(f"loss {i} is not a scalar (shape {tuple(loss.shape)}); use iwrm_backward for a vector")
    live_idx = [i for i, loss in enumerate(losses) if loss.requires_grad]
    weights = torch.zeros(len(losses))
    if not live_idx:
        return weights
    live = [losses[i].reshape(()) for i in live_idx]
    if len(live) == 1:
        grads = torch.autograd.grad(live[0], params, retain_graph=retain_graph, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        weights[live_idx[0]] = 1.0
        return weights
    jac_backward(live, inputs=params, retain_graph=retain_graph, parallel_chunk_size=parallel_chunk_size)
    for p in params:  # a parameter no loss depends on gets a zero Jacobian so the rows stay aligned
        if getattr(p, "jac", None) is None:
            p.jac = torch.zeros((len(live), *p.shape), dtype=p.dtype, device=p.device)
    w = jac_to_grad(params, aggregator_for(aggregator))
    if w is None:
        return None
    weights[live_idx] = w.detach().cpu().float().reshape(-1)
    return weights


def iwrm_backward(per_example_losses: torch.Tensor, params: Iterable[torch.Tensor], aggregator="upgrad",
                  retain_graph: bool = False, parallel_chunk_size: int | None = None) -> None:
    """Instance-wise risk minimization: each element of the 1-D ``per_example_losses`` is one objective."""
    if per_example_losses.dim() != 1:
        raise ValueError(f"iwrm_backward expects a 1-D tensor of per-example losses, got shape "
                         f"{tuple(per_example_losses.shape)}")
    backward(list(per_example_losses), params, aggregator=aggregator, retain_graph=retain_graph,
             parallel_chunk_size=parallel_chunk_size)
