"""The LDPCache benchmark (``bench/ldp_cache.py``): workloads, memoized runs and statistics, the
equal-epsilon run, the eviction sweep and ablation, and the fixed-total-budget experiment.

- :mod:`.workload`       GSM8K problem sets, query streams of templated variants, scoring
- :mod:`.runs`           memoized upstream/embedder/mechanism, cache runs, every arm on a stream, the
                         hit-ratio sweep and eviction ablation, the problem bootstrap
- :mod:`.equal_epsilon`  the bench's main run: LLM calls up front, evaluation, printed lines, figures, plot
- :mod:`.fixed_budget`   every arm under one total budget B over Q queries, with intervals

The method itself is ``llmkit.serving.ldp_cache``, which never imports this package.
"""
