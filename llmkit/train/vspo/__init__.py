"""VSPO: steering-vector GRPO (see ``trainer.py`` for the method, ``recipe.py`` for ``llmkit train vspo``)."""
