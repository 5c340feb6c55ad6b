"""LQZO: Low-rank Quantized Zeroth-Order finetuning of INT4 / INT2 models (with QZO and MeZO baselines).

Paper: "LQZO", low-rank quantized zeroth-order finetuning of LLMs, NeurIPS 2026 (no public code). Zeroth-order
(ZO) finetuning needs only forward passes, so a quantized model trains in about its inference memory;
quantized ZO (QZO: perturb and update only the group-wise quantization scales, integer codes frozen)
lags full precision, worst at 2 bits. LQZO adds three pieces, each a switch here:

  1. low-rank perturbations of each scale matrix, ``U V^T / sqrt(r)`` (``--zo_rank``), U and V
     regenerated from the step's seed, V redrawn lazily every ``--zo_v_interval`` steps (LOZO);
  2. "binary-aggregated Gaussian" factors: Rademacher entries (``--zo_distribution``), whose sums
     approach a Gaussian while every moment stays bounded (E z^4 = 3 - 2/r instead of 3 + 6/r);
  3. isotropy-enhanced estimation (``--zo_isotropic_groups``, ``llmkit.optim.zo.isotropic_shape``): the
     (out, in/group) scale matrix is regrouped into its closest-to-square view before factorizing. The
     reading kept: in the matrix's own coordinates the direction is then not low rank (576x9 as 72x72: rank
     9 of 9 at r = 4), the "diversified exploration directions". Own-coordinate low rank
     (``--zo_isotropic_groups false``) and full rank (``--zo_rank 0``) stay flags; bench/results/
     lqzo_quick_estimator.md compares all by the cosine of the estimate with the autograd gradient.

Step (``trainer.py``, the estimator in ``llmkit.optim.zo.SeedZO``): for k < q, two forwards under
``torch.no_grad()`` at ``s (1 + mu z_k)`` and ``s (1 - mu z_k)``, ``d_k = (l+ - l-) / 2 mu``, optionally
clipped (``--zo_clip``: QZO's clipping, the same scalar clipping as RSC-ZO), then
``s <- s exp(-lr mean_k d_k z_k)``: ZO-SGD on ``log s``, so a scale keeps its sign and cannot die. Forwards
in eval mode (MeZO's choice: dropout masks would differ within a pair); no stored perturbation or state.

The QZO baseline (``--zo_method qzo``, ``--zo_scale_mode add``) is QZO as its paper defines it: full-rank
Gaussian ``s +- mu z`` (additive), each ``d_k`` clipped to ``[-C, C]``, ``s <- max(s - lr mean_k d_k z_k, 0)``.

Deviations, and why:
* LQZO's scales are perturbed multiplicatively and updated on ``log s`` (``--zo_scale_mode log``):
  scales span orders of magnitude across layers and groups, so one absolute mu would be a 30% change
  in some groups and nothing in others. This is plain ZO-SGD in ``log s``, i.e. QZO's additive step up to
  a diagonal preconditioner ``s^2`` to first order; the abstract does not say which coordinates LQZO uses.
* Our own quantizer (``quant.py``): asymmetric group-wise, MSE-searched ranges, one code per byte.
* Scales are copied once per direction and restored bit-exactly (MeZO regenerates and subtracts).
* Low-rank directions keep unit variance per entry (the same per-entry scale as QZO's full-rank
  Gaussian), so the estimator stays unbiased for the smoothed loss up to O(mu^2); the paper's exact
  normalization is not given in the abstract. Because the normalizations differ between methods in
  general, a comparison must tune the step size per method: ``bench/lqzo.py`` sweeps it on a validation
  split for each method and bit-width (results: bench/results/lqzo_quick.md).
"""

from llmkit.train.lqzo.config import PRESETS, ZO_METHODS, LQZOArguments, LQZOConfig
from llmkit.train.lqzo.quant import (
           QuantLinear,
           dequantized_state_dict,
           held_bytes,
           quantize_model,
           quantize_weight,
)

__all__ = ["PRESETS", "ZO_METHODS", "LQZOArguments", "LQZOConfig", "QuantLinear", "dequantized_state_dict",
           "held_bytes", "quantize_model", "quantize_weight"]
