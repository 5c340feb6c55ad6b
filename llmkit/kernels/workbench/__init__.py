"""The Hawkeye kernel workbench: strategy taxonomy per GPU architecture, strategy checks, verifier, generator.

- :mod:`.compiled`: run Triton kernels on CPU (interpreter) and compile the same launches for
  ``ampere`` (sm_80), ``hopper`` (sm_90), ``blackwell`` (sm_100), ``mi350`` (gfx950).
- :mod:`.taxonomy`: load ``kernels/taxonomy/<arch>.yaml`` and recognize strategies in compiled code.
- :mod:`.check`: one strategy test = correctness vs a PyTorch reference + presence in compiled code.
- :mod:`.examples`: the expert-written kernels (and broken twins) the strategy tests launch.
- :mod:`.verify`: KernelBench-style verification of a candidate ``ModelNew`` against ``Model``; the verdict
  is computed in the caller's process, the candidate runs sandboxed in :mod:`.candidate_runner`.
- :mod:`.generate`: the agent loop against an OpenAI-compatible endpoint.

Submodules import triton lazily where they can; ``import llmkit.kernels.workbench`` is cheap.
"""
