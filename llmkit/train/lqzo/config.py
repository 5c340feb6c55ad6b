"""Config dataclasses for ``llmkit train lqzo`` (parsed by TRL's TrlParser from YAML + --key value)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import SFTConfig

from llmkit.train.common import TrainDataArguments

ZO_METHODS = ("lqzo", "qzo", "mezo")
TASKS = ("sentiment", "compare", "none")

# what each --zo_method means when the individual switches are left unset (None)
# QZO (Shang et al., "Fine-tuning Quantized Neural Networks with Zeroth-order Optimization") perturbs the scales
# additively (s +- mu z), clips each directional derivative to [-C, C] and projects the scales onto s >= 0.
# Its C is our choice (the paper's value is not in the abstract); --zo_clip overrides it.
QZO_CLIP = 100.0
PRESETS = {
    "lqzo": {"rank": 4, "distribution": "rademacher", "isotropic": True, "quantized": True, "scale_mode": "log",
             "clip": None},
    "qzo": {"rank": 0, "distribution": "gaussian", "isotropic": False, "quantized": True, "scale_mode": "add",
            "clip": QZO_CLIP},
    "mezo": {"rank": 0, "distribution": "gaussian", "isotropic": False, "quantized": False, "scale_mode": "add",
             "clip": None},
}
SCALE_MODES = ("log", "add")


@dataclass
class LQZOArguments(TrainDataArguments):
    """The ZO estimator (each LQZO piece is its own switch), the quantization, and the data."""

    zo_method: str = field(default="lqzo", metadata={
        "help": "lqzo (low-rank Rademacher perturbations of isotropically regrouped scales), qzo (full-rank "
                "Gaussian perturbations of the scales), mezo (full-precision model, all weights perturbed)",
        "choices": list(ZO_METHODS)})
    zo_rank: int | None = field(default=None, metadata={
        "help": "rank r of the U V^T perturbation of each scale matrix; 0 = full rank (iid entries). "
                "Unset: lqzo 4, qzo/mezo 0"})
    zo_distribution: str | None = field(default=None, metadata={
        "help": "entries of the perturbation (or of its factors): rademacher | gaussian. Unset: lqzo rademacher, "
                "qzo/mezo gaussian"})
    zo_isotropic_groups: bool | None = field(default=None, metadata={
        "help": "regroup each (out, in/group) scale matrix into its closest-to-square (out/k, k*in/group) view "
                "before the low-rank factorization. Unset: lqzo true, qzo/mezo false"})
    zo_clip: float | None = field(default=None, metadata={
        "help": "clip each projected derivative (l+ - l-)/(2 mu) to [-c, c] (QZO's clipping = RSC-ZO's scalar "
                f"clipping, robust to heavy-tailed noise); 0 = no clipping. Unset: qzo {QZO_CLIP}, lqzo/mezo none"})
    zo_scale_mode: str | None = field(default=None, metadata={
        "help": "how the quantization scales are perturbed and updated: log (s * (1 + mu z), the step taken on "
                "log s, so a scale keeps its sign and never dies) or add (s + mu z, then s = max(s, 0): QZO). "
                "Unset: lqzo log, qzo add", "choices": list(SCALE_MODES)})
    zo_mu: float = field(default=1e-3, metadata={
        "help": "perturbation size: relative for scales in log mode (s * (1 + mu z)), absolute otherwise (x + mu z)"})
    zo_num_directions: int = field(default=1, metadata={"help": "q: perturbations per step (2q forward passes)"})
    zo_v_interval: int = field(default=10, metadata={
        "help": "LOZO's lazy sampling: the V factor of U V^T is redrawn every N steps (1: every step)"})
    zo_train_norms: bool = field(default=False, metadata={
        "help": "also train the unquantized norm weights and biases (additively, full rank)"})

    quant_bits: int = field(default=4, metadata={
        "help": "weight bits for the linear layers (4 or 2; 0 = no quantization); ignored by zo_method mezo",
        "choices": [0, 2, 3, 4, 8]})
    quant_group_size: int = field(default=64, metadata={"help": "weights per quantization group (input dim)"})

    task_train_samples: int = field(default=0, metadata={
        "help": "mix N rows of the procedural accuracy task (accuracy_task) into the training data"})
    eval_data: str | None = field(default=None, metadata={
        "help": "held-out data (same formats); its completion loss is reported before and after training"})
    eval_data_config: str | None = field(default=None, metadata={"help": "dataset config name for eval_data"})
    eval_split: str = field(default="test", metadata={"help": "split for hub validation datasets"})
    max_eval_samples: int | None = field(default=64, metadata={"help": "use only the first N held-out rows"})
    accuracy_task: str = field(default="sentiment", metadata={
        "help": "two-choice accuracy reported before/after, scored by the log-likelihood of the two answers: "
                "sentiment (procedural two-sentence reviews, positive/negative), compare (which of two numbers "
                "is larger) or none", "choices": list(TASKS)})
    accuracy_samples: int = field(default=200, metadata={"help": "held-out problems of the accuracy task"})

    def __post_init__(self):
        from llmkit.train.common import apply_deprecated_fields

        apply_deprecated_fields(self, {"train_data": "dataset_name", "train_data_config": "dataset_config",
                                       "train_split": "dataset_train_split"})
        if self.dataset_name == "openai/gsm8k" and self.dataset_config is None:
            self.dataset_config = "main"  # the hub's gsm8k has configs main/socratic and names none as default
        if self.zo_method not in ZO_METHODS:
            raise ValueError(f"zo_method must be one of {', '.join(ZO_METHODS)}, got {self.zo_method!r}")
        if self.zo_distribution is not None and self.zo_distribution not in ("rademacher", "gaussian"):
            raise ValueError(f"zo_distribution must be rademacher or gaussian, got {self.zo_distribution!r}")
        if self.zo_rank is not None and self.zo_rank < 0:
            raise ValueError(f"zo_rank must be >= 0, got {self.zo_rank}")
        if self.zo_clip is not None and self.zo_clip < 0:
            raise ValueError(f"zo_clip must be positive (or 0 for no clipping), got {self.zo_clip}")
        if self.zo_scale_mode is not None and self.zo_scale_mode not in SCALE_MODES:
            raise ValueError(f"zo_scale_mode must be one of {', '.join(SCALE_MODES)}, got {self.zo_scale_mode!r}")
        if self.zo_mu <= 0 or self.zo_num_directions < 1 or self.zo_v_interval < 1:
            raise ValueError("zo_mu must be > 0, zo_num_directions >= 1, zo_v_interval >= 1")
        if self.accuracy_task not in TASKS:
            raise ValueError(f"accuracy_task must be one of {', '.join(TASKS)}, got {self.accuracy_task!r}")

    def resolved(self) -> dict:
        """The effective estimator settings: the method's preset with every explicit switch applied."""
        p = PRESETS[self.zo_method]
        return {
            "method": self.zo_method,
            "rank": p["rank"] if self.zo_rank is None else self.zo_rank,
            "distribution": p["distribution"] if self.zo_distribution is None else self.zo_distribution,
            "isotropic": p["isotropic"] if self.zo_isotropic_groups is None else bool(self.zo_isotropic_groups),
            "clip": p["clip"] if self.zo_clip is None else (self.zo_clip or None),
            "scale_mode": p["scale_mode"] if self.zo_scale_mode is None else self.zo_scale_mode,
            "mu": self.zo_mu,
            "num_directions": self.zo_num_directions,
            "v_interval": self.zo_v_interval,
            "train_norms": self.zo_train_norms or not p["quantized"],
            "quant_bits": self.quant_bits if p["quantized"] else 0,
            "quant_group_size": self.quant_group_size,
        }


@dataclass
class LQZOConfig(SFTConfig):
    """TRL's SFT settings (data formatting, completion-only loss, logging, checkpoints, schedule)."""

    output_dir: str = field(default="outputs/lqzo", metadata={"help": "checkpoints, metrics, plots, results"})
    learning_rate: float = field(default=1e-3, metadata={
        "help": "ZO step size (relative for scales; MeZO on raw weights needs ~1e-6)"})
    weight_decay: float = field(default=0.0, metadata={
        "help": "decoupled decay of additively trained matrices (MeZO); scales and norms are never decayed"})
    max_grad_norm: float = field(default=0.0, metadata={"help": "unused (no gradients); kept at 0"})
    max_length: int | None = field(default=256, metadata={"help": "truncate training sequences to N tokens"})

    def __post_init__(self):
        # TrainingArguments turns optim into its enum first and would fail with a bare "not a valid
        # OptimizerNames"; say why our optimizers do not apply here instead.
        if str(self.optim).startswith("llmkit_"):
            raise ValueError(f"--optim {self.optim} does not apply to LQZO: it takes no gradients and keeps no "
                             "optimizer state; choose the estimator with --zo_method lqzo|qzo|mezo")
        super().__post_init__()
