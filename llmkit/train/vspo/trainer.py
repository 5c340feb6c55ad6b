"""VSPO: GRPO whose rollouts are sampled under a steering vector at varying intensities.

Paper: "Vector-Steered Policy Optimization" (VSPO), NeurIPS 2026. Per training step:
  1. GRPO draws a group of G rollouts per prompt; VSPO gives the g-th rollout of a group an intensity
     ``alpha_g`` (a spread from 0 to ``alpha_max``, so each group holds unsteered and strongly steered rollouts)
     and samples it with ``alpha_g * v`` added to the residual stream at the steering layers. The rare target
     behaviour then shows up inside most groups, so the group-normalised advantage has signal where
     reward-shaped GRPO sees all-zero behaviour rewards.
  2. ``alpha_max`` is annealed toward ``alpha_final`` (default 0): as the policy internalises the vector, less
     steering is needed and rollouts return to the policy's own distribution.
  3. Rewards and advantages are GRPO's (task correctness + weighted behaviour score).
  4. The loss is GRPO's clipped surrogate on the *unsteered* policy's log-probabilities of the steered tokens
     (the hook is attached only around generation): the paper's "on-policy latent self-distillation".

Intensities: each group draws its own spread (``linspace`` / ``uniform`` / ``aligned``) from one seeded
generator shared by all processes and saved with each checkpoint, so a resumed run draws what an
uninterrupted one would. ``alpha_spread: aligned`` holds ``aligned_share`` of each group inside
``aligned_alpha_range`` (where the alignment check, ``alignment.py``, saw the steered behaviour rate clear the
unsteered one) at every step, the other rows following the annealed spread; ``scheduled_share_in_range``
gives the resulting share (``steered_share_above_base``).

Importance correction (``importance_correction``): none by default (pi/q_alpha is small exactly on the
behaviour the steering made likely); ``token_truncate`` / ``sequence_truncate`` scale steered rows' per-token
advantages by ``min(pi/q_alpha, importance_clip)`` (truncated importance sampling), at one extra forward pass.

Reward aggregation (``reward_aggregation``): ``sum`` is GRPO's; ``upgrad`` gives each reward its own clipped
loss and combines their gradients by Jacobian descent (``llmkit.optim.jd``; "Jacobian Descent for
Multi-Objective Optimization", NeurIPS 2026; logged as ``jd/*``); ``locu`` with ``locu_max_words: L`` treats
"mean completion words <= L" as a constraint handled by LOCU ("Löwdin orthogonalization for multi-constraint
policy optimization", NeurIPS 2026; ``llmkit.optim.constrained``): reward gradient from GRPO's loss,
constraint gradient from a leave-one-out REINFORCE estimate of grad E[words], one trust-region step per
micro-batch (logged as ``locu/*``), with the identity as Fisher (a Euclidean trust region) and the constraint
re-linearised every step because its gradient is estimated from a few rollouts. Both run in one process only.

Deviations from the paper: the intensity schedules are our reading of "varying steering intensities", and
annealing toward 0 is our addition, kept because steered rollouts are off-policy samples; steering is added at
every position, or with ``steering_positions: answer`` only from the last prompt token on (steering the prompt
can make a small model lose the question's numbers); rollouts use transformers generation (vLLM rollouts are
refused: the hook lives in the torch model). Schedule comparisons: bench/results/vspo_bandit.md, vspo.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from trl import GRPOTrainer

from llmkit.optim.constrained import locu_constrained_step
from llmkit.optim.hf import LlmkitOptimTrainerMixin
from llmkit.steering import Steering, SteeringVector, check_compatible
from llmkit.train.reward_aggregation import RewardJacobianDescentMixin
from llmkit.train.vspo.config import aligned_rows

ALPHA_RNG_FILE = "vspo_alpha_rng.pt"  # the intensity generator's state, next to the Trainer's rng_state*.pth


def alpha_scale(step: int, max_steps: int, cfg) -> float:
    """``alpha_max`` in effect at ``step`` under the configured annealing."""
    if cfg.alpha_anneal == "none" or max_steps <= 0:
        return cfg.alpha_max
    end = max(1.0, cfg.alpha_anneal_fraction * max_steps)
    t = min(1.0, step / end)
    if cfg.alpha_anneal == "linear":
        w = 1.0 - t
    else:  # cosine
        w = 0.5 * (1.0 + math.cos(math.pi * t))
    return cfg.alpha_final + (cfg.alpha_max - cfg.alpha_final) * w


def group_alphas(num_generations: int, top: float, spread: str, generator: torch.Generator | None = None,
                 aligned_range: Sequence[float] | None = None, aligned_share: float = 1 / 3) -> torch.Tensor:
    """Intensities for the G rollouts of one group; the first is always 0 (one unsteered rollout per group).

    ``aligned``: rows 1..k (k = ``aligned_rows(G, aligned_share)``) uniform in ``aligned_range`` whatever
    ``top`` is, the others uniform in [0, top]."""
    if num_generations == 1:
        return torch.zeros(1)
    if spread == "linspace":
        return torch.linspace(0.0, top, num_generations)
    a = torch.rand(num_generations, generator=generator) * top
    if spread == "aligned":
        if aligned_range is None:
            raise ValueError("alpha_spread aligned needs aligned_range [lo, hi]")
        lo, hi = float(aligned_range[0]), float(aligned_range[1])
        k = min(aligned_rows(num_generations, aligned_share), num_generations - 1)
        a[1:1 + k] = lo + torch.rand(k, generator=generator) * (hi - lo)
    a[0] = 0.0
    return a


def scheduled_share_in_range(cfg, max_steps: int, num_generations: int, lo: float, hi: float) -> float:
    """Expected share of a run's rollouts whose intensity lies in [lo, hi], from the schedule alone.

    One generation batch per optimizer step (TRL's default ``steps_per_generation``), every group spread by
    ``cfg.alpha_spread`` under ``alpha_scale``; uniform draws count by the length of their overlap with [lo, hi].
    This is ``steered_share_above_base`` when [lo, hi] is the alignment check's range."""
    if getattr(cfg, "mode", "vspo") != "vspo" or cfg.alpha_max <= 0 or max_steps <= 0 or num_generations < 2:
        return 0.0
    g = num_generations
    tol = 1e-9 * max(1.0, hi)

    def uniform_share(top: float) -> float:  # P(U[0, top] in [lo, hi])
        return max(0.0, min(hi, top) - max(lo, 0.0)) / top if top > 0 else float(lo <= 0.0)

    total = 0.0
    for step in range(max_steps):
        top = alpha_scale(step, max_steps, cfg)
        if cfg.alpha_spread == "linspace":
            inside = sum(lo - tol <= float(a) <= hi + tol for a in torch.linspace(0.0, top, g))
        else:
            k = min(aligned_rows(g, cfg.aligned_share), g - 1) if cfg.alpha_spread == "aligned" else 0
            inside = k + (g - 1 - k) * uniform_share(top) + float(lo <= 0.0)
        total += inside / g
    return total / max_steps


def leave_one_out_advantages(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``values[i]`` minus the mean of the other members of its group (groups: consecutive runs of
    ``group_size``). With these advantages ``mean_i A_i grad log pi(y_i)`` is an unbiased estimate of
    ``grad E[value]`` (RLOO baseline). Groups of one get 0."""
    v = values.float().reshape(-1, group_size)
    if group_size < 2:
        return torch.zeros_like(values, dtype=torch.float32)
    others = (v.sum(dim=1, keepdim=True) - v) / (group_size - 1)
    return (v - others).reshape(-1)


class VSPOTrainer(LlmkitOptimTrainerMixin, RewardJacobianDescentMixin, GRPOTrainer):
    """``GRPOTrainer`` with steered rollouts. ``steering_vector`` may be None only when ``args.alpha_max == 0``
    or ``args.mode == 'grpo'`` (then it is plain GRPO through the same code path)."""

    def __init__(self, *args, steering_vector: SteeringVector | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.args
        self.steering_vector = steering_vector
        self._steering_on = getattr(cfg, "mode", "vspo") == "vspo" and cfg.alpha_max > 0
        if self._steering_on:
            if steering_vector is None:
                raise ValueError("VSPO needs a steering vector (or mode grpo / alpha_max 0)")
            if self.use_vllm or self.use_transformers_continuous_batching:
                raise ValueError("VSPO steers transformers generation; disable use_vllm and continuous batching")
            check_compatible(self.accelerator.unwrap_model(self.model), steering_vector)
        self._alpha_gen = torch.Generator().manual_seed(int(cfg.seed))
        agg = getattr(cfg, "reward_aggregation", "sum")
        if agg != "sum":
            self._check_single_process(agg)
        self._current_alphas: torch.Tensor | None = None

    # ------------------------------------------------------------------ intensities
    def current_alpha_max(self) -> float:
        if not self._steering_on:
            return 0.0
        return alpha_scale(self.state.global_step, self.state.max_steps, self.args)

    def rollout_alphas(self, num_rows: int) -> torch.Tensor:
        """One intensity per local rollout row: every group of the global batch draws its own spread.

        Groups are contiguous in the global batch and every process draws the spreads of all of them from
        the same generator, so the processes agree and keep identical generator states (one saved file)."""
        g = self.num_generations
        top = self.current_alpha_max()
        total = num_rows * self.accelerator.num_processes
        spreads = [group_alphas(g, top, self.args.alpha_spread, self._alpha_gen,
                                getattr(self.args, "aligned_alpha_range", None),
                                getattr(self.args, "aligned_share", 1 / 3)) for _ in range(-(-total // g))]
        offset = self.accelerator.process_index * num_rows
        return torch.cat(spreads)[offset:offset + num_rows]

    # the intensity generator is training state: without it a resumed run replays the first steps' draws
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        if self.args.should_save:
            torch.save(self._alpha_gen.get_state(), os.path.join(output_dir, ALPHA_RNG_FILE))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = os.path.join(checkpoint, ALPHA_RNG_FILE) if checkpoint else None
        if path and os.path.isfile(path):
            self._alpha_gen.set_state(torch.load(path, weights_only=True))

    # ------------------------------------------------------------------ generation with steering
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        training = self.model.training
        if not (self._steering_on and training):
            self._current_alphas = torch.zeros(len(prompt_ids))
            self._log_completion_extra("alpha", [0.0] * len(prompt_ids))
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        alphas = self.rollout_alphas(len(prompt_ids))
        self._current_alphas = alphas
        self._log_completion_extra("alpha", alphas.tolist())  # flushed with this batch's completions table
        model = self.accelerator.unwrap_model(self.model)
        with Steering(model, self.steering_vector, alphas, getattr(self.args, "steering_positions", "all")):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        alphas = self._current_alphas
        if alphas is None or len(alphas) != out["completion_ids"].shape[0]:
            alphas = torch.zeros(out["completion_ids"].shape[0])
        device = out["completion_ids"].device
        out["steer_alphas"] = alphas.to(device)
        self._metrics[mode]["vspo/alpha_max"].append(self.current_alpha_max())
        self._metrics[mode]["vspo/alpha_mean"].append(float(alphas.mean()))
        self._metrics[mode]["vspo/steered_fraction"].append(float((alphas > 0).float().mean()))
        rng = getattr(self.args, "aligned_alpha_range", None)
        if rng is not None:  # rollouts sampled where the alignment check saw the behaviour above its base rate
            inside = (alphas >= rng[0] - 1e-9) & (alphas <= rng[1] + 1e-9)
            self._metrics[mode]["vspo/share_above_base"].append(float(inside.float().mean()))
        self._log_reward_by_steering(alphas.to(device), mode)
        words = getattr(self, "_last_completion_words", None)
        if words:  # mean completion length in words (what locu_max_words constrains), for every aggregation
            self._metrics[mode]["vspo/mean_words"].append(sum(words) / len(words))
        if self._steering_on and mode == "train" and self.args.importance_correction != "none" and (alphas > 0).any():
            self._apply_importance_correction(out, alphas.to(device), mode)
        agg = getattr(self.args, "reward_aggregation", "sum")
        if agg == "locu" and mode == "train":
            words = getattr(self, "_last_completion_words", None)
            n = out["completion_ids"].shape[0]
            if words is not None and len(words) == n:
                w = torch.tensor(words, dtype=torch.float32, device=device)
                out["locu_words"] = w
                out["locu_length_advantages"] = leave_one_out_advantages(w, self.num_generations)
        return self.attach_per_reward_advantages(out, mode)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        agg = getattr(self.args, "reward_aggregation", "sum")
        if agg == "locu" and model.training and isinstance(inputs, dict) and "locu_words" in inputs:
            return self._compute_locu_loss(model, inputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)  # upgrad: RewardJacobianDescentMixin

    def _compute_locu_loss(self, model, inputs, num_items_in_batch):
        """LOCU step for "mean completion words <= locu_max_words" (see the module docstring), into .grad."""
        loss, cached = self._with_cached_logps(
            lambda: super(VSPOTrainer, self).compute_loss(model, inputs, num_items_in_batch=num_items_in_batch))
        logps = cached[0]                                               # (B, T), on the graph of `loss`
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        seq_logp = (logps * mask).sum(-1)                              # log pi(y_i) of the whole completion
        adv_len = inputs["locu_length_advantages"].to(seq_logp.dtype)
        surrogate = (adv_len * seq_logp).mean()                        # grad: REINFORCE estimate of grad E[words]
        words = inputs["locu_words"].float()
        c = float(words.mean()) - float(self.args.locu_max_words)
        params = [p for p in model.parameters() if p.requires_grad]
        # each micro-batch adds its own step / accumulation steps: the optimizer step is their mean, inside the ball
        step, info = locu_constrained_step(params, loss, surrogate, c, self.args.locu_trust_radius,
                                           grad_scale=1.0 / self.current_gradient_accumulation_steps)
        predicted = info.predicted_values[0] if info.predicted_values else c
        binding = 0 in info.kept and abs(predicted) <= 1e-6 * (1.0 + abs(c))
        m = self._metrics["train"]
        m["locu/constraint_value"].append(c)
        m["locu/mean_words"].append(float(words.mean()))
        m["locu/satisfied"].append(float(c <= 0))
        m["locu/predicted_value"].append(float(predicted))
        m["locu/step_norm"].append(float(step.norm()))
        m["locu/active"].append(float(binding or info.mode == "recover"))
        m["locu/recover"].append(float(info.mode == "recover"))
        m["locu/reward_gain"].append(float(info.reward_gain))
        return loss.detach().requires_grad_()

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        from llmkit.rewards.behaviors import completion_text, word_count

        self._last_completion_words = [word_count(completion_text(c)) for c in completions]  # local rows
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # keeps the rewards

    def _log_reward_by_steering(self, alphas: torch.Tensor, mode: str) -> None:
        """Mean total reward of steered vs unsteered rollouts in this batch: is steering producing the behaviour?"""
        rewards = getattr(self, "_last_rewards_per_func", None)
        all_alphas = self.accelerator.gather(alphas)
        if rewards is None or rewards.shape[0] != all_alphas.shape[0]:
            return
        total = (rewards * self.reward_weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
        steered = all_alphas.to(total.device) > 0
        if steered.any():
            self._metrics[mode]["vspo/reward_steered"].append(float(total[steered].mean()))
        if (~steered).any():
            self._metrics[mode]["vspo/reward_unsteered"].append(float(total[~steered].mean()))

    # ------------------------------------------------------------------ optional importance correction
    @torch.no_grad()
    def _apply_importance_correction(self, out: dict, alphas: torch.Tensor, mode: str) -> None:
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        keep = out["completion_ids"].size(1)
        bs = self.args.per_device_train_batch_size
        plain = out.get("old_per_token_logps")
        if plain is None:
            plain, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attn, keep, batch_size=bs)
        with Steering(self.accelerator.unwrap_model(self.model), self.steering_vector, alphas) as st:
            # _get_per_token_logps_and_entropies runs the batch in chunks of `bs`; give each chunk its rows' alphas
            steered_chunks = []
            for start in range(0, ids.size(0), bs):
                st.alphas = alphas[start:start + bs]
                lp, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids[start:start + bs], attn[start:start + bs], keep, batch_size=bs)
                steered_chunks.append(lp)
        steered = torch.cat(steered_chunks, dim=0)
        mask = out["completion_mask"].float()
        log_ratio = (plain - steered) * mask
        if self.args.importance_correction == "sequence_truncate":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
        ratio = torch.exp(log_ratio.clamp(max=math.log(self.args.importance_clip)))
        ratio = torch.where((alphas > 0).unsqueeze(1), ratio, torch.ones_like(ratio))  # unsteered rows: exactly 1
        adv = out["advantages"]
        out["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * ratio
        flat = ratio[mask.bool() & (alphas > 0).unsqueeze(1)]
        if flat.numel():
            self._metrics[mode]["vspo/importance_ratio_mean"].append(float(flat.mean()))
            self._metrics[mode]["vspo/importance_ratio_min"].append(float(flat.min()))
