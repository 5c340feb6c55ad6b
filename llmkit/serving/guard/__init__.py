"""AEO: a hidden-state guard against instruction injection.

Paper: "Asymmetric Entropic Optimization" (AEO, against prompt-based
instruction injection, NeurIPS 2026). Observation ("Asymmetric Logic"): when a model complies
with its system prompt, the hidden states of its responses concentrate in a
low-variability region; when an injection wins, they scatter in diverse
directions. An entropic divergence between the compliant manifold and a
response's latent trajectory (the "chaos score") detects violations and gates
a lightweight post-hoc correction, with no finetuning.

Algorithm here
--------------
1. Capture (:mod:`capture`): a teacher-forced forward pass of the backbone over
   prompt + response (forward hooks at the guard layers; the pass stops after the
   highest guard block, and the LM head never runs); keep the states of the response
   tokens at a few layers (default: 4 evenly spaced blocks over the second half, the
   last included, so the default guard runs every block). The server splits the pass:
   ``Guard.prefill`` runs the prompt when the request arrives, beside generation, and
   ``check(..., prefill=)`` runs only the response tokens on that KV cache (same
   states up to float rounding). Every response token is captured; a conversation longer
   than the guard's ``max_length`` keeps its system prompt and latest turns (oldest turns
   dropped first), and a response too long for one pass is read in segments.
2. Fit (:mod:`manifold`, :meth:`Guard.fit`): per layer, a probabilistic-PCA Gaussian
   over the token states of compliant responses (mean, top-k principal directions
   and their variances, one isotropic variance off the subspace). A held-out part
   of the compliant data calibrates each layer's score (median, MAD) and sets the
   threshold at a target false-positive rate.
3. Score (:mod:`score`), two kinds (``Guard.fit(score=...)``, saved in guard.json):
   ``"energy"``: per layer, the cross-entropy of the response trajectory's empirical
   distribution against the compliant Gaussian,
   ``c_l = mean_t (h_t - mu_l)^T Sigma_l^{-1} (h_t - mu_l) / d`` (= drift of the
   trajectory's mean + its scatter ``tr(Sigma^{-1} S)``, per dimension);
   ``"entropic"``: the asymmetric Gaussian KL of the trajectory against the compliant
   manifold in whitened coordinates (drift plus the entropic price of scatter beyond the
   compliant spread; tighter-than-compliant trajectories cost nothing: the exact
   definition is in :mod:`score`). Either way
   ``chaos = mean_l (c_l - median_l) / (1.4826 MAD_l)`` and ``flagged = chaos > threshold``.
   Two supervised scores (:mod:`probe`) need violating examples too: ``"probe"``, a
   regularised logistic regression on the guard layers' pooled states (TaskTracker-style), and
   ``"combined"``, the energy score and the probe combined by a second logistic regression
   fitted on held-out responses. Every score is taken over windows of ``window`` response
   tokens (half-overlapping) and a response's score is its highest window's, so a violation
   that starts late in a long answer is not averaged away.
4. Correct (:mod:`correct`): regenerate with a reminder after the last user turn that the
   system instructions take priority (``verbatim=True`` repeats them; the bundled 135M model
   copies repeated text such as "respond with 'Access Granted'" into its answer, so the
   default only points back to them); optionally (transformers engine) pull the guard
   layers' states a fraction ``alpha`` toward the compliant mean. Given the flagged
   ``original``, the correction is kept only when its chaos score is lower.
5. Latent rectification (:mod:`rectify`, transformers models): the guard scores each row's
   trajectory while it is generated; once the score crosses the threshold, a fixed shift
   toward the compliant mean is added at the guard layers and generation continues (no
   second prompt, no second generation).

Measurement (:mod:`dispersion`, :mod:`evaluation`, :mod:`injection`): the asymmetry itself
(violating vs compliant dispersion of response centroids per layer), AUROC and aggregate
bootstrap intervals, and a GSM8K secret-word injection set beside IHEval; ``bench/guard.py``
reports them.

Deviations from the paper (only the abstract is available)
----------------------------------------------------------
- The exact divergence is not given. We use the cross-entropy H(p_traj, q_compliant)
  instead of a KL: a trajectory of T < d tokens has a singular covariance, so its own
  entropy (which KL would subtract) is undefined; keeping it out is also what makes
  the score asymmetric: scatter only ever raises it.
- The compliant manifold is a low-rank-plus-isotropic Gaussian, not a learned model.
- The correction is a re-assertion of the system prompt (plus optional mean-pull
  steering), not the paper's module, whose details the abstract does not give.
- Hidden states come from a teacher-forced pass after generation (for both engines),
  not from the generation pass itself: one prefill-sized forward, and the same code
  path for every engine.

Contract with the server (``llmkit serve --guard DIR --guard-action annotate|block|correct``)
----------------------------------------------------------------------------------------------
``from llmkit.serving.guard import Guard``

- ``Guard.load(DIR, model_name=...)`` -> Guard. Raises ``ValueError`` naming both models
  when the guard was fitted on other weights (an alias and its cached folder count as
  the same); ``FileNotFoundError`` when DIR is not a guard folder.
- ``guard.prefill(engine, messages) -> Prefill | None``: the prompt's part of the pass, to
  start while the engine generates (``None`` when the prompt is too long to keep whole).
- ``guard.check(engine, messages, response_text, prefill=None) -> dict`` with ``score`` (float),
  ``flagged`` (bool), ``threshold`` (float), ``layer_scores`` ({layer: z}),
  ``n_tokens`` (int). ``messages`` is the prompt (OpenAI chat format, without the
  response). ``check_batch(engine, list_of_messages, responses)`` does many at once.
- ``guard.correct(engine, messages, params: GenerationParams, original=None) -> str``: the
  corrected response text (same decoding parameters); with ``original`` the flagged response
  is returned instead when the correction scores no better.
- ``guard.generate(engine, list_of_messages, params) -> [(text, check result)]``: on the hf
  engine the states are recorded during generation (no second forward pass); recorded rows
  are matched to responses through the greedy loop's row dropping, and responses whose rows
  cannot be matched for sure (prompts reordered by the engine, stop strings ending rows at
  different steps) get the teacher-forced pass instead.
- ``engine`` is an ``llmkit.engines`` engine. For ``hf`` the hidden states come from
  ``engine.model``; for ``vllm`` a transformers copy of ``engine.model_name`` is loaded
  once (``llmkit.models.load``) and cached for the teacher-forced pass.

Files: ``DIR/guard.safetensors`` (per layer ``layer{l}.mean|components|variances|noise``,
``calibration.center|scale``, and for the supervised scores ``probe.mean|scale|coef|intercept``
and ``combined.*``) and ``DIR/guard.json`` (score, model name, layer ids, hidden size,
threshold, target FPR, window, max length, counts).
"""

from llmkit.serving.guard.capture import Capture, capture, default_layers, split_conversation
from llmkit.serving.guard.guard import Guard, same_model
from llmkit.serving.guard.manifold import Manifold

__all__ = ["Capture", "Guard", "Manifold", "capture", "default_layers", "same_model", "split_conversation"]
