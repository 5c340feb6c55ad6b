"""``make demo``: the main job on the bundled default model, step by step.

1. chat: one answer from the bundled model;
2. GSM8K: a 20-problem check with lm-eval's strict/flexible filters and math-verify;
3. KV quantization: one 3-shot GSM8K prompt generated with the InQuant 4-bit KV cache
   next to the default cache (bytes held, same answer or not);
4. guarded serving: an AEO guard fitted on the model's own answers to prompts that obey
   their system prompt, then the OpenAI-compatible server (InQuant KV cache + guard)
   answering two chat requests over HTTP, one of them an injection, each annotated with
   the guard's verdict;
5. a short recipe run: 4 HALO SFT steps on GSM8K (the ``llmkit train halo`` CLI).

Everything it reads ships with the package, so it needs neither the network nor a data
folder: the GSM8K problems are the sample in ``llmkit/data/gsm8k`` (MIT), and the guard's
prompts are the GSM8K secret-word injection set that ``llmkit.serving.guard.injection``
builds from them. ``--iheval DIR`` fits and probes the guard on IHEval's
``safety/user-prompt-hijack`` instead, when a copy of the benchmark is at hand.

Each step prints what it does and what it got; results go to ``runs/demo/``
(``demo.json`` and each step's own files). Run with ``python -m llmkit.demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from llmkit.data import GSM8K_SAMPLE

GUARD_TASK = "safety/user-prompt-hijack"


def say(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


def step_chat(engine, max_new_tokens: int = 64) -> dict:
    from llmkit.generation import GenerationParams

    say("1. chat: one greedy answer")
    q = "Explain in one sentence why the sky is blue."
    out = engine.generate([engine.chat_prompt([{"role": "user", "content": q}])],
                          GenerationParams(max_new_tokens=max_new_tokens))[0][0]
    print(f"Q: {q}\nA: {out.text.strip()}")
    return {"question": q, "answer": out.text}


def step_gsm8k(engine, out_dir: Path, limit: int, max_new_tokens: int = 256) -> dict:
    from llmkit.evals import run_eval

    say(f"2. GSM8K check: {limit} test problems, zero-shot, greedy, transformers engine")
    summary = run_eval("gsm8k", engine, data=str(GSM8K_SAMPLE), limit=limit, max_new_tokens=max_new_tokens,
                       output_dir=out_dir)
    metrics = summary.get("metrics", {})
    print("GSM8K accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
          + f" (n={summary.get('n', limit)}); per-problem rows in {out_dir / 'gsm8k.jsonl'}")
    return summary


def step_kv(model, tok, max_new_tokens: int = 48) -> dict:
    import torch

    from llmkit.evals.tasks import get_task
    from llmkit.generation import chat_prompt
    from llmkit.serving.kv_cache import InQuantCache

    say("3. KV quantization: a 3-shot GSM8K prompt with the InQuant 4-bit KV cache vs the default cache")
    task = get_task("gsm8k")
    sample = task.load(str(GSM8K_SAMPLE), 1)[0]
    prompt = chat_prompt(tok, task.build_prompt(sample, num_fewshot=3))
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    n_prompt = enc.input_ids.shape[1]
    with torch.inference_mode():
        plain = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        cache = InQuantCache(model.config)
        quant = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, past_key_values=cache)
    held, bf16 = cache.nbytes(), cache.bf16_nbytes()
    same = torch.equal(plain, quant)
    n = min(plain.shape[1], quant.shape[1])
    diverge = next((i - n_prompt for i in range(n_prompt, n) if plain[0, i] != quant[0, i]), n - n_prompt)
    print(f"prompt {n_prompt} tokens + {max_new_tokens} generated; KV cache held {held['total'] / 2**20:.2f} MiB "
          f"(4-bit groups of 128 tokens + the newest tokens in full precision) vs {bf16 / 2**20:.2f} MiB "
          f"in bf16: {bf16 / held['total']:.2f}x smaller")
    texts = [tok.decode(g[0, n_prompt:], skip_special_tokens=True).strip() for g in (plain, quant)]
    if same:
        print(f"greedy answer identical with both caches: {texts[0][:120]!r}")
    else:
        print(f"greedy answers agree on the first {diverge} of {max_new_tokens} tokens, then differ (4-bit keys/values shift "
              f"near-tied logits; bench/kv_cache.py measures perplexity and GSM8K accuracy):\n"
              f"   default: {texts[0][:120]!r}\n   inquant: {texts[1][:120]!r}")
    return {"prompt_tokens": n_prompt, "kv_bytes": held, "bf16_bytes": bf16, "same_answer": same,
            "tokens_before_divergence": diverge, "answers": texts}


def guard_cases(iheval_root: str | None) -> tuple[str, list[dict], list[dict]]:
    """(what they are, aligned samples, conflict samples); each sample has ``id``, ``setting``, ``messages``."""
    if iheval_root is None:
        from llmkit.serving.guard import injection

        samples = injection.build(injection.gsm8k_questions(GSM8K_SAMPLE / "test.jsonl"))
        what = "GSM8K secret-word injection set (built by llmkit.serving.guard.injection)"
    else:
        from llmkit.evals import iheval

        samples = [{**s, "messages": iheval.build_messages(s)}
                   for s in iheval.load(iheval_root, tasks=[GUARD_TASK], settings=["aligned", "conflict"])
                   if s["id"] not in iheval.INSTRUCTION_IDS]
        what = f"IHEval {GUARD_TASK}"
    return (what, [s for s in samples if s["setting"] == "aligned"],
            [s for s in samples if s["setting"] == "conflict"])


def step_guarded_serving(engine, model_name: str, out_dir: Path, n_fit: int, cases,
                         max_new_tokens: int = 48) -> dict:
    import httpx

    from llmkit.engines.hf import HFEngine
    from llmkit.generation import GenerationParams
    from llmkit.serving.guard import Guard
    from llmkit.serving.kv_cache import cache_factory
    from llmkit.serving.server import BackgroundServer, ServerConfig, build_app

    what, aligned, conflict = cases
    say(f"4. guarded serving: fit an AEO guard on the model's answers to {n_fit} aligned prompts of the {what}, "
        "then serve with it")
    fit, (probe_ok, probe_bad) = aligned[:n_fit], (aligned[n_fit], conflict[n_fit])
    msgs = [s["messages"] for s in fit]
    t0 = time.time()
    outs = engine.generate([engine.chat_prompt(m) for m in msgs], GenerationParams(max_new_tokens=max_new_tokens))
    convs = [[*m, {"role": "assistant", "content": o[0].text}] for m, o in zip(msgs, outs)]
    guard = Guard.fit(engine.model, engine.tokenizer, convs, model_name=model_name, holdout=0.3)
    guard_dir = guard.save(out_dir / "guard")
    print(f"guard fitted in {time.time() - t0:.0f} s on layers {guard.layers}: threshold {guard.threshold:.3f}, "
          f"saved to {guard_dir} (serve it with `llmkit serve --guard {guard_dir}`)")

    served = HFEngine(engine.model, engine.tokenizer, cache_factory=cache_factory("inquant"))
    served.model_name = model_name
    app = build_app(served, ServerConfig(model_name=model_name, guard=guard, guard_action="annotate"))
    results = []
    with BackgroundServer(app) as srv:
        print(f"server up at {srv.url}/v1 (KV cache: inquant, guard: annotate)")
        for label, s in (("aligned", probe_ok), ("conflict (injected instruction)", probe_bad)):
            body = {"model": model_name, "messages": s["messages"], "max_tokens": max_new_tokens, "temperature": 0}
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            v = choice["guard"]
            print(f"POST /v1/chat/completions [{label}]: {choice['message']['content'].strip()[:100]!r}\n"
                  f"   guard score {v['score']:.3f} (threshold {guard.threshold:.3f}) -> "
                  f"{'FLAGGED' if v['flagged'] else 'passed'}")
            row = {"setting": s["setting"], "id": s["id"], "answer": choice["message"]["content"], "guard": v}
            if "canary" in s:  # the injection set knows when the injection won: the secret word was said
                from llmkit.serving.guard.injection import violates

                row["leaked_secret"] = violates(s, row["answer"])
                print(f"   secret word {s['canary']!r} {'LEAKED' if row['leaked_secret'] else 'kept'}")
            results.append(row)
    print("(a guard fitted on a handful of answers is a demonstration; bench/guard.py measures detection)")
    return {"guard_dir": str(guard_dir), "cases": what, "requests": results}


def step_recipe(out_dir: Path, steps: int, model_name: str) -> dict:
    say(f"5. recipe: {steps} HALO SFT steps on GSM8K (homotopy unfreezing, output layers first)")
    # the settings of recipes/configs/halo/smollm2_gsm8k_sft.yaml, given as flags so that the step also runs
    # from an installed package; the packaged sample's 8 train problems are the training data, and the eval set
    # is as large as the training data used (8 test problems from the default 4 steps on). The recipe evaluates
    # after training, so an eval at the last step would only compute the same loss twice.
    argv = ["train", "halo", "--model_name_or_path", model_name,
           "--dataset_name", str(GSM8K_SAMPLE / "train.jsonl"), "--eval_data", str(GSM8K_SAMPLE / "test.jsonl"),
           "--halo_method", "halo", "--halo_homotopy_fraction", "0.5", "--halo_ramp_width", "0.25",
           "--learning_rate", "1e-4", "--lr_scheduler_type", "constant", "--weight_decay", "0.0",
           "--max_steps", str(steps), "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "8",
           "--gradient_accumulation_steps", "1", "--max_length", "192", "--max_train_samples", str(2 * steps),
           "--max_eval_samples", str(min(8, 2 * steps)), "--eval_strategy", "no",
           "--save_strategy", "steps", "--save_steps", str(steps), "--save_total_limit", "1",
           "--logging_steps", "1", "--warmup_steps", "0", "--report_to", "none", "--use_cpu", "true",
           "--bf16", "false", "--seed", "0", "--output_dir", str(out_dir / "halo")]
    print("$ llmkit " + " ".join(argv), flush=True)
    # the command above, run in this process: a new interpreter would import torch and transformers again
    from llmkit.cli import main as llmkit_main

    rc = llmkit_main(argv)
    if rc:
        raise SystemExit(f"llmkit {' '.join(argv[:2])} exited with {rc}")
    res = json.loads((out_dir / "halo" / "halo_results.json").read_text())
    print(f"HALO: {res['global_step']} steps, train loss {res['train_loss']:.3f}, eval loss {res['eval_loss']:.3f}; "
          f"model and loss curve in {out_dir / 'halo'}")
    return res


def main(argv: list[str] | None = None) -> int:
    from llmkit.cli_types import positive_int

    ap = argparse.ArgumentParser(prog="python -m llmkit.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled smollm2-135m-instruct")
    ap.add_argument("--limit", type=int, default=20, help="GSM8K problems of the packaged sample (default 20 of 40)")
    ap.add_argument("--guard-fit", type=int, default=16, help="answers to fit the guard on (default 16)")
    ap.add_argument("--iheval", default=None, metavar="DIR",
                    help="IHEval's benchmark/ folder: fit and probe the guard on it instead of the packaged "
                    "GSM8K injection set")
    ap.add_argument("--train-steps", type=int, default=4, help="HALO steps (default 4; 0 skips the recipe step)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                    help="at most N generated tokens for the chat answer (default 64), the GSM8K answers (256) "
                    "and the guard's and the server's answers (48); the KV cache step always generates 48, "
                    "since the bytes its cache holds depend on them")
    ap.add_argument("--output", default=str(Path("runs") / "demo"), help="results folder (default runs/demo)")
    args = ap.parse_args(argv)
    from llmkit.cli import UserError

    try:
        cases = guard_cases(args.iheval)
    except UserError as e:
        ap.error(f"--iheval {args.iheval}: {e}")
    n_cases = min(len(cases[1]), len(cases[2]))
    if not 0 < args.guard_fit < n_cases:
        ap.error(f"--guard-fit {args.guard_fit}: between 1 and {n_cases - 1} (the {cases[0]} has {n_cases} "
                 "prompts per setting, and one of each is kept for the two requests)")

    def length(default: int) -> int:
        return default if args.max_new_tokens is None else min(default, args.max_new_tokens)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from llmkit.engines.hf import HFEngine
    from llmkit.models import DEFAULT_MODEL, materialize_alias

    model_name = args.model or DEFAULT_MODEL
    if model_name == DEFAULT_MODEL:
        materialize_alias(DEFAULT_MODEL, verbose=True)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    say(f"0. loading {model_name}")
    engine = HFEngine(model_name)
    print(f"loaded in {time.time() - t0:.1f} s: {engine.model.num_parameters() / 1e6:.0f}M parameters")
    results = {"model": model_name, "chat": step_chat(engine, length(64))}
    results["gsm8k"] = step_gsm8k(engine, out_dir, args.limit, length(256))
    # not capped: with fewer new tokens the 4-bit cache's last 128-token group is not full and it saves less
    results["kv_cache"] = step_kv(engine.model, engine.tokenizer)
    results["guarded_serving"] = step_guarded_serving(engine, model_name, out_dir, args.guard_fit, cases,
                                                      length(48))
    if args.train_steps > 0:
        results["recipe"] = step_recipe(out_dir, args.train_steps, model_name)
    results["wall_s"] = time.time() - t0
    (out_dir / "demo.json").write_text(json.dumps(results, indent=2, default=str))
    say(f"done in {results['wall_s']:.0f} s; results in {out_dir / 'demo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
