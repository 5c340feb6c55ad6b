"""The task interface shared by the eval harness and the reward functions.

A task loads samples, turns one into chat messages (zero- or few-shot),
extracts the answer from a model output and scores it. ``score`` returns one
value per metric; ``primary`` names the metric reported as ``accuracy`` and
used as the GRPO reward.
"""

from __future__ import annotations

from pathlib import Path

from llmkit.evals.data import DataError, is_hub_id, load_hub, load_source, read_records, require


class Task:
    name: str = ""
    primary: str = "accuracy"
    metrics: tuple[str, ...] = ("accuracy",)
    hub_id: str = ""
    hub_config: str | None = None
    split: str = "test"
    fewshot_split: str = "train"
    required: tuple[str, ...] = ()
    max_new_tokens: int = 512  # default generation budget
    stop: tuple[str, ...] = ()

    def __init__(self):
        self._data = None
        self._fewshot: list[dict] | None = None

    # ---- data -------------------------------------------------------------------------------
    def load(self, data: str | Path | None = None, limit: int | None = None) -> list[dict]:
        """Samples from ``data`` (a local file or folder) or, if None, from the hub; first ``limit`` only."""
        self._data = data
        if data is None:
            rows = load_hub(self.hub_id, self.hub_config, self.split)
        else:  # a local file/folder, or another hub id (the task's config only applies to its own hub id)
            rows = load_source(data, self.split, self.hub_config if str(data) == self.hub_id else None)
        if not rows:
            raise DataError(f"{data or self.hub_id}: no samples")
        rows = rows[:limit] if limit else rows
        for r in rows:
            self.validate(r)
        return rows

    def validate(self, rec: dict) -> None:
        require(rec, *self.required)

    def fewshot_pool(self) -> list[dict]:
        """Few-shot examples: the ``train`` file next to the local data, else the hub's train split."""
        if self._fewshot is None:
            rows = None
            if self._data is not None and not is_hub_id(self._data):
                p = Path(self._data)
                folder = p if p.is_dir() else p.parent
                for ext in (".jsonl", ".json"):
                    if (folder / f"{self.fewshot_split}{ext}").is_file():
                        rows = read_records(folder / f"{self.fewshot_split}{ext}")
                        break
                if rows is None:
                    raise DataError(f"few-shot examples for {self.name} need a '{self.fewshot_split}.jsonl' "
                                    f"next to {p}; use --num-fewshot 0")
            else:
                hub_id = self._data or self.hub_id
                rows = load_hub(hub_id, self.hub_config if hub_id == self.hub_id else None, self.fewshot_split)
            for r in rows:
                self.validate(r)
            self._fewshot = rows
        return self._fewshot

    # ---- prompting and scoring ------------------------------------------------------------
    def user_message(self, sample: dict) -> str:
        raise NotImplementedError

    def assistant_message(self, sample: dict) -> str:
        """The reference solution written as the assistant turn (few-shot and --score-gold)."""
        raise NotImplementedError

    def build_prompt(self, sample: dict, num_fewshot: int = 0) -> list[dict]:
        """Chat messages; few-shot examples are earlier user/assistant turns (lm-eval's fewshot_as_multiturn)."""
        msgs: list[dict] = []
        if num_fewshot:
            key = self.user_message(sample)
            shots = [s for s in self.fewshot_pool() if self.user_message(s) != key][:num_fewshot]
            for s in shots:
                msgs += [{"role": "user", "content": self.user_message(s)},
                         {"role": "assistant", "content": self.assistant_message(s)}]
        msgs.append({"role": "user", "content": self.user_message(sample)})
        return msgs

    def render(self, engine, sample: dict, num_fewshot: int = 0) -> str:
        """The prompt string the engine generates from: the chat template applied to ``build_prompt``."""
        return engine.chat_prompt(self.build_prompt(sample, num_fewshot))

    def gold(self, sample: dict) -> str:
        raise NotImplementedError

    def gold_output(self, sample: dict) -> str:
        return self.assistant_message(sample)

    def extract(self, output: str) -> dict:
        raise NotImplementedError

    def score(self, output: str, sample: dict) -> dict[str, float]:
        raise NotImplementedError

    def aggregate(self, scores: list[dict[str, float]]) -> dict[str, float]:
        """Mean of each metric over samples (IHEval overrides this with its own averaging)."""
        out = {}
        for m in self.metrics:
            vals = [s[m] for s in scores if s.get(m) is not None]
            out[m] = sum(vals) / len(vals) if vals else 0.0
        return out
