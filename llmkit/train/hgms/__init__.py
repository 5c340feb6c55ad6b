"""HG-MS: learn how much to train on each data source, by a pseudoinverse hypergradient (select, then differentiate).

Paper: "optimistic bilevel optimization ... HG-MS" (HG-MS, optimistic bilevel optimization with non-isolated
lower-level minimizers, NeurIPS 2026). Source reweighting as a bilevel problem: the upper variable is the weight vector w on the
simplex over K sources, the lower problem is training, theta*(w) in argmin sum_k w_k l_k(theta), and
the upper objective is the loss on a target set, F(w) = l_target(theta*(w)). Overparameterized training
has a manifold of minimizers, so theta*(w) is a set; HG-MS takes the optimistic selection (the minimizer
best for the target) and differentiates through it with the Hessian's pseudoinverse
(``llmkit.optim.bilevel``, which has the exact formula, its derivation and costs).

The practical variant implemented here (``trainer.py``, ``signals.py``) -- per weight update, every
``weights_update_interval`` optimizer steps, on probe batches of P examples per source and P target
examples, over a parameter subset S (default: trainable parameters of the last 2 decoder layers):

  1. g = sum_k w_k l_k(theta) on the source probes, f = l_target(theta) on the target probe.
  2. ``iters`` Lanczos steps on H = d2g/dtheta_S2 started at d_S f (Hessian-vector products by double
     backward through one retained gradient graph); Ritz values <= rtol * max (and negative ones)
     are dropped: q = H^+ d_S f on the kept spectrum, n = d_S f minus its part on the kept directions.
  3. Hypergradient dF/dw_k = -<grad_S l_k, q> (one more backward through the gradient graph).
  4. Weights: one mirror-descent step on the simplex, w <- w * exp(-lr * dF/dw / max|dF/dw|), then mix
     in ``weights_smoothing`` of uniform.
  5. Optimistic selection (``hgms_select_lr > 0``): theta_S <- theta_S - select_lr * n, a move along
     the flat directions of the inner loss toward lower target loss; the next update differentiates
     at the moved point (select-then-differentiate, lagged by one update).
  6. Each training batch draws every example's source from w (sampling, so every method trains on the
     same number of tokens per step).

Cost per update (example-passes, K sources, P per probe): (K+1)P forwards, (K+1)P backwards, and
(iters+1)KP double backwards, the backwards only through the subset S. Measured overhead in
``bench/hgms.py``.

Deviations from the paper, and why: (a) the exact inner solution is never reached -- the
hypergradient is taken at the current iterate, as every online reweighting method does (DoReMi, DoGE,
ODM); (b) the selection is one projected step per update from one Lanczos, not a converged selection
(the library's ``optimistic_select`` does the converged version on small problems); (c) the Hessian is
over a parameter subset and a probe batch, truncated at ``iters`` Ritz pairs; (d) selection trains on
target examples, so it is off by default (``hgms_select_lr: 0``) and its examples are reported.

Baselines on the same trainer (``weighting:``): uniform; DoReMi (excess loss over a reference model
that the recipe first trains on the uniform mixture, as DoReMi does, or ``doremi_reference_model``); DoGE (gradient alignment with the target); ODM (EXP3, loss as reward).
Rules in ``weights.py``.
"""

from llmkit.train.hgms.weights import (
    Exp3,
    doge_score,
    doremi_score,
    exponentiated_step,
    project_simplex_floor,
)

__all__ = ["Exp3", "doge_score", "doremi_score", "exponentiated_step", "project_simplex_floor"]
