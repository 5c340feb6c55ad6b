"""How good is each zeroth-order estimator of the scale gradient? LQZO's own mechanism, measured directly.

LQZO's claim is about the estimator: low-rank Rademacher perturbations of (regrouped) scale matrices give a
better gradient estimate per forward pass than QZO's full-rank Gaussian ones. Training runs measure that only
through a noisy loss after many steps; here it is measured where it is made. On one batch, the true gradient of
the loss with respect to the scales comes from autograd (in the log-scale coordinates every variant here
estimates: ``s * dL/ds``, see ``llmkit.optim.zo.SeedZO.update``), and each variant's estimate
``(1/q) sum_k d_k z_k`` from real ``+-mu`` forward passes is compared with it:

* ``cos``: the cosine between estimate and true gradient (scale-free, so the variants' normalizations do
  not matter), at q = 1, 4, 16 directions (the q-direction estimate reuses the first q of 16 draws, so the
  three are nested, as a run with more directions would be);
* ``nerr``: ``||g_hat - g|| / ||g||`` (all variants have unit-variance entries, so they are on one scale).

Seeds are independent draws of the directions (and of V for low-rank variants, so the average is over V too,
i.e. the unconditional estimator; ``llmkit.optim.zo`` documents the bias given V).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from llmkit.experiments.stats import mean_ci
from llmkit.optim.zo import SeedZO

# name -> SeedZO settings. Full rank has no regrouping choice (iid entries are the same on any view).
VARIANTS = {
    "gaussian_full": {"distribution": "gaussian", "rank": 0, "isotropic": False},
    "rademacher_full": {"distribution": "rademacher", "rank": 0, "isotropic": False},
    "lowrank_own": {"distribution": "rademacher", "rank": 4, "isotropic": False},
    "lowrank_regrouped": {"distribution": "rademacher", "rank": 4, "isotropic": True},
}


def scale_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every quantization scale of a model quantized by ``llmkit.train.lqzo.quant.quantize_model``."""
    scales = [p for n, p in model.named_parameters() if n.endswith(".scale")]
    if not scales:
        raise ValueError("the model has no quantization scales: quantize it first (quantize_model)")
    return scales


def true_log_gradient(loss_fn: Callable[[], torch.Tensor], scales: Sequence[torch.Tensor]) -> torch.Tensor:
    """``s * dL/ds`` over all scales, flattened: the gradient in log-scale coordinates, from autograd."""
    flags = [s.requires_grad for s in scales]
    try:
        for s in scales:
            s.requires_grad_(True)
            s.grad = None
        with torch.enable_grad():
            loss_fn().backward()
        return torch.cat([(s.detach() * s.grad).flatten().float() for s in scales])
    finally:
        for s, f in zip(scales, flags):
            s.grad = None
            s.requires_grad_(f)


@torch.no_grad()
def estimates(loss_fn: Callable[[], torch.Tensor], scales: Sequence[torch.Tensor], variant: dict, seed: int,
              qs: Sequence[int], mu: float = 1e-3) -> dict[int, torch.Tensor]:
    """``{q: flattened estimate from the first q directions}`` for one draw of the directions."""
    qmax = max(qs)
    zo = SeedZO(list(scales), modes=["mul"] * len(scales), mu=mu, num_directions=qmax, seed=seed, v_interval=1,
                **variant)
    acc = torch.zeros(sum(s.numel() for s in scales))
    out = {}
    for k in range(qmax):
        d, _, _ = zo.projected(loss_fn, 0, k)
        acc += d * torch.cat([zo.z(0, k, i).flatten() for i in range(len(scales))])
        if k + 1 in qs:
            out[k + 1] = acc / (k + 1)
    return out


def estimator_quality(loss_fn: Callable[[], torch.Tensor], scales: Sequence[torch.Tensor], *,
                      variants: dict[str, dict] = VARIANTS, qs: Sequence[int] = (1, 4, 16),
                      seeds: Iterable[int] = range(8), mu: float = 1e-3, progress: bool = False) -> dict:
    """``{variant: {q: {"cos": mean_ci, "nerr": mean_ci, "cos_values": [...]}}}`` against autograd's gradient.

    ``loss_fn()`` must return the loss of one fixed batch (eval mode, deterministic). Costs ``2 max(qs)``
    forwards per variant and seed, plus one backward.
    """
    g = true_log_gradient(loss_fn, scales)
    gnorm = g.norm()
    if not torch.isfinite(gnorm) or gnorm == 0:
        raise ValueError(f"the true gradient has norm {float(gnorm)}: nothing to compare against")
    seeds = list(seeds)
    result = {"grad_norm": float(gnorm), "num_scales": int(g.numel()), "seeds": seeds, "qs": list(qs),
              "variants": {}}
    todo = [(name, v, s) for name, v in variants.items() for s in seeds]
    if progress:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc="estimator quality")
    raw: dict[str, dict[int, dict[str, list[float]]]] = {}
    for name, variant, seed in todo:
        for q, est in estimates(loss_fn, scales, variant, seed, qs, mu).items():
            cell = raw.setdefault(name, {}).setdefault(q, {"cos": [], "nerr": []})
            cell["cos"].append(float(est @ g / (est.norm() * gnorm + 1e-30)))
            cell["nerr"].append(float((est - g).norm() / gnorm))
    for name, by_q in raw.items():
        result["variants"][name] = {q: {"cos": mean_ci(c["cos"]), "nerr": mean_ci(c["nerr"]), "cos_values": c["cos"]}
                                    for q, c in by_q.items()}
    return result


def flat_keys(result: dict, bits: int) -> dict:
    """The bench's JSON keys: ``cos_true_grad_<variant>_int<bits>_q<q>`` = ``{mean, lo, hi, n}``, and the errors."""
    out = {}
    for name, by_q in result["variants"].items():
        for q, cell in by_q.items():
            out[f"cos_true_grad_{name}_int{bits}_q{q}"] = {k: cell["cos"][k] for k in ("mean", "lo", "hi", "n")}
            out[f"nerr_true_grad_{name}_int{bits}_q{q}"] = {k: cell["nerr"][k] for k in ("mean", "lo", "hi", "n")}
    return out


def best_variant(result: dict, q: int) -> str:
    """The variant with the highest mean cosine at ``q`` directions."""
    return max(result["variants"], key=lambda n: result["variants"][n][q]["cos"]["mean"])


def bench_table(load_model: Callable[[int], tuple], rows: list[dict], *, bits_list: Sequence[int] = (4, 2),
                qs: Sequence[int] = (1, 4, 16), seeds: Iterable[int] = range(8), max_length: int = 128,
                log: Callable[[str], None] = print) -> dict:
    """The bench's estimator-quality table on a real model: for each bit-width, ``load_model(bits)`` gives a
    quantized ``(model, tok)``; one fixed batch of ``rows`` (question/answer, completion-only loss). Returns
    ``{"per_bits": {bits: estimator_quality(...)}, "keys": {...flat_keys...}, "best": {...}}``."""
    from llmkit.experiments.lqzo import lm_batch

    seeds = list(seeds)
    out = {"per_bits": {}, "keys": {}, "best": {}, "rows": len(rows), "max_length": max_length, "seeds": seeds}
    for bits in bits_list:
        model, tok = load_model(bits)
        model.eval()
        batch = lm_batch(tok, rows, max_length)
        if not (batch["labels"] != -100).any():
            raise ValueError(f"max_length {max_length} cuts every completion: no token of the batch is scored")

        def loss_fn(model=model, batch=batch):
            return model(**batch).loss

        res = estimator_quality(loss_fn, scale_tensors(model), qs=qs, seeds=seeds, progress=True)
        out["keys"].update(flat_keys(res, bits))
        for name, by_q in res["variants"].items():
            for q, cell in by_q.items():
                c, e = cell["cos"], cell["nerr"]
                log(f"INT{bits} {name:18s} q={q:>2}: cos(estimate, true grad) {c['mean']:.4f} "
                    f"[{c['lo']:.4f}, {c['hi']:.4f}], normalized error {e['mean']:.2f} ({c['n']} seeds)")
        for q in qs:
            out["best"][f"int{bits}_q{q}"] = best = best_variant(res, q)
            log(f"INT{bits} q={q}: highest cosine {best}")
        # JSON keys are strings: store q as one
        res["variants"] = {n: {str(q): c for q, c in by_q.items()} for n, by_q in res["variants"].items()}
        out["per_bits"][str(bits)] = res
        del model
    return out
