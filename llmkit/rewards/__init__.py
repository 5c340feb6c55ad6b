"""Reward functions: plain callables with TRL's reward signature (see each module's docstring)."""

from llmkit.rewards.behaviors import BEHAVIORS, confidence, expertise, make_verbosity, robustness  # noqa: F401
from llmkit.rewards.correctness import gsm8k_correctness, math_correctness

__all__ = ["gsm8k_correctness", "math_correctness"]
