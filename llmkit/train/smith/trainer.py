"""``SmithTrainer``: GRPO whose batches mix build and use rollouts and whose use prompts follow a growing pool.

TRL fixes ``tools=`` when the trainer starts, but SMITH's pool grows during training. So tool use is not run
through TRL's tool loop: a use row names only a family and an instance, and right before each generation
:meth:`SmithTrainer._generate_and_score_completions` writes its prompt from the pool's current best tool for the
family (its schema, never its code). A use row whose family has no pooled tool yet becomes a build row for that
family; the pool is seeded only by the policy's own verified builds, never by the reference tools. The three
reward functions (``llmkit.rewards.tools.SmithRewards``) run the code in the sandbox and add passing builds to the
pool with provenance (the step, the family, the verification score).

``reward_aggregation: upgrad`` (``llmkit.train.reward_aggregation``): the schema, code and outcome axes each give
their own policy-gradient loss and Jacobian descent combines them, so a gain on one axis is not bought with a loss
on another; an axis that does not apply to a row (None) adds nothing to that axis's gradient. Single process only.
"""

from __future__ import annotations

import json

from trl import GRPOTrainer

from llmkit.optim.hf import LlmkitOptimTrainerMixin
from llmkit.tools import tasks
from llmkit.tools.pool import ToolPool
from llmkit.tools.rollouts import build_prompt, use_prompt
from llmkit.train.reward_aggregation import RewardJacobianDescentMixin


def make_rows(families, n: int, build_ratio: float, examples: int, seed: int = 0) -> list[dict]:
    """``n`` training rows: ``round(n * build_ratio)`` build rows and the rest use rows, interleaved evenly, the
    families cycled. Build rows carry their prompt; use rows get theirs at generation time from the pool (until
    then they hold the build prompt of their family, which is what they become while the pool has no tool)."""
    import random

    rng = random.Random(seed)
    families = list(families)
    n_build = round(n * build_ratio)
    kinds = ["build"] * n_build + ["use"] * (n - n_build)
    rng.shuffle(kinds)
    rows = []
    for i, kind in enumerate(kinds):
        fam = tasks.get(families[i % len(families)])
        row_seed = seed * 100_003 + i
        inst = fam.generate(1, seed=row_seed)[0]
        rows.append({
            "prompt": build_prompt(fam, fam.generate(examples, seed=row_seed)),
            "kind": kind, "row_kind": kind, "family": fam.name, "seed": row_seed,
            "instance": json.dumps({"question": inst.question, "args": inst.args, "answer": inst.answer}),
            "tool": "",
        })
    return rows


class SmithTrainer(LlmkitOptimTrainerMixin, RewardJacobianDescentMixin, GRPOTrainer):
    def __init__(self, *args, pool: ToolPool, build_examples: int = 3, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool = pool
        self.build_examples = build_examples
        if self._upgrad_on():
            self._check_single_process("upgrad")

    def resolve_row(self, row: dict) -> dict:
        """Point a use row at the pool's current tool (or turn it into a build row while there is none)."""
        if row.get("row_kind") != "use":
            return row
        fam = tasks.get(row["family"])
        best = self.pool.best(fam.name)
        if best is None:
            row["kind"], row["tool"] = "build", ""
            row["prompt"] = build_prompt(fam, fam.generate(self.build_examples, seed=int(row["seed"])))
        else:
            d = json.loads(row["instance"])
            inst = tasks.Instance(fam.name, d["question"], d["args"], d["answer"])
            row["kind"], row["tool"] = "use", json.dumps(best.spec.to_dict())
            row["prompt"] = use_prompt(inst, best.spec)
        return row

    def _generate_and_score_completions(self, inputs):
        inputs = [self.resolve_row(dict(x)) for x in inputs]
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["smith/pool_size"].append(float(len(self.pool)))
        self._metrics[mode]["smith/use_fraction"].append(
            sum(x["kind"] == "use" for x in inputs) / max(len(inputs), 1))
        return self.attach_per_reward_advantages(super()._generate_and_score_completions(inputs), mode)
