"""VSPO: steering-vector GRPO (see ``trainer.py`` for the method, ``recipe.py`` for ``llmkit train vspo``).

``mode`` picks VSPO or one of the paper's baselines from the same config: ``grpo`` (reward shaping), ``guidance``
(steering at inference only) and ``teacher`` (teacher-trace distillation, ``teacher.py``). ``bandit.py`` is the
paper's bandit abstraction as a simulation and ``compare.py`` the statistics ``bench/vspo.py`` reports.

``reward_aggregation`` picks how the rewards become one update: ``sum`` (GRPO), ``upgrad`` (Jacobian descent over
per-reward policy gradients) or ``locu`` (maximise the reward subject to ``mean completion words <= locu_max_words``
with one LOCU trust-region step per micro-batch instead of a length-penalty reward); ``trainer.py`` says how.
"""
