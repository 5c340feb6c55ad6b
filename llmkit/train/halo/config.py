"""Config dataclasses for ``llmkit train halo`` (parsed by TRL's TrlParser from YAML + --key value)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

with warnings.catch_warnings():  # TRL marks its experimental package with a warning on import
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDConfig

from llmkit.optim.hf import LlmkitOptimMixin
from llmkit.train.common import TrainDataArguments
from llmkit.train.halo.schedule import METHODS


@dataclass
class HaloArguments(TrainDataArguments):
    """The layer schedule (HALO or a baseline) and the data: train, validation, forgetting sets."""

    halo_method: str = field(default="halo", metadata={
        "help": "layer schedule: halo (homotopy ramps, output layers first), full (full finetuning), "
                "stepwise (same order, hard unfreezing, no homotopy), lisa (random layer sampling)",
        "choices": list(METHODS)})
    halo_homotopy_fraction: float = field(default=0.5, metadata={
        "help": "fraction of max steps over which t goes from 0 to 1 (0: start at full finetuning)"})
    halo_ramp_width: float = field(default=0.25, metadata={
        "help": "width of each unit's ramp as a fraction of the t range (larger: more units ramp at once)"})
    halo_initial_units: int = field(default=1, metadata={
        "help": "units trainable from step 0 (unit 0 = LM head + final norm, then the last decoder layer, ...)"})
    halo_skip_frozen_backward: bool = field(default=True, metadata={
        "help": "set requires_grad=False on units with lambda=0 so backprop stops early (single process only)"})
    lisa_layers: int = field(default=2, metadata={"help": "lisa: decoder layers active at a time"})
    lisa_interval: int = field(default=5, metadata={"help": "lisa: steps between re-draws of the active layers"})

    eval_data: str | None = field(default=None, metadata={
        "help": "validation data (same formats); its loss is the trainer's eval_loss"})
    eval_data_config: str | None = field(default=None, metadata={"help": "dataset config name for eval_data"})
    eval_split: str = field(default="test", metadata={"help": "split for hub validation datasets"})
    max_eval_samples: int | None = field(default=64, metadata={"help": "use only the first N validation rows"})
    forget_data: str | None = field(default=None, metadata={
        "help": "a set the run does not train on; completion loss on it before and after training "
                "measures forgetting (e.g. MATH-500 problem/solution)"})
    forget_data_config: str | None = field(default=None, metadata={"help": "dataset config name for forget_data"})
    forget_split: str = field(default="test", metadata={"help": "split for hub forgetting datasets"})
    max_forget_samples: int | None = field(default=64, metadata={"help": "use only the first N forgetting rows"})
    forget_max_length: int = field(default=512, metadata={"help": "truncate forgetting sequences to N tokens"})

    def __post_init__(self):
        from llmkit.train.common import apply_deprecated_fields

        apply_deprecated_fields(self, {"train_data": "dataset_name", "train_data_config": "dataset_config",
                                       "train_split": "dataset_train_split"})
        if self.dataset_name == "openai/gsm8k" and self.dataset_config is None:
            self.dataset_config = "main"  # the hub's gsm8k has configs main/socratic and names none as default
        if self.halo_method not in METHODS:
            raise ValueError(f"halo_method must be one of {', '.join(METHODS)}, got {self.halo_method!r}")

    def callback_kwargs(self, seed: int = 0) -> dict:
        return {"method": self.halo_method, "homotopy_fraction": self.halo_homotopy_fraction,
                    "ramp_width": self.halo_ramp_width, "initial_units": self.halo_initial_units,
                    "lisa_layers": self.lisa_layers, "lisa_interval": self.lisa_interval,
                    "skip_frozen_backward": self.halo_skip_frozen_backward, "seed": seed}


@dataclass
class HaloConfig(LlmkitOptimMixin, GKDConfig):
    """TRL's SFT settings (GKDConfig subclasses SFTConfig) plus the distillation keys.

    Setting ``teacher_model_name_or_path`` switches the run from SFT to knowledge distillation
    (GKD; ``lmbda=0`` makes it off-policy KD on the dataset's completions). Without a teacher the
    GKD keys are ignored. ``optim`` also takes llmkit's optimizers (``llmkit.optim.hf``).
    """

    output_dir: str = field(default="outputs/halo", metadata={"help": "checkpoints, metrics, plots, results"})
    lmbda: float = field(default=0.0, metadata={
        "help": "KD only: fraction of batches with student-generated completions (0 = off-policy KD)"})
    temperature: float = field(default=1.0, metadata={"help": "KD only: sampling temperature for on-policy batches"})
