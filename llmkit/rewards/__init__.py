"""Reward functions: plain callables with TRL's reward signature (see each module's docstring)."""

from llmkit.rewards.correctness import gsm8k_correctness, math_correctness

__all__ = ["gsm8k_correctness", "math_correctness"]
