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
     are dropped: q = H^+ d_S f on the kept spectrum.
  3. Hypergradient dF/dw_k = -<grad_S l_k, q> (one more backward through the gradient graph).
  4. Trust (``hgms_trust``, on by default): the formula is the derivative through the inner
     *solution*; it describes the current iterate only when that iterate is near a minimizer of g and
     the truncated Hessian model is good. Four free readings decide how much of the step to take, each
     1 when its condition holds and 0 when it plainly fails: the Newton decrement (1/2 grad g^T H^+
     grad g over g, on the Ritz pairs already found: the fraction of the inner loss a Newton step would
     still remove, the textbook distance to a minimizer), the smoothed inner gradient norm over its
     value at the first update (growing = moving away from a minimizer), the most negative Ritz value
     over the largest (a minimizer's Hessian has none), and the Lanczos solve's relative residual
     (>= 1: the Krylov model explains nothing). Their product multiplies ``weights_lr``; at or below
     ``hgms_min_trust`` the update is refused and counted (``weight_refusals``). From a random or
     freshly perturbed start the early updates are therefore refused, and the weights move once
     training has settled.
  5. Weights: one mirror-descent step on the simplex, w <- w * exp(-lr * trust * dF/dw / max|dF/dw|),
     then mix in ``weights_smoothing`` of uniform.
  6. Optimistic selection (``hgms_select_lr > 0``): ``hgms_select_probes`` Lanczos runs on the same
     gradient graph, each from a random vector, certify flat directions u of H (||H u|| <= rtol * max
     curvature, read from the Lanczos relation); theta_S <- theta_S - select_lr * P_flat d_S f, a move
     along the solution set toward lower target loss; the next update differentiates at the moved
     point (select-then-differentiate, lagged by one update). No certified direction: no move.
  7. Each training batch draws every example's source from w (sampling, so every method trains on the
     same number of tokens per step).

Cost per update (example-passes, K sources, P per probe): (K+1)P forwards, (K+1)P backwards, and
(iters+1)KP double backwards (plus probes*iters*KP with selection on), the backwards only through
the subset S. Measured overhead in ``bench/hgms.py``.

Deviations from the paper, and why: (a) the exact inner solution is never reached -- the
hypergradient is taken at the current iterate, as every online reweighting method does (DoReMi, DoGE,
ODM); (b) the selection is one projected step per update in the span of the few flat directions
its probes certify, not a converged selection (the library's ``optimistic_select`` iterates it on
small problems); (c) the Hessian is over a parameter subset and a probe batch, truncated at ``iters`` Ritz pairs; (d) selection trains on
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
