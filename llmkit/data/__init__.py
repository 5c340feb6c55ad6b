"""Data shipped inside the package, so the demo and a first ``llmkit eval`` run offline.

``GSM8K_SAMPLE`` is a folder in the layout the eval tasks read (``test.jsonl`` + ``train.jsonl``
for few-shot exemplars): the first 40 GSM8K test problems and the first 8 train problems,
unmodified, MIT-licensed (``gsm8k/LICENSE``). Pass it wherever a GSM8K file or folder is
accepted, e.g. ``llmkit eval gsm8k --data "$(python -c 'import llmkit.data as d; print(d.GSM8K_SAMPLE)')"``.
The full sets come from the hub (``openai/gsm8k``, config ``main``).
"""

from __future__ import annotations

from pathlib import Path

GSM8K_SAMPLE = Path(__file__).resolve().parent / "gsm8k"

__all__ = ["GSM8K_SAMPLE"]
