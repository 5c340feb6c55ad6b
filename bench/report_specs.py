"""Per-bench spec for bench/report.py: a title, the command that produced the JSON, what it measures, the README
table's cell and the findings (sentence makers in report_findings.py and below), keyed by the JSON's name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from report_findings import (
    _g_arms,
    _g_cross,
    _g_detect,
    _g_gsm8k,
    _g_iheval,
    _kv_base,
    _kv_best,
    _kv_cap,
    _kv_long,
    _kv_off,
    _kv_ppl,
    _ldp_arith,
    _ldp_curve,
    _ldp_plain,
    _ldp_where,
    ci,
    pct,
    said,
    sgn,
)
from report_hgms import HGMS
from report_train import (
    _halo_control,
    _halo_size,
    _lqzo,
    _lqzo_est,
    _lqzo_est_head,
    _lqzo_head,
    _lqzo_long,
    _lqzo_mem,
    _smith,
    _vspo_align,
    _vspo_arms,
)


@dataclass(frozen=True)
class Spec:
    title: str
    command: str
    about: str
    headline: Callable | None = None  # (data, load) -> the README table's cell; None: listed in the index only
    findings: Callable | None = None  # (data, load) -> sentences
    sections: tuple = ()  # JSON keys tabulated on the page; default "figures", else every key but config/runs


KV = {"title": "InQuant 4-bit KV cache", "about": "Perplexity, capacity, quantization speed and serving of InQuant vs "
          "bf16, KIVI, an outlier buffer and HF quanto on the bundled model.",
          "findings": said(_kv_ppl, _kv_long, _kv_off, _kv_base, _kv_cap)}
GUARD = {"title": "AEO hidden-state guard", "about": "Dispersion asymmetry per layer, detection on IHEval and a GSM8K "
             "injection set, and the corrections, with bootstrap intervals.",
             "findings": said(_g_iheval, _g_gsm8k, _g_detect, _g_cross, _g_arms)}
HALO = {"title": "HALO vs full finetuning, step-wise unfreezing and LISA", "about": "SFT of the bundled model on GSM8K: "
            "steps to a validation target, final loss and forgetting, each schedule at its swept rate.",
            "findings": lambda d, load: _halo_size(d, load) + said(_halo_control)(d, load)}
VSPO = {"title": "VSPO vs reward-shaped GRPO, teacher traces and guidance", "about": "Rare-behaviour rate and accuracy "
            "after training the bundled model, 3 arms plus inference-time guidance.", "findings": said(_vspo_align, _vspo_arms)}
LQZO = {"title": "LQZO vs QZO, MeZO and QLoRA", "about": "Zeroth-order finetuning of INT4/INT2 quantization scales: recovered "
            "loss gap, memory and step time.", "findings": said(_lqzo, _lqzo_mem), "sections": ("summary", "memory")}
SMITH = {"title": "SMITH tool building and use", "about": "Verified tool builds, pool growth, held-out accuracy with "
             "and without tools, sandbox containment.", "findings": said(_smith),
             "sections": ("build_verified_rate_before", "build_verified_rate_after", "conditions", "sandbox")}
LDP_FB = {"title": "LDPCache at a fixed privacy budget", "about": "Accuracy of LDPCache, LRU and per-query LDP when B "
              "epsilon is spread over Q queries (candidate mechanism).", "findings": said(_ldp_curve, _ldp_where, _ldp_plain)}
LDP = "python bench/ldp_cache.py"
# the committed run: each cell's sweep set where its runs showed its rates lie (QZO diverges above ~1.6e-5)
LQZO_LONG = "\n".join([f"python bench/lqzo.py --long --only {c} --lr-sweep {g}" for c, g in (
    ("qzo_int2", "9.765625e-7,3.90625e-6,1.5625e-5,6.25e-5,2.5e-4"), ("qzo_int4", "9.765625e-7,3.90625e-6,1.5625e-5,6.25e-5,2.5e-4"),
    ("lqzo_int2", "9.765625e-7,3.90625e-6,1.5625e-5,6.25e-5,2.5e-4"), ("lqzo_int4", "3.90625e-6,1.5625e-5,6.25e-5,2.5e-4,1e-3,4e-3"))]
    + ["python bench/lqzo.py --long --only probes", "python bench/lqzo.py --long"])

SPECS: dict[str, Spec] = {
    "kv_cache": Spec(command="python bench/kv_cache.py", **KV, headline=lambda d, _: (
        f"per-token/score perplexity {pct(d['arms']['ppl']['inquant/per-token/score'] / d['arms']['ppl']['bf16'])} vs bf16 (best: "
        f"`{_kv_best(d['arms']['ppl'])}` {pct(d['arms']['ppl'][_kv_best(d['arms']['ppl'])] / d['arms']['ppl']['bf16'])}); "
        f"{d['figures']['capacity_ratio_vs_bf16']:.2f}x sequences per GiB")),
    "kv_cache_quick": Spec(command="python bench/kv_cache.py --quick", **KV),
    "guard": Spec(command="python bench/guard.py --responses-cache R.json --captures-dir C   # after the --shard runs "
                  "in `python bench/guard.py --help`", **GUARD, headline=lambda d, _: (
                      f"IHEval violations less dispersed (log-det ratio {d['figures']['dispersion_logdet_iheval']:.2f}"
                      f"); test AUROC {d['figures']['auroc_aeo']:.3f} (probe {d['figures']['auroc_probe']:.3f}); "
                      f"re-prompt {sgn(d['iheval_arm_intervals']['guard_correct_minus_no_guard']['value'])}")),
    "guard_quick": Spec(command="gunzip -c bench/results/guard_parts/responses_full.json.gz > R.json\n"
                        "python bench/guard.py --quick --engine vllm --max-new-tokens 64 --responses-cache R.json",
                        **GUARD),
    "halo": Spec(command="python bench/halo.py", **HALO, headline=lambda d, _: (
        f"n=32 final val loss HALO {d['figures']['final_val_loss_halo']:.3f}, full "
        f"{d['figures']['final_val_loss_full']:.3f}, step-wise {d['figures']['final_val_loss_stepwise']:.3f} (control: see page)")),
    "halo_quick": Spec(command="python bench/halo.py --quick --sweep_sizes smallest", **HALO),
    "halo_full_lr3e-5_n32": Spec(title="HALO control: full finetuning at 3e-5, n=32", about="Full finetuning at 3e-5 on "
                                 "the n=32 split of halo.json, 3 seeds.", command="python bench/halo.py --name halo_full_lr3e-5_n32 --methods full --lrs 3e-5 --sizes 32"),
    "vspo": Spec(command="python bench/vspo.py", **VSPO, headline=lambda d, _: "behaviour rate " + ", ".join(
        f"{k} {v['behavior_rate']['rate']:.3f}" for k, v in d["summary"].items()) + "; VSPO rollouts where steering "
        f"beats the unsteered rate {d['figures'].get('steered_share_above_base') or 0:.2f}"),
    "vspo_quick": Spec(command="python bench/vspo.py --quick", **VSPO),
    "vspo_timing": Spec(title="VSPO step time", about="Training-step time of VSPO vs GRPO.", command="python "
                        "bench/vspo.py --timing", headline=lambda d, _: (
                            f"step time {d['figures']['step_time_ratio_vs_grpo']:.2f}x GRPO")),
    "vspo_timing_quick": Spec(title="VSPO step time (quick)", about="Training-step time of VSPO vs GRPO, tiny model.",
                              command="python bench/vspo.py --timing --quick"),
    "vspo_bandit": Spec(title="VSPO bandit abstraction", about="Iterations to first success, censored runs kept "
                        "censored (Kaplan-Meier medians).", command="python bench/vspo_bandit.py", headline=lambda d, _: (
                            f"p0=0.005: aligned VSPO {d['figures']['vspo_aligned_p0_0.005_reached']} reached, reward "
                            f"shaping {d['figures']['reward_shaping_p0_0.005_reached']}")),
    "vspo_bandit_quick": Spec(title="VSPO bandit abstraction (quick)", about="As vspo_bandit, fewer seeds.",
                              command="python bench/vspo_bandit.py --quick"),
    "lqzo_quick": Spec(command="python bench/lqzo.py --quick", **LQZO, headline=_lqzo_head),
    "lqzo_quick_estimator": Spec(title="LQZO estimator quality", about="Cosine of each zeroth-order estimate with the autograd "
                                 "gradient of the scales, per variant, bit-width and directions q.", findings=said(_lqzo_est),
                                 command="python bench/lqzo.py --quick --only estimator", headline=_lqzo_est_head, sections=("summary",)),
    "lqzo_long": Spec(title="LQZO vs QZO, long runs at INT2 and INT4", about="1000 zeroth-order steps per run on "
                      "sentiment rows, lr per cell chosen on validation, 5 seeds at INT2 (the paper's claim) and 3 at INT4: "
                      "test loss and accuracy paired by seed. INT2's seeds 3 and 4 were added after 3 seeds could not "
                      "separate the methods; its interval is not corrected for that second look.",
                      command=LQZO_LONG,
                      findings=said(_lqzo_long, _lqzo_mem), sections=("summary", "memory"), headline=lambda d, _: (
                          f"INT2 LQZO - QZO test loss {sgn(d['summary']['paired_diff_int2']['mean'])} "
                          f"{ci((d['summary']['paired_diff_int2']['lo'], d['summary']['paired_diff_int2']['hi']))}, "
                          f"INT4 {sgn(d['summary']['paired_diff_int4']['mean'])} "
                          f"{ci((d['summary']['paired_diff_int4']['lo'], d['summary']['paired_diff_int4']['hi']))} "
                          f"({d['summary']['seeds_lqzo_int2']} and {d['summary']['seeds_lqzo_int4']} seeds, "
                          f"{d['summary']['steps_per_run']} steps)")),
    "smith_quick": Spec(command="python bench/smith.py --quick", **SMITH, headline=lambda d, _: (
        f"held-out macro accuracy {d['conditions']['smith']:.3f} (base model without tools "
        f"{d['conditions']['no_tools']:.3f}, warm-started student without tools "
        f"{d['conditions'].get('student_no_tools', float('nan')):.3f}); "
        f"builds verified {d['build_verified_rate_before']:.2f} -> {d['build_verified_rate_after']:.2f}")),
    "ldp_cache_fixed_budget": Spec(command=f"{LDP} --fixed-budget-only", **LDP_FB, headline=lambda d, _: (
        f"B/Q 4: {sgn(d['pooled']['4.0']['ldpcache']['diff_vs_no_cache'])} "
        f"{ci(d['pooled']['4.0']['ldpcache']['diff_vs_no_cache_ci95'])} vs per-query LDP; B/Q 12: "
        f"{sgn(d['pooled']['12.0']['ldpcache']['diff_vs_no_cache'])}")),
    "ldp_cache_fixed_budget_quick": Spec(command=f"{LDP} --quick --fixed-budget-only", **LDP_FB),
    "ldp_cache_fixed_budget_quick_b2_bitshare05": Spec(command=f"{LDP} --quick --fixed-budget-only --budgets 2 "
                                                       "--bit-share 0.5 --fixed-budget-out "
                                                       "ldp_cache_fixed_budget_quick_b2_bitshare05", **LDP_FB),
    "ldp_cache_fixed_budget_quick_no_gain_test": Spec(command=f"{LDP} --quick --fixed-budget-only --gain-threshold 1e9 "
                                                      "--fixed-budget-out ldp_cache_fixed_budget_quick_no_gain_test", **LDP_FB),
    "ldp_cache_arith": Spec(title="LDPCache at equal epsilon per token", about="Arithmetic workloads behind llmkit "
                            "serve: accuracy, hit ratio and budget saved vs no cache.", findings=said(_ldp_arith),
                            command=f"{LDP} --workloads uniform_arith,zipf_arith", headline=lambda d, _: (
                                f"pooled accuracy vs no cache {sgn(d['figures']['accuracy_diff_pooled'])} "
                                f"{ci(d['figures']['accuracy_diff_pooled_ci95'])}")),
    "ldp_cache": Spec(title="LDPCache, open-ended GSM8K workloads", about="Hit ratio, budget saved and accuracy on uniform and zipf GSM8K workloads.", command=f"{LDP} --workloads uniform,zipf"),
    "ldp_cache_eviction_ablation": Spec(title="LDPCache eviction ablation", about="Hit ratio of multi-factor eviction with factors removed vs LRU.", command=f"{LDP} --eviction-ablation"),
    "serving": Spec(title="Serving throughput", about="llmkit serve vs sequential generate and raw vLLM.",
                    command="python bench/serving.py", headline=lambda d, _: (
                        f"hf engine {d['hf_vs_sequential_ratio']:.2f}x sequential generate; vLLM engine "
                        f"{d['vllm_vs_raw_ratio']:.2f}x raw vLLM")),
    "serving_hf_continuous": Spec(title="Serving throughput, hf engine only", about="Continuous batching on the hf engine vs sequential generate.",
                                  command="python bench/serving.py --skip-vllm --out bench/results/serving_hf_continuous.json"),
    "serving_client": Spec(title="vLLM's own client against vLLM's server and llmkit serve", about="vllm bench serve "
                           "(random prompts, completions, ignore_eos) against vLLM's OpenAI server, llmkit serve "
                           "--engine vllm and llmkit serve (hf): output tok/s ratios, median TTFT/TPOT, failures.",
                           command="python bench/serving.py --client-only"),
    "serving_robustness": Spec(title="Serving under hostile traffic", about="Malformed requests, then valid ones.",
                               command="python bench/serving_robustness.py", headline=lambda d, _: (
                                   f"{d['malformed_4xx']}/{d['malformed']} malformed requests got a 4xx; "
                                   f"{d['valid_200']}/{d['valid']} valid ones a 200")),
    "evals": Spec(title="Evals: GSM8K and MATH-500", about="The bundled model's scores and llmkit's overhead over raw "
                  "vLLM and plain generate.", command="python bench/evals.py", headline=lambda d, _: (
                      f"GSM8K flexible-extract {d['gsm8k_metrics']['flexible_extract']:.3f} (n={d['gsm8k_n']}); "
                      f"vLLM path {d['vllm_vs_raw_ratio']:.2f}x raw vLLM time")),
    "kernels": Spec(title="Kernels workbench", about="Strategy tests per architecture and the verifier on known-bad "
                    "kernels.", command="python bench/kernels.py", headline=lambda d, _: (
                        f"strategy tests {d['strategy_tests_passed']}/{d['strategy_tests_total']}; bad kernels "
                        f"rejected {d['verifier_bad_rejected']}/{d['verifier_bad_total']}")),
    "hgms_quick": Spec(title="HG-MS data-source reweighting (quick)", command="python bench/hgms.py --quick", **HGMS),
    "hgms": Spec(title="HG-MS data-source reweighting", command="python bench/hgms.py", **HGMS),
    "optim_quick": Spec(title="Optimizer backends in the recipes (quick)", about="Muon, Lion and UPGrad against AdamW "
                        "and summed rewards.", command="python bench/optim.py --quick", headline=lambda d, _: (
                            f"eval loss vs AdamW: Muon {d['muon_vs_adamw_eval_loss_ratio']:.3f}x, Lion "
                            f"{d['lion_vs_adamw_eval_loss_ratio']:.3f}x; toys {d['toys']['passed']}/{d['toys']['total']}")),
    "optim_structured": Spec(title="Constrained and robust optimization", about="LOCU vs penalties, TC-DRO vs ERM, "
                             "inverse optimization.", command="python bench/optim_structured.py", headline=lambda d, _: (
                                 f"LOCU feasible {d['locu_feasible_rate']:.2f} vs penalty "
                                 f"{d['penalty2_feasible_rate']:.2f}; TC-DRO tail MSE {d['tc_dro_tail_mse_ratio_vs_erm']:.2f}x ERM")),
    "select_quick": Spec(title="Model selection and tuning with few evaluations (quick)", about="Top-two selection, "
                         "bisection and ES.", command="python bench/select.py --quick", headline=lambda d, _: (
                             f"top-two selection {d['tci_samples_vs_uniform']:.2f}x uniform's samples, correct "
                             f"{d['tci_correct_rate']:.2f}")),
}


def fallback_spec(name: str, data: dict, root: Path) -> Spec:
    """A JSON with no spec still gets a page: the bench whose name it starts with, its figures as recorded."""
    stems = sorted((p.stem for p in (root / "bench").glob("*.py") if not p.stem.startswith("report")), key=len)
    stem = next((s for s in reversed(stems) if name.startswith(s)), name)
    quick = data.get("quick") or (data.get("config") or {}).get("quick")
    return Spec(title=name, about=f"Recorded by bench/{stem}.py.",
                command=f"python bench/{stem}.py" + (" --quick" if quick else "") + "   # see the settings below")
