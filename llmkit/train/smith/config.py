"""``SmithConfig``: TRL's ``GRPOConfig`` plus the build/use mix, the reward axes, the pool, the sandbox and the
held-out evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from llmkit.optim.hf import LlmkitOptimMixin

AGGREGATIONS = ("normalize_then_sum", "sum_then_normalize", "combined", "upgrad")
SEED_POOL = ("reference", "policy", "none")


@dataclass
class SmithConfig(LlmkitOptimMixin, GRPOConfig):
    """SMITH: one policy trained on build rollouts (write a tool from K examples) and use rollouts (call a pooled
    tool), rewarded on three separate axes (schema, code, outcome)."""

    # ---- tasks and the rollout mix
    train_families: str = field(default="train", metadata={
        "help": "families for training: 'train' (the nine training families) or a comma list; held-out families "
                "are refused"})
    num_prompts: int = field(default=256, metadata={"help": "training rows generated (build and use mixed)"})
    use_share: float = field(default=0.5, metadata={
        "help": "share of each GRPO step's prompts served as use tasks (a question + a pooled tool's schema); the "
                "rest are build tasks. Decided per generation batch over all ranks, so every step holds both kinds "
                "when 0 < use_share < 1 and a step has >= 2 prompts. A use prompt whose family has no pooled tool "
                "takes a question of a pooled training family instead; only an empty pool turns it into a build"})
    seed_pool: str = field(default="reference", metadata={
        "help": "what fills an EMPTY pool before GRPO, so use tasks are trained from step one: reference (the "
                "training families' reference tools, the tools the warm start's build traces teach, each verified "
                "in the sandbox on fresh instances before it joins; source 'warm_start') | policy (the starting "
                "policy writes one tool per training family, greedy; the verified ones join; source 'seed') | none "
                "(the pool grows only from GRPO's own verified builds). Held-out families are never seeded"})
    build_examples: int = field(default=3, metadata={"help": "K input/output examples in a build prompt"})
    build_checks: int = field(default=4, metadata={"help": "fresh instances a built tool is run on for rewards"})
    pass_threshold: float = field(default=1.0, metadata={
        "help": "verification accuracy (outcome) at which a built tool joins the pool"})
    # ---- rewards
    reward_aggregation: str = field(default="normalize_then_sum", metadata={
        "help": "normalize_then_sum (each axis z-scored in its group, then weighted sum: the paper's separate "
                "axes) | sum_then_normalize (TRL default: weighted sum, then group normalization) | combined (the "
                "ablation: one reward function returning schema+code+outcome as a single scalar) | upgrad (each axis's own "
                "group-normalised, weighted advantages give its own policy-gradient loss and Jacobian descent "
                "(UPGrad, llmkit.optim.jd) combines the three gradients; rows an axis skips add nothing to it; "
                "single process)"})
    schema_weight: float = field(default=1.0, metadata={"help": "weight of the schema axis"})
    code_weight: float = field(default=1.0, metadata={"help": "weight of the code axis"})
    outcome_weight: float = field(default=1.0, metadata={"help": "weight of the outcome axis"})
    # ---- pool and sandbox
    pool_dir: str | None = field(default=None, metadata={
        "help": "tool pool (folder, or a .sqlite file); default <output_dir>/pool"})
    sandbox_timeout: float = field(default=2.0, metadata={"help": "wall-clock seconds per tool call"})
    sandbox_memory_mb: int = field(default=256, metadata={"help": "address-space limit of the sandbox"})
    unsafe_no_sandbox: bool = field(default=False, metadata={
        "help": "run tool code WITHOUT bubblewrap where user namespaces are unavailable (never the default)"})
    # ---- optional supervised warm start (documented deviation)
    warm_start_steps: int = field(default=0, metadata={
        "help": "SFT steps on reference-tool traces of the TRAINING families before RL (0 = off). Only training "
                "families' reference tools are used; held-out families stay unseen"})
    warm_start_lr: float = field(default=5e-5, metadata={"help": "learning rate of the warm start"})
    warm_start_top_layers: int = field(default=0, metadata={
        "help": "train only the top N decoder layers (plus the final norm and the output head) during the warm "
                "start; 0 = all. The backward pass then stops N layers down, which is what makes a warm start fit "
                "a shared CPU; every parameter trains again in the RL phase"})
    warm_start_use_share: float = field(default=0.34, metadata={
        "help": "share of warm-start traces that are use traces (a call of the family's reference tool in the "
                "exact <tool_call> format, then the answer); the rest are build traces (spec + code). Building is "
                "the harder skill: on the bundled model a third of 24 traces taught no verified build, two thirds "
                "of 80 taught 6 of 9 training families"})
    # ---- evaluation (held-out families, before/after)
    eval_families: str = field(default="heldout", metadata={"help": "families for the evaluation"})
    eval_n: int = field(default=10, metadata={"help": "questions per evaluated family (0 = no evaluation)"})
    eval_max_new_tokens: int = field(default=256, metadata={
        "help": "generation budget at evaluation for answers (use replies and answers without tools)"})
    eval_build_max_new_tokens: int = field(default=320, metadata={
        "help": "generation budget at evaluation for build replies (a spec + code; the reference tools' traces "
                "are up to ~230 tokens of the bundled model's tokenizer)"})
    eval_no_tools: bool = field(default=True, metadata={"help": "also evaluate the policy answering without tools"})
    eval_reference: bool = field(default=True, metadata={
        "help": "also evaluate the policy calling the reference tools (the use skill alone; reports the call parse "
                "rate)"})
    eval_before: bool = field(default=False, metadata={"help": "also evaluate the starting model"})
    tiny_model_seed: int = field(default=0, metadata={"help": "seed of the tiny-llama test model"})

    def __post_init__(self):
        if self.reward_aggregation not in AGGREGATIONS:
            raise ValueError(f"reward_aggregation must be one of {', '.join(AGGREGATIONS)}, "
                             f"got '{self.reward_aggregation}'")
        if not 0.0 <= self.use_share <= 1.0:
            raise ValueError(f"use_share must be in [0, 1], got {self.use_share}")
        if self.seed_pool not in SEED_POOL:
            raise ValueError(f"seed_pool must be one of {', '.join(SEED_POOL)}, got '{self.seed_pool}'")
        if not 0.0 <= self.warm_start_use_share <= 1.0:
            raise ValueError("warm_start_use_share must be in [0, 1]")
        if self.build_examples < 1 or self.build_checks < 1:
            raise ValueError("build_examples and build_checks must be >= 1")
        # upgrad computes its own per-axis advantages; TRL's summed ones are then only logged
        self.multi_objective_aggregation = {"combined": "sum_then_normalize", "upgrad": "normalize_then_sum"}.get(
            self.reward_aggregation, self.reward_aggregation)
        if self.reward_aggregation == "combined":
            self.reward_weights = None
        else:
            self.reward_weights = [self.schema_weight, self.code_weight, self.outcome_weight]
        super().__post_init__()
