"""AEO: a hidden-state guard against instruction injection.

Paper: "Asymmetric Entropic Optimization" (AEO, against prompt-based instruction injection, NeurIPS 2026).
Observation ("Asymmetric Logic"): responses that comply with the system prompt have hidden states in a
low-variability region; when an injection wins, they scatter. An entropic divergence between the compliant
manifold and a response's latent trajectory (the "chaos score") detects violations and gates a lightweight
post-hoc correction, with no finetuning.

Algorithm here:
1. Capture (:mod:`capture`): a teacher-forced pass of the backbone over prompt + response, keeping the
   response tokens' states at a few guard layers (default: 4 evenly spaced blocks over the second half, the
   last included); the LM head never runs. A conversation longer than ``max_length`` keeps its system prompt
   and latest turns, a long response is read in segments; the server runs the prompt part (``Guard.prefill``)
   beside generation, then only the response tokens on that KV cache.
2. Fit (:mod:`manifold`, :meth:`Guard.fit`): per layer, a probabilistic-PCA Gaussian over compliant token
   states; held-out compliant data calibrate each layer (median, MAD) and set the threshold at a target FPR.
3. Score (:mod:`score`, :mod:`probe`; ``Guard.fit(score=...)``, saved in guard.json): ``"energy"`` (the
   trajectory's drift plus scatter against the compliant Gaussian), ``"entropic"`` (asymmetric Gaussian KL:
   scatter beyond the compliant spread costs, tighter trajectories do not), ``"probe"`` (a regularised logistic
   regression on pooled guard-layer states, TaskTracker-style; needs violating examples) or ``"combined"``
   (energy and probe stacked by a second regression on held-out lines); each over half-overlapping windows of
   ``window`` response tokens, a response scoring its highest window.
4. Correct (:mod:`correct`): regenerate with a reminder that the system instructions take priority
   (``verbatim=True`` repeats them), optionally pulling the guard layers' states a fraction ``alpha`` toward
   the compliant mean; kept only when it scores lower than the flagged original.
5. Latent rectification (:mod:`rectify`): score each row while it is generated and, once it crosses the
   threshold, add a fixed shift toward the compliant mean at the guard layers. Measured: bench/results/guard.md.

Deviations from the paper (only the abstract is available): ``energy`` is the cross-entropy H(p_traj,
q_compliant), not a KL (a trajectory of T < d tokens has a singular covariance, so its own entropy is
undefined; leaving it out makes scatter only ever raise the score); the manifold is a low-rank-plus-isotropic
Gaussian; the correction re-asserts the system prompt (plus optional mean-pull steering), not the paper's
unspecified module; states come from a teacher-forced pass (one code path for every engine).

Server contract (``llmkit serve --guard DIR``): ``Guard.load(DIR, model_name=...)`` raises ``ValueError``
naming both models when the guard was fitted on other weights, ``FileNotFoundError`` when DIR is not a guard
folder; ``check`` / ``check_batch`` return ``score``, ``flagged``, ``threshold``, ``layer_scores`` and
``n_tokens``; ``prefill``, ``correct`` and ``generate`` are documented on :class:`Guard`. The vllm engine gets
a transformers copy of the model for the pass. Files: ``DIR/guard.safetensors`` (manifolds, calibration, probe
weights) and ``DIR/guard.json`` (score, model, layers, threshold, window, counts).
"""

from llmkit.serving.guard.capture import Capture, capture, default_layers, split_conversation
from llmkit.serving.guard.guard import Guard, same_model
from llmkit.serving.guard.manifold import Manifold

__all__ = ["Capture", "Guard", "Manifold", "capture", "default_layers", "same_model", "split_conversation"]
