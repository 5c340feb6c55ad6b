"""The extra passes each weighting method spends on a causal LM, computed on small probe batches.

A probe batch is a collated SFT batch (``input_ids``, ``attention_mask``, ``labels`` with -100 on the
prompt). The loss is the mean NLL of the labelled tokens, as in training. Models are evaluated in
``eval()`` mode (no dropout) so the Hessian-vector products are of one deterministic function.

Costs, with K sources and P examples per probe batch (counted in example-passes; ``passes`` dicts):

* ``per_source_losses`` (DoReMi: model and reference): K*P forwards each.
* ``doge_signal``: (K+1)*P forwards, (K+1)*P backwards (restricted to the parameter subset).
* ``hgms_signal``: (K+1)*P forwards, (K+1)*P backwards (one of them with ``create_graph``), and
  (iters+1)*K*P double-backwards (Lanczos HVPs + the mixed term), plus probes*iters*K*P more with the
  optimistic selection on, all through the parameter subset only: with the default subset (last 2
  decoder layers) each backward stops there.
"""

from __future__ import annotations

import contextlib
import re

import torch

from llmkit.optim import bilevel


def batch_loss(model, batch: dict) -> torch.Tensor:
    """Mean NLL over labelled tokens (next-token shift), differentiable."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
    logits = out.logits[:, :-1].float()
    target = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                             ignore_index=-100)


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def param_subset(model, last_layers: int = 2, regex: str | None = None) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters the hypergradient is taken over: by regex, or the last N decoder layers (plus a
    trainable LM head / final norm), or all of them (``last_layers=0``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if regex:
        pat = re.compile(regex)
        sub = [(n, p) for n, p in named if pat.search(n)]
        if not sub:
            raise ValueError(f"hgms_param_regex {regex!r} matches no trainable parameter")
        return sub
    if last_layers <= 0:
        return named
    idx = sorted({int(m.group(1)) for n, _ in named if (m := _LAYER.search(n))})
    if not idx:
        return named
    keep = set(idx[-last_layers:])
    sub = [(n, p) for n, p in named
           if ((m := _LAYER.search(n)) and int(m.group(1)) in keep)
           or (not m and ("lm_head" in n or n.endswith("norm.weight") and ".layers." not in n))]
    return sub or named


@contextlib.contextmanager
def probe_mode(model):
    """eval() (no dropout) and the math SDPA kernel (it has a double backward) for the duration."""
    was = model.training
    model.eval()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel(SDPBackend.MATH)
    except ImportError:  # pragma: no cover - older torch
        ctx = contextlib.nullcontext()
    try:
        with ctx:
            yield
    finally:
        model.train(was)


def _n(batch) -> int:
    return int(batch["input_ids"].shape[0])


@torch.no_grad()
def per_source_losses(model, batches: list[dict]) -> tuple[torch.Tensor, dict]:
    with probe_mode(model):
        losses = torch.stack([batch_loss(model, b).detach() for b in batches])
    return losses.double().cpu(), {"forward": sum(_n(b) for b in batches)}


def _flat_grad(loss, params) -> torch.Tensor:
    gs = torch.autograd.grad(loss, params, allow_unused=True)
    return bilevel.flatten([torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]).double()


def doge_signal(model, params: list, batches: list[dict], target: dict) -> tuple[torch.Tensor, dict]:
    """<grad l_k, grad l_target> for each source k, over ``params``."""
    with probe_mode(model):
        gt = _flat_grad(batch_loss(model, target), params)
        gk = torch.stack([_flat_grad(batch_loss(model, b), params) for b in batches])
    from llmkit.train.hgms.weights import doge_score

    n = sum(_n(b) for b in batches) + _n(target)
    return doge_score(gk, gt).cpu(), {"forward": n, "backward": n}


def hgms_signal(model, params: list, batches: list[dict], target: dict, weights: torch.Tensor, *,
                iters: int = 8, rtol: float = 1e-3, select: bool = False, probes: int = 1,
                flat_rtol: float | None = None, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """The pseudoinverse hypergradient dF/dw of the target loss w.r.t. the source weights.

    Inner loss g(w, theta) = sum_k w_k l_k(theta) on the probe batches, outer f(theta) = l_target(theta),
    both over ``params``. Returns (dF/dw [K], the optimistic selection direction [flat, float32: d_S f
    projected on the certified flat directions of the inner Hessian, ``bilevel.flat_directions``; zero
    unless ``select``], info, passes). ``info`` holds what the trust rule reads: the inner gradient norm,
    the solve's Lanczos residual and the most negative curvature relative to the largest.
    """
    device = params[0].device
    w = weights.to(device=device, dtype=torch.float32).clone().requires_grad_(True)
    with probe_mode(model):
        hg = bilevel.hypergradient(lambda: sum(w[i] * batch_loss(model, b) for i, b in enumerate(batches)),
                                   lambda: batch_loss(model, target), params, [w], iters=iters, rtol=rtol,
                                   flat_probes=probes if select else 0, flat_rtol=flat_rtol, generator=generator)
    p = sum(_n(b) for b in batches)
    hvps = hg.solve.matvecs + (hg.flat.matvecs if hg.flat is not None else 0)
    passes = {"forward": p + _n(target), "backward": p + _n(target), "double_backward": (hvps + 1) * p}
    theta = hg.solve.ritz_values
    tmax = float(theta.max()) if theta.numel() else 0.0
    info = {"target_loss": hg.outer_loss, "inner_loss": hg.inner_loss, "ritz_max": tmax, "kept": hg.solve.kept,
            "ritz_min_rel": float(theta.min()) / tmax if tmax > 0 else 0.0,
            "solve_residual": hg.solve.solve_residual,
            "inner_grad_norm": float(hg.inner_grad.norm()), "outer_grad_norm": float(hg.outer_grad.norm()),
            # the Newton decrement's estimate of g - min g on the explored subspace, relative to g
            "newton_gap": 0.5 * float(hg.inner_grad.double() @ hg.solve.apply(hg.inner_grad).double())
            / max(abs(hg.inner_loss), 1e-30)}
    if select:
        direction = hg.flat.project(hg.outer_grad).detach().float()
        info["flat_dims"] = int(hg.flat.basis.shape[0])
    else:
        direction = torch.zeros_like(hg.outer_grad, dtype=torch.float32)
    return hg.grads[0].detach().double().cpu(), direction, info, passes
