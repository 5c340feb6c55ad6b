"""HG-MS: learn how much to train on each data source, by a pseudoinverse hypergradient (select, then differentiate).

Paper: HG-MS, optimistic bilevel optimization with non-isolated lower-level minimizers (NeurIPS 2026). Source
reweighting as a bilevel problem: the upper variable is the weight vector w on the simplex over K sources, the
lower problem is training, theta*(w) in argmin sum_k w_k l_k(theta), the upper objective the target loss
F(w) = l_target(theta*(w)). Training has a manifold of minimizers; HG-MS takes the optimistic one (best for the
target) and differentiates through it with the Hessian's pseudoinverse (formula and costs: ``llmkit.optim.bilevel``).

Per weight update (``trainer.py``, ``signals.py``; every ``weights_update_interval`` steps, on probes of P examples
per source and P target examples, over a parameter subset S, by default the last 2 decoder layers):
  1. g = sum_k w_k l_k(theta) on the source probes, f = l_target(theta) on the target probe.
  2. ``iters`` Lanczos steps on H = d2g/dtheta_S2 from d_S f (HVPs by double backward through one retained
     gradient graph), Ritz values <= rtol * max (and negative ones) dropped: q = H^+ d_S f on the kept spectrum
     (truncated: the least-residual vector in the kept Ritz span, so an unconverged small Ritz value is damped).
  3. Hypergradient dF/dw_k = -<grad_S l_k, q> (one more backward through the gradient graph).
  4. Trust (``hgms_trust``, default on): the formula holds near a minimizer of g with a good Krylov model. Four
     free readings, each 1 when its condition holds and 0 when it plainly fails, multiply ``weights_lr``: the
     Newton decrement over g (the share of the inner loss a Newton step would still remove), the most negative
     Ritz value over the largest, the solve's relative residual, and (off by default: LoRA starts at B = 0, where
     the adapter's gradient is near 0 and grows by construction) the smoothed inner gradient norm against its
     first value. At or below ``hgms_min_trust`` the update is refused (``weight_refusals``), so from a fresh
     start the weights move once training has settled (LoRA's start is a saddle: its Ritz values are +-).
  5. Weights: w <- w * exp(-lr * trust * dF/dw / max|dF/dw|) (mirror descent on the simplex), then mix in
     ``weights_smoothing`` of uniform.
  6. Optimistic selection (``hgms_select_lr > 0``): ``hgms_select_probes`` random-start Lanczos runs certify
     flat directions of H; theta_S <- theta_S - select_lr * P_flat d_S f moves along the solution set toward
     lower target loss, and the next update differentiates there (lagged by one update). None certified: no move.
  7. Each training batch draws every example's source from w (every method trains on as many tokens per step).
Cost per update (K sources, P per probe): (K+1)P forwards and backwards, (iters+1)KP double backwards (plus
probes*iters*KP with selection), all through S only (measured: bench/results/hgms.md).

Deviations from the paper, and why: (a) the hypergradient is taken at the current iterate, not the exact inner
solution, as every online reweighting method does (DoReMi, DoGE, ODM); (b) the selection is one projected step
per update in the span of the few certified flat directions, not a converged selection (the library's
``optimistic_select`` iterates it on small problems); (c) the Hessian is over a parameter subset and a probe
batch, truncated at ``iters`` Ritz pairs; (d) selection trains on target examples, so it is off by default
(``hgms_select_lr: 0``) and its examples are reported.

Baselines on the same trainer (``weighting:``, ``weights.py``): uniform; DoReMi (excess loss over a reference
trained first on the uniform mixture, or ``doremi_reference_model``); DoGE (target alignment); ODM (EXP3).
"""

from llmkit.train.hgms.weights import (
    Exp3,
    doge_score,
    doremi_score,
    exponentiated_step,
    project_simplex_floor,
)

__all__ = ["Exp3", "doge_score", "doremi_score", "exponentiated_step", "project_simplex_floor"]
