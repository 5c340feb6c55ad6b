"""SMITH (tool build/use RL): config, trainer and recipe. See ``llmkit.train.smith.recipe``'s docstring."""
