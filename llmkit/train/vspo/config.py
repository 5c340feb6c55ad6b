"""``VSPOConfig``: TRL's ``GRPOConfig`` plus the steering schedule, the behaviour, the data and the evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from llmkit.optim.hf import LlmkitOptimMixin

MODES = ("vspo", "grpo", "guidance", "teacher")
TEACHER_FILTERS = ("none", "behavior")
SPREADS = ("linspace", "uniform", "aligned")
ANNEALS = ("linear", "cosine", "none")
CORRECTIONS = ("none", "token_truncate", "sequence_truncate")
REWARD_AGGREGATIONS = ("sum", "upgrad", "locu")
POSITIONS = ("all", "answer")


def aligned_rows(num_generations: int, share: float) -> int:
    """Rows of a group sampled inside the aligned range under ``alpha_spread: aligned``."""
    import math

    return math.ceil(share * num_generations - 1e-9)


@dataclass
class VSPOConfig(LlmkitOptimMixin, GRPOConfig):
    """Vector-Steered Policy Optimization and the paper's three baselines. ``mode=grpo`` is reward-shaped GRPO
    (same rewards, alpha = 0); ``mode=guidance`` trains nothing and evaluates the base model steered at
    ``guidance_alpha``; ``mode=teacher`` is teacher-trace distillation (SFT on the steered model's own samples,
    then evaluation unsteered; ``llmkit.train.vspo.teacher``)."""

    mode: str = field(default="vspo", metadata={"help": "vspo | grpo (reward shaping, alpha=0) | guidance "
                                                        "(no training; steering at inference only) | teacher "
                                                        "(SFT on steered traces, evaluated unsteered)"})
    # ---- behaviour and rewards
    behavior: str = field(default="verbosity", metadata={
        "help": "target behaviour: verbosity | concise_answer (rare on the bundled model: <= verbosity_max_words "
                "words, a final answer, on the task) | confidence | confident_answer (rare too) | expertise | "
                "robustness"})
    behavior_weight: float = field(default=1.0, metadata={"help": "weight of the behaviour reward"})
    task_reward: str = field(default="gsm8k", metadata={"help": "task correctness reward: gsm8k | math | none"})
    task_weight: float = field(default=1.0, metadata={"help": "weight of the task correctness reward"})
    verbosity_min_words: int = field(default=5, metadata={"help": "verbosity band: lower bound in words"})
    verbosity_max_words: int = field(default=40, metadata={"help": "verbosity band: upper bound in words (also "
                                                                           "concise_answer's word limit)"})
    # ---- data
    dataset_name: str = field(default="openai/gsm8k", metadata={
        "help": "training data (TRL's ScriptArguments name): GSM8K-style JSONL (question, answer) or a hub id; "
                "relative paths resolve against the cwd, then the repository root"})
    dataset_config: str | None = field(default=None, metadata={
        "help": "dataset config name for hub ids (default: the task's own, 'main' for openai/gsm8k)"})
    dataset_train_split: str = field(default="train", metadata={"help": "split for hub datasets"})
    dataset_path: str | None = field(default=None, metadata={"help": "deprecated: use dataset_name"})
    dataset_limit: int | None = field(default=None, metadata={"help": "use only the first N training problems"})
    hint_seed: int = field(default=0, metadata={"help": "seed for the misleading hints (robustness behaviour)"})
    # ---- steering vector
    steering_vector: str | None = field(default=None, metadata={
        "help": "folder of a saved steering vector (llmkit steer extract); if unset, one is extracted from the "
                "behaviour's built-in contrastive pairs on training questions and saved in output_dir/steering"})
    steering_layers: list[int] | None = field(default=None, metadata={
        "help": "decoder layers for on-the-fly extraction (default: one layer at 60%% depth)"})
    steering_num_pairs: int = field(default=64, metadata={"help": "contrastive pairs for on-the-fly extraction"})
    steering_positions: str = field(default="all", metadata={
        "help": "where the vector is added: all (every position, prompt included: activation addition) | answer "
                "(the last prompt token and every generated token: the prompt is read unsteered); applies to "
                "rollouts, guidance and teacher traces"})
    # ---- intensity schedule
    alpha_max: float = field(default=4.0, metadata={"help": "largest steering intensity in a group at step 0"})
    alpha_spread: str = field(default="linspace", metadata={
        "help": "intensities within a group: linspace (0..alpha_max, evenly) | uniform (row 0 at 0, the rest "
                "drawn uniformly in [0, alpha_max], each group its own draw) | aligned (row 0 at 0; "
                "ceil(aligned_share x G) rows drawn uniformly in aligned_alpha_range at every step, not annealed; "
                "the rest uniform in [0, alpha_max] as annealed; each group its own draw)"})
    aligned_alpha_range: list[float] | None = field(default=None, metadata={
        "help": "[lo, hi]: the intensities at which the alignment check, sampling at the rollout temperature, "
                "measured a behaviour rate above the unsteered one (llmkit.train.vspo.alignment.pick's range). "
                "Required by alpha_spread aligned; with any spread it gives steered_share_above_base in eval.json"})
    aligned_share: float = field(default=1 / 3, metadata={
        "help": "alpha_spread aligned: the least share of each group's rollouts sampled inside aligned_alpha_range"})
    alpha_anneal: str = field(default="linear", metadata={"help": "anneal alpha_max toward 0: linear | cosine | none"})
    alpha_anneal_fraction: float = field(default=1.0, metadata={
        "help": "fraction of max_steps after which intensities reach their final value"})
    alpha_final: float = field(default=0.0, metadata={"help": "alpha_max at the end of annealing"})
    importance_correction: str = field(default="none", metadata={
        "help": "none (on-policy latent self-distillation, the paper's choice) | token_truncate | "
                "sequence_truncate: weight each steered rollout by min(pi/q_alpha, importance_clip)"})
    importance_clip: float = field(default=2.0, metadata={"help": "cap on the importance ratio"})
    reward_aggregation: str = field(default="sum", metadata={
        "help": "sum (GRPO: the weighted rewards are summed, then normalised per group) | upgrad (each reward "
                "function's own group-normalised, weighted advantages give its own policy-gradient loss, and "
                "Jacobian descent with UPGrad combines the per-reward gradients; llmkit.optim.jd) | locu (maximise "
                "the summed reward's policy gradient subject to a constraint, here the length constraint "
                "locu_max_words, in a trust region of radius locu_trust_radius: one LOCU step per micro-batch, "
                "llmkit.optim.constrained.locu_step, written into the gradient). upgrad and locu run in a single "
                "process and with importance_correction none"})
    # ---- constraints (reward_aggregation locu)
    locu_max_words: float | None = field(default=None, metadata={
        "help": "reward_aggregation locu: the constraint 'mean completion length in words <= L' (L = this value). "
                "Its value on a micro-batch is mean words - L (satisfied where <= 0), its gradient a REINFORCE "
                "estimate from the completions' leave-one-out word advantages within each group; required by "
                "locu, refused otherwise"})
    locu_trust_radius: float = field(default=0.05, metadata={
        "help": "reward_aggregation locu: Euclidean bound on the parameter step, ||s|| <= radius (LOCU with the "
                "identity as Fisher). The step is written as the gradient (grad = -s): with optim sgd, "
                "learning_rate 1 and a constant schedule the update is exactly s; other optimizers rescale or "
                "precondition it. Keep max_grad_norm >= the radius (or 0), else clipping shortens the step"})
    # ---- evaluation before/after
    eval_path: str | None = field(default="openai/gsm8k", metadata={
        "help": "GSM8K-style test file or hub id (its test split) for behaviour rate and accuracy "
                "before/after (unset: skip)"})
    eval_num_problems: int = field(default=200, metadata={"help": "test problems to evaluate"})
    eval_max_new_tokens: int = field(default=256, metadata={"help": "generation budget at evaluation"})
    eval_batch_size: int = field(default=16, metadata={"help": "evaluation batch size"})
    eval_before: bool = field(default=True, metadata={"help": "evaluate the starting model as well"})
    stop_after_minutes: float | None = field(default=None, metadata={
        "help": "wall-time budget of this invocation: after the first training step that ends past it, save a "
                "checkpoint and stop without the final evaluation; rerunning the same command resumes (splits a "
                "long CPU run into pieces). The evaluation before training counts toward the budget"})
    guidance_alpha: float = field(default=2.0, metadata={"help": "steering intensity at inference (guidance mode)"})
    # ---- teacher-trace distillation (mode teacher)
    teacher_alpha: float | None = field(default=None, metadata={
        "help": "steering intensity of the teacher's samples (default: guidance_alpha)"})
    teacher_num_traces: int | None = field(default=None, metadata={
        "help": "traces to sample (default: max_steps x per_device_train_batch_size x gradient_accumulation_steps, "
                "the completions a VSPO/GRPO run of this config samples)"})
    teacher_max_new_tokens: int | None = field(default=None, metadata={
        "help": "tokens per trace (default: max_completion_length)"})
    teacher_filter: str = field(default="none", metadata={
        "help": "none (distil every trace) | behavior (keep the traces that show the behaviour; all if none does)"})
    # ---- behaviour-rate curve during training
    curve_every_steps: int = field(default=0, metadata={
        "help": "every N optimizer steps (and at the last), greedy unsteered behaviour rate and accuracy on the "
                "first curve_num_problems evaluation problems (0: off); gives first_step_at_target in eval.json"})
    curve_num_problems: int = field(default=16, metadata={"help": "evaluation problems per curve point"})
    target_behavior_rate: float = field(default=0.5, metadata={
        "help": "behaviour rate whose first crossing on the curve is reported as first_step_at_target"})
    tiny_model_seed: int = field(default=0, metadata={"help": "seed of the in-process model when "
                                                              "model_name_or_path is 'tiny-random'"})

    def __post_init__(self):
        from llmkit.train.common import apply_deprecated_fields

        apply_deprecated_fields(self, {"dataset_path": "dataset_name"})
        super().__post_init__()
        for name, value, allowed in (("mode", self.mode, MODES), ("alpha_spread", self.alpha_spread, SPREADS),
                                     ("alpha_anneal", self.alpha_anneal, ANNEALS),
                                     ("importance_correction", self.importance_correction, CORRECTIONS),
                                     ("reward_aggregation", self.reward_aggregation, REWARD_AGGREGATIONS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got '{value}'")
        if self.steering_positions not in POSITIONS:
            raise ValueError(f"steering_positions must be one of {', '.join(POSITIONS)}, got "
                             f"'{self.steering_positions}'")
        if self.steering_positions != "all" and self.importance_correction != "none":
            raise ValueError("importance_correction rescores whole sequences, which steering_positions "
                             f"{self.steering_positions} does not define: use steering_positions all")
        if self.teacher_filter not in TEACHER_FILTERS:
            raise ValueError(f"teacher_filter must be one of {', '.join(TEACHER_FILTERS)}, got '{self.teacher_filter}'")
        if self.teacher_num_traces is not None and self.teacher_num_traces < 1:
            raise ValueError(f"teacher_num_traces must be >= 1, got {self.teacher_num_traces}")
        if self.curve_every_steps < 0 or self.curve_num_problems < 1:
            raise ValueError("curve_every_steps must be >= 0 and curve_num_problems >= 1")
        if not 0 < self.target_behavior_rate <= 1:
            raise ValueError(f"target_behavior_rate must be in (0, 1], got {self.target_behavior_rate}")
        if self.alpha_max < 0 or self.alpha_final < 0:
            raise ValueError("alpha_max and alpha_final must be >= 0")
        if not 0 < self.alpha_anneal_fraction <= 1:
            raise ValueError("alpha_anneal_fraction must be in (0, 1]")
        if self.stop_after_minutes is not None and self.stop_after_minutes < 0:
            raise ValueError("stop_after_minutes must be >= 0")
        if self.aligned_alpha_range is not None:
            r = self.aligned_alpha_range
            if len(r) != 2 or not 0 < r[0] <= r[1]:
                raise ValueError(f"aligned_alpha_range must be [lo, hi] with 0 < lo <= hi, got {list(r)}")
        if not 0 < self.aligned_share < 1:
            raise ValueError(f"aligned_share must be in (0, 1), got {self.aligned_share}")
        if self.alpha_spread == "aligned":
            if self.aligned_alpha_range is None:
                raise ValueError("alpha_spread aligned needs aligned_alpha_range [lo, hi] (the alignment check's "
                                 "range at the rollout temperature)")
            if aligned_rows(self.num_generations, self.aligned_share) > self.num_generations - 1:
                raise ValueError(f"aligned_share {self.aligned_share:g} of num_generations {self.num_generations} "
                                 "leaves no unsteered rollout in a group: lower aligned_share or raise "
                                 "num_generations")
        if self.importance_clip <= 0:
            raise ValueError("importance_clip must be > 0")
        if self.reward_aggregation != "sum" and self.importance_correction != "none":
            raise ValueError(f"reward_aggregation {self.reward_aggregation} works on per-reward (or per-constraint) "
                             "advantages of the plain policy; use it with importance_correction none")
        if self.reward_aggregation == "locu":
            if self.locu_max_words is None:
                raise ValueError("reward_aggregation locu needs a constraint: set locu_max_words (mean completion "
                                 "words <= L)")
            if not self.locu_max_words > 0:
                raise ValueError(f"locu_max_words must be > 0, got {self.locu_max_words}")
            if not self.locu_trust_radius > 0:
                raise ValueError(f"locu_trust_radius must be > 0, got {self.locu_trust_radius}")
            if self.max_grad_norm and 0 < self.max_grad_norm < self.locu_trust_radius:
                import warnings

                warnings.warn(f"max_grad_norm {self.max_grad_norm:g} < locu_trust_radius {self.locu_trust_radius:g}: "
                              "gradient clipping will shorten the LOCU steps", stacklevel=2)
        elif self.locu_max_words is not None:
            raise ValueError(f"locu_max_words is a constraint of reward_aggregation locu, but reward_aggregation is "
                             f"{self.reward_aggregation}: set --reward_aggregation locu or unset locu_max_words")
        if self.mode != "grpo" and self.use_vllm:
            raise ValueError("VSPO steers rollouts with a forward hook on the training model, which vLLM "
                             "rollouts bypass: set use_vllm false (or mode grpo)")
