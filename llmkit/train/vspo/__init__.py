"""VSPO: steering-vector GRPO (see ``trainer.py`` for the method, ``recipe.py`` for ``llmkit train vspo``).

``mode`` picks VSPO or one of the paper's baselines from the same config: ``grpo`` (reward shaping), ``guidance``
(steering at inference only) and ``teacher`` (teacher-trace distillation, ``teacher.py``). ``alignment.py``
measures the paper's alignment condition, whose intensity range feeds the ``alpha_spread: aligned`` schedule;
``evaluate.py`` scores behaviour rate and accuracy. The paper's bandit abstraction and the comparison against the
baselines are benchmarks, not the method: bench/vspo_bandit.py and bench/vspo.py (results: bench/results/vspo.md,
vspo_bandit.md).

``reward_aggregation`` picks how the rewards become one update: ``sum`` (GRPO), ``upgrad`` (Jacobian descent over
per-reward policy gradients) or ``locu`` (maximise the reward subject to ``mean completion words <= locu_max_words``
with one LOCU trust-region step per micro-batch instead of a length-penalty reward); ``trainer.py`` says how.
"""
