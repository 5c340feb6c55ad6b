"""Config dataclasses for ``llmkit train hgms`` (parsed by TRL's TrlParser from YAML + --key value)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import SFTConfig

from llmkit.optim.hf import LlmkitOptimMixin

WEIGHTINGS = ("hgms", "uniform", "doremi", "doge", "odm")


@dataclass
class HgmsArguments:
    """The data sources, the target (outer objective), and the weighting rule with its settings."""

    sources: list[str] = field(default_factory=list, metadata={
        "help": "training sources: in YAML a list of {name, path} (optional split, config, limit); on the "
                "command line name=path ... Each is a JSONL/JSON file or a hub dataset id with "
                "question/answer, problem/solution, prompt/completion or messages rows"})
    max_samples_per_source: int | None = field(default=None, metadata={"help": "use only the first N rows of each"})
    target_data: str = field(default="", metadata={
        "help": "what the outer objective measures (a validation split): its completion loss is minimised "
                "by hgms and drives doge; also the trainer's eval set (eval_target_loss)"})
    target_split: str = field(default="test", metadata={"help": "split for a hub target dataset"})
    target_data_config: str | None = field(default=None, metadata={"help": "dataset config name for target_data"})
    max_target_samples: int | None = field(default=256, metadata={"help": "use only the first N target rows"})
    heldout_data: str | None = field(default=None, metadata={
        "help": "optional held-out set (never used in training or weighting): completion loss after training"})
    heldout_split: str = field(default="test", metadata={"help": "split for a hub held-out dataset"})
    max_heldout_samples: int | None = field(default=64, metadata={"help": "use only the first N held-out rows"})

    weighting: str = field(default="hgms", metadata={
        "help": "hgms (pseudoinverse hypergradient + optimistic selection) | uniform | doremi (excess loss "
                "over a reference model) | doge (gradient alignment with the target) | odm (EXP3 bandit, loss "
                "as reward)", "choices": list(WEIGHTINGS)})
    initial_weights: list[float] | None = field(default=None, metadata={
        "help": "starting weights, one per source (default uniform)"})
    weights_update_interval: int = field(default=5, metadata={
        "help": "optimizer steps between weight updates (odm updates every step: its signal is free)"})
    weights_lr: float = field(default=1.0, metadata={
        "help": "mirror-descent step size on the simplex (with weights_normalize: the largest log-weight change)"})
    weights_normalize: bool = field(default=True, metadata={
        "help": "divide each update's score by its largest magnitude (same step size for every method)"})
    weights_smoothing: float = field(default=0.05, metadata={
        "help": "mix c of uniform into the weights after each update (every weight stays >= c / K)"})
    probe_batch_size: int = field(default=4, metadata={
        "help": "examples per source (and from the target) for each weight update's extra passes"})

    hgms_last_layers: int = field(default=2, metadata={
        "help": "hypergradient parameter subset: trainable parameters of the last N decoder layers (plus a "
                "trainable LM head); 0 = every trainable parameter"})
    hgms_param_regex: str | None = field(default=None, metadata={
        "help": "hypergradient parameter subset by a regular expression on parameter names (overrides "
                "hgms_last_layers)"})
    hgms_lanczos_iters: int = field(default=8, metadata={"help": "Lanczos steps (Hessian-vector products)"})
    hgms_rtol: float = field(default=1e-3, metadata={
        "help": "Ritz values <= rtol * largest are treated as zero (the pseudoinverse's cut-off)"})
    hgms_select_lr: float = field(default=0.0, metadata={
        "help": "optimistic selection: step size of the move along the flat directions of the inner Hessian "
                "toward lower target loss (0 = no selection step; it trains on target data, so it is off by "
                "default and its tokens are reported)"})

    hgms_select_probes: int = field(default=1, metadata={
        "help": "optimistic selection: random-start Lanczos runs per update, each certifying at most one flat "
                "direction of the inner Hessian (probes * hgms_lanczos_iters extra Hessian-vector products)"})
    hgms_trust: bool = field(default=True, metadata={
        "help": "damp each weight step by how much the hypergradient can be believed (llmkit.train.hgms.weights."
                "hgms_trust): 1 near an inner minimizer with a good Hessian model, 0 far from one"})
    hgms_max_grad_ratio: float = field(default=float("inf"), metadata={
        "help": "trust 0 once the (smoothed) inner gradient norm reaches this multiple of its first value "
                "(default inf: off. With LoRA the adapter starts at B = 0, where the gradient is near 0 and "
                "grows by construction, so the ratio reads the adapter's warm-up, not the distance to a "
                "minimizer; hgms_max_newton_gap reads that distance directly)"})
    hgms_max_negative_curvature: float = field(default=0.5, metadata={
        "help": "trust 0 once the most negative Ritz value reaches this fraction of the largest (a saddle, not "
                "a minimizer)"})
    hgms_max_solve_residual: float = field(default=1.0, metadata={
        "help": "trust 0 once the Lanczos solve's relative residual (minimal-residual solve on the kept Ritz "
                "vectors, in [0, 1]) reaches this (1: no better than no solve)"})
    hgms_max_newton_gap: float = field(default=0.1, metadata={
        "help": "trust 0 once the Newton decrement says one Newton step would still remove this fraction of the "
                "inner (probe) loss: the iterate is not near a minimizer"})
    hgms_min_trust: float = field(default=0.05, metadata={
        "help": "refuse the weight update (weights unchanged, counted as weight_refusals) at or below this trust"})

    doremi_reference_model: str | None = field(default=None, metadata={
        "help": "DoReMi's reference model (a model folder or a LoRA adapter folder); default: train one on "
                "the uniform mixture first, as DoReMi does (same settings, saved to output_dir/doremi_reference)"})
    doremi_reference_steps: int | None = field(default=None, metadata={
        "help": "optimizer steps of that uniform reference run (default: max_steps)"})
    odm_decay: float = field(default=0.9, metadata={"help": "ODM: moving-average factor of the reward estimates"})

    def __post_init__(self):
        from llmkit.train.hgms.mixtures import parse_sources

        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        if self.sources:
            self.parsed_sources = parse_sources(self.sources)
            if self.initial_weights is not None and len(self.initial_weights) != len(self.parsed_sources):
                raise ValueError(f"initial_weights has {len(self.initial_weights)} entries for "
                                 f"{len(self.parsed_sources)} sources")
        else:
            self.parsed_sources = []
        if self.weights_update_interval < 1:
            raise ValueError("weights_update_interval must be >= 1")
        if not 0 <= self.weights_smoothing < 1:
            raise ValueError("weights_smoothing must be in [0, 1)")
        if (self.hgms_max_grad_ratio <= 1 or self.hgms_max_negative_curvature <= 0
                or self.hgms_max_solve_residual <= 0 or self.hgms_max_newton_gap <= 0):
            raise ValueError("hgms_max_grad_ratio must be > 1; hgms_max_negative_curvature, hgms_max_solve_residual "
                             "and hgms_max_newton_gap > 0")
        if self.hgms_select_probes < 1:
            raise ValueError("hgms_select_probes must be >= 1")


@dataclass
class HgmsConfig(LlmkitOptimMixin, SFTConfig):
    """TRL's SFT settings (every source is trained with the same SFT loss, completion tokens only), plus
    ``optim: llmkit_muon | llmkit_lion | ...`` (``llmkit.optim.hf``)."""

    output_dir: str = field(default="outputs/hgms", metadata={"help": "checkpoints, metrics, plots, weights"})
