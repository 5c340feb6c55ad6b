"""``SmithTrainer``: GRPO whose batches mix build and use rollouts and whose use prompts follow a growing pool.

TRL fixes ``tools=`` when the trainer starts, but SMITH's pool grows during training. So tool use is not run
through TRL's tool loop: a row names only a family and an instance, and right before each generation
:meth:`SmithTrainer._generate_and_score_completions` decides which of the batch's prompts are use tasks and writes
their prompts from the pool's current best tool for the family (its schema, never its code).

Every step trains both kinds: ``use_share`` of the generation batch's prompts (counted over all ranks, chosen by a
generator seeded with the run's seed and the step, so every rank takes the same decision for the same prompt) are
use tasks, the rest build tasks, with at least one of each when ``0 < use_share < 1`` and the batch holds two or
more prompts. A use prompt whose family has no pooled tool is asked with a question of a pooled training family
(same row seed); only an empty pool turns it into a build. The recipe seeds an empty pool before GRPO
(``seed_pool``), and the three reward functions (``llmkit.rewards.tools.SmithRewards``) run the code in the sandbox
and add passing builds to the pool with provenance (the step, the family, the verification score).

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


def make_rows(families, n: int, examples: int, seed: int = 0) -> list[dict]:
    """``n`` training rows, the families cycled, each with a build prompt and an instance (question, arguments,
    answer). Whether a row is asked as a build or a use task is decided per step by the trainer (``use_share``)."""
    families = list(families)
    rows = []
    for i in range(n):
        fam = tasks.get(families[i % len(families)])
        row_seed = seed * 100_003 + i
        rows.append({"prompt": build_prompt(fam, fam.generate(examples, seed=row_seed)), "kind": "build",
                     "family": fam.name, "seed": row_seed, "instance": _instance_json(fam, row_seed), "tool": ""})
    return rows


def _instance_json(fam, seed: int) -> str:
    inst = fam.generate(1, seed=seed)[0]
    return json.dumps({"question": inst.question, "args": inst.args, "answer": inst.answer})


def use_count(n_prompts: int, share: float, batch: int = 0) -> int:
    """How many of the ``n_prompts`` of generation batch number ``batch`` are use tasks: the running count
    ``floor(share * prompts so far + 0.5)`` after this batch minus that after the previous one, so the run's share
    is ``share`` even when a batch holds a single prompt (use and build then alternate); at least one of each
    kind when ``0 < share < 1`` and ``n_prompts >= 2``, so no step trains only one skill. Stateless, hence the
    same on every rank and after a resume."""
    import math

    def upto(m: int) -> int:
        return math.floor(share * m + 0.5)

    k = upto((batch + 1) * n_prompts) - upto(batch * n_prompts)
    if 0.0 < share < 1.0 and n_prompts >= 2:
        k = min(max(k, 1), n_prompts - 1)
    return k


class SmithTrainer(LlmkitOptimTrainerMixin, RewardJacobianDescentMixin, GRPOTrainer):
    def __init__(self, *args, pool: ToolPool, build_examples: int = 3, use_share: float = 0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool = pool
        self.build_examples = build_examples
        self.use_share = use_share
        try:  # the training families: stand-ins for a use row are drawn only from these
            self.families = sorted(set(self.train_dataset["family"]))
        except (TypeError, KeyError):  # an iterable dataset without random access: no stand-ins
            self.families = []
        if self._upgrad_on():
            self._check_single_process("upgrad")

    def use_seeds(self, seeds) -> set:
        """The row seeds (of the whole generation batch, all ranks) that are use tasks this step."""
        import random

        uniq = sorted(set(seeds))
        step = self.state.global_step
        # one generation batch feeds steps_per_generation micro-batches, i.e. spg / grad-accum optimizer steps
        per_gen = max(1, int(getattr(self.args, "steps_per_generation", None) or 1)
                      // max(1, int(getattr(self.args, "gradient_accumulation_steps", 1) or 1)))
        rng = random.Random(f"{self.args.seed}/{step}")
        return set(rng.sample(uniq, use_count(len(uniq), self.use_share, step // per_gen)))

    def resolve_row(self, row: dict, use: bool) -> dict:
        """Write the row's prompt: a use task on the pool's current tool for its family (or for a pooled training
        family when its own has none), else a build task."""
        fam = tasks.get(row["family"])
        # only tools added before this step: a faster rank's builds of this very step must not change the prompts
        # of a slower one (a group's generations can sit on several ranks)
        step = self.state.global_step
        best = self.pool.best(fam.name, before_step=step) if use else None
        if use and best is None:
            pooled = [f for f in self.pool.families(before_step=step) if f in self.families]
            if pooled:  # the same row seed picks the stand-in family and its question, on every rank
                fam = tasks.get(pooled[int(row["seed"]) % len(pooled)])
                best = self.pool.best(fam.name, before_step=step)
                row["family"], row["instance"] = fam.name, _instance_json(fam, int(row["seed"]))
        if best is None:
            row["kind"], row["tool"] = "build", ""
            row["prompt"] = build_prompt(fam, fam.generate(self.build_examples, seed=int(row["seed"])))
        else:
            d = json.loads(row["instance"])
            inst = tasks.Instance(fam.name, d["question"], d["args"], d["answer"])
            row["kind"], row["tool"] = "use", json.dumps(best.spec.to_dict())
            row["prompt"] = use_prompt(inst, best.spec)
        return row

    def resolve_batch(self, inputs: list[dict]) -> list[dict]:
        seeds = [int(x["seed"]) for x in inputs]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            seeds = gather_object(seeds)  # a prompt's generations may sit on several ranks
        use = self.use_seeds(seeds)
        return [self.resolve_row(dict(x), int(x["seed"]) in use) for x in inputs]

    def _generate_and_score_completions(self, inputs):
        inputs = self.resolve_batch(inputs)
        mode = "train" if self.model.training else "eval"
        kinds = [x["kind"] for x in inputs]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            kinds = gather_object(kinds)  # the step's share over all ranks, not the main rank's slice
        self._metrics[mode]["smith/pool_size"].append(float(len(self.pool)))
        self._metrics[mode]["smith/use_fraction"].append(sum(k == "use" for k in kinds) / max(len(kinds), 1))
        return self.attach_per_reward_advantages(super()._generate_and_score_completions(inputs), mode)
