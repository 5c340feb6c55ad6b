"""Per-reward policy gradients combined by Jacobian descent, for any GRPO-based recipe (VSPO, SMITH).

GRPO sums the weighted rewards before it normalises them, so one reward can buy its gain with another's loss
and the update never sees it. ``reward_aggregation: upgrad`` keeps the rewards apart instead: reward k's
group-normalised advantages (times its weight) give its own clipped-surrogate loss L_k, all K computed from one
forward pass (the per-token log-probabilities are computed once and reused), and Jacobian descent with UPGrad
(``llmkit.optim.jd`` over torchjd; paper: "Jacobian Descent for Multi-Objective Optimization", NeurIPS 2026) turns
grad L_1..grad L_K into one direction with a non-negative inner product with every -grad L_k: to first order no
reward is traded away for another. Per-reward losses and UPGrad's weights are logged as ``jd/loss/<reward>`` and
``jd/weight/<reward>``; whatever the aggregation, every step also logs whether the rewards spread within the groups
and pull apart (``reward_conflict_stats``), which is what makes the choice of aggregation matter at all.

Rows a reward does not apply to (its function returned None, which TRL stores as NaN) are left out of that
reward's group mean and scale and get advantage 0, so they add nothing to that reward's gradient. Deviations:
single process only (the aggregated gradient is written into ``.grad`` outside DDP's all-reduce, so ranks would
drift apart; the trainers refuse it); each micro-batch is aggregated on its own and the micro-batch directions are
accumulated, which is UPGrad of the batch only when there is one micro-batch per step. With ``beta > 0`` every
L_k carries the KL penalty, so the combined direction is (for non-conflicting rewards) the mean of the reward
gradients plus beta times the KL gradient: the KL weighs like GRPO on the mean of the rewards, K times more than
GRPO on their sum. UPGrad's direction is an average, not a sum, so its scale is about 1/K of the summed one;
Adam-type optimizers do not see the difference, plain SGD does.
"""

from __future__ import annotations

import torch


def reward_conflict_stats(rewards: torch.Tensor, group_size: int, names: list[str]) -> dict[str, float]:
    """Do the rewards of a batch pull apart? ``rewards`` is (B, K) in groups of ``group_size`` consecutive rows
    (GRPO's layout; NaN where a reward skipped a row). Returns, per reward, ``rewards/<name>/group_spread``: the
    fraction of groups whose scored rows do not all get the same reward (a group without spread gives that
    reward no advantage at all); and per pair a, b, over the groups where both spread (on rows both scored),
    ``reward_conflict/<a>__<b>/cos``: the mean cosine between the two rewards' group-centred values (the
    direction of their advantages; -1 = they rank the rollouts oppositely) and
    ``reward_conflict/<a>__<b>/frac_opposed``: the fraction of all groups where that cosine is negative. The pair
    keys are NaN-free: with no group where both spread, cos is 0 and frac_opposed 0."""
    r = rewards.detach().float().cpu()
    if r.dim() != 2 or r.shape[1] != len(names):
        raise ValueError(f"rewards must be (batch, {len(names)}) for rewards {names}, got {tuple(r.shape)}")
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"batch of {r.shape[0]} rows does not split into groups of {group_size}")
    grouped = r.view(-1, group_size, r.shape[1])
    scored = ~torch.isnan(grouped)
    hi = torch.where(scored, grouped, torch.full_like(grouped, -float("inf"))).amax(dim=1)
    lo = torch.where(scored, grouped, torch.full_like(grouped, float("inf"))).amin(dim=1)
    spread = (scored.sum(dim=1) >= 2) & (hi - lo > 1e-6)  # (groups, K)
    out = {f"rewards/{n}/group_spread": float(spread[:, k].float().mean()) for k, n in enumerate(names)}
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            both = scored[..., a] & scored[..., b]  # (groups, g)
            cos = []
            for i in range(grouped.shape[0]):
                rows = both[i]
                if not (spread[i, a] and spread[i, b]) or rows.sum() < 2:
                    continue
                x, y = grouped[i, rows, a], grouped[i, rows, b]
                x, y = x - x.mean(), y - y.mean()
                if x.norm() > 1e-9 and y.norm() > 1e-9:
                    cos.append(float(x @ y / (x.norm() * y.norm())))
            key = f"reward_conflict/{names[a]}__{names[b]}"
            out[f"{key}/cos"] = sum(cos) / len(cos) if cos else 0.0
            out[f"{key}/frac_opposed"] = sum(c < 0 for c in cos) / grouped.shape[0]
    return out


class RewardJacobianDescentMixin:
    """Mix in before ``GRPOTrainer``. Active when ``args.reward_aggregation == "upgrad"``."""

    def _upgrad_on(self) -> bool:
        return getattr(self.args, "reward_aggregation", "sum") == "upgrad"

    def _check_single_process(self, agg: str) -> None:
        if self.accelerator.num_processes > 1:
            raise ValueError(f"reward_aggregation {agg} runs in a single process (its gradient bypasses DDP's "
                             "all-reduce); use another reward_aggregation for multi-process runs")

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards  # gathered over processes, (global B, num funcs)
        metrics = getattr(self, "_metrics", None)
        if metrics is not None and rewards is not None and rewards.dim() == 2 and rewards.shape[1] > 1:
            mode = "train" if self.model.training else "eval"
            g = self.num_generations if mode == "train" else self.num_generations_eval
            names = getattr(self, "reward_func_names", None) or [f"reward_{k}" for k in range(rewards.shape[1])]
            for key, value in reward_conflict_stats(rewards, g, names).items():
                metrics[mode][key].append(value)
        return rewards

    def attach_per_reward_advantages(self, out: dict, mode: str) -> dict:
        """Add this process's rows of the per-reward advantages to a generated batch (upgrad only)."""
        if not self._upgrad_on():
            return out
        adv = self.per_reward_advantages(getattr(self, "_last_rewards_per_func", None), mode)
        if adv is not None:
            n = out["completion_ids"].shape[0]
            start = self.accelerator.process_index * n
            out["advantages_per_reward"] = adv[start:start + n].to(out["completion_ids"].device)
        return out

    def per_reward_advantages(self, rewards_per_func: torch.Tensor | None, mode: str = "train") -> torch.Tensor | None:
        """(global B, K) advantages: reward k normalised within each group (as GRPO normalises the summed reward,
        following ``scale_rewards``) and multiplied by its weight; rows a reward skipped (None) get 0."""
        if rewards_per_func is None:
            return None
        g = self.num_generations if mode == "train" else self.num_generations_eval
        r = rewards_per_func.float()
        grouped = r.view(-1, g, r.shape[1])
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        adv = grouped - mean
        if self.scale_rewards == "group" and g > 1:
            centred = torch.where(torch.isnan(grouped), torch.zeros_like(grouped), adv)
            count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True).clamp_min(2)
            std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1)).sqrt()
            adv = adv / (std + 1e-4)
        elif self.scale_rewards == "batch":
            valid = ~torch.isnan(r)  # one std per reward over the rows it scored, as TRL's "batch" over the sum
            flat = torch.where(valid, r - torch.nanmean(r, dim=0, keepdim=True), torch.zeros_like(r))
            std = (flat.pow(2).sum(dim=0) / (valid.sum(dim=0).clamp_min(2) - 1)).sqrt()
            adv = adv / (std.view(1, 1, -1) + 1e-4)
        weights = self.reward_weights if self.reward_weights is not None else torch.ones(r.shape[1])
        adv = adv.view(-1, r.shape[1]) * weights.to(adv.device).unsqueeze(0)
        return torch.nan_to_num(adv, nan=0.0)

    def _with_cached_logps(self, fn):
        """Run ``fn()`` with the per-token log-probabilities computed once (later calls reuse the same graph).
        Returns (fn's result, the cached (logps, entropies, aux) tuple or None)."""
        real = self._get_per_token_logps_and_entropies
        cache: dict = {}

        def cached(*a, **kw):
            if "v" not in cache:
                cache["v"] = real(*a, **kw)
            return cache["v"]

        self._get_per_token_logps_and_entropies = cached
        try:
            return fn(), cache.get("v")
        finally:
            del self._get_per_token_logps_and_entropies

    def _ga_scale(self, num_items_in_batch) -> float:
        """The Trainer divides the returned loss by the accumulation steps before backward; gradients written
        directly must be scaled the same way."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        return 1.0 if scaled else 1.0 / self.current_gradient_accumulation_steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        adv = inputs.get("advantages_per_reward") if isinstance(inputs, dict) else None
        if not self._upgrad_on() or adv is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        from llmkit.optim import jd

        grpo_loss = super().compute_loss
        losses, _ = self._with_cached_logps(
            lambda: [grpo_loss(model, {**inputs, "advantages": adv[:, k]}, num_items_in_batch=num_items_in_batch)
                     for k in range(adv.shape[1])])
        scale = self._ga_scale(num_items_in_batch)
        params = [p for p in model.parameters() if p.requires_grad]
        weights = jd.backward_with_weights([loss * scale for loss in losses], params, aggregator="upgrad",
                                           parallel_chunk_size=1)  # TRL's chunked log-prob kernel has no vmap rule
        names = getattr(self, "reward_func_names", [f"reward_{k}" for k in range(len(losses))])
        for k, (name, loss) in enumerate(zip(names, losses)):
            self._metrics["train"][f"jd/loss/{name}"].append(float(loss.detach()))
            if weights is not None and len(weights) == len(losses):
                self._metrics["train"][f"jd/weight/{name}"].append(float(weights[k]))
        # gradients are already in .grad: hand back a graph-free leaf so the Trainer's backward adds nothing
        return torch.stack([loss.detach() for loss in losses]).sum().requires_grad_()
