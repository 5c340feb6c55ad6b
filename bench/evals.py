"""Eval benchmark: accuracy of the bundled model on GSM8K / MATH-500 and llmkit's eval overhead vs its anchors.

Figures, all from one run on the same prompts (chat template, greedy):

- gsm8k_accuracy / math500_accuracy: ``run_eval`` with the vLLM engine (primary metrics:
  GSM8K lm-eval flexible-extract, MATH last-box + math-verify), plus each run's wall time.
- vllm_vs_raw_ratio: time of vLLM's own ``LLM.generate`` on the GSM8K prompts (generation
  only) over the time of llmkit's whole eval on them (render, generate through the engine,
  score); same ``LLM`` object, so the start-up cost is shared. >= 0.9 means the eval
  machinery costs at most ~10%.
- hf_vs_generate_ratio: time of plain batched ``model.generate`` (left padding, prompts in
  dataset order) over the time of llmkit's eval with the transformers engine at the same
  batch size (the harness sends prompts longest-first, which wastes less padding).

Full run: all 1319 GSM8K test problems (256 new tokens, lm-eval's default ``max_gen_toks``)
and all 500 MATH-500 problems (512 new tokens); the vLLM-vs-raw ratio on the first 128 GSM8K
prompts (raw ``LLM.generate`` and llmkit's eval on exactly those prompts), so the raw anchor
does not double the run; HF comparison on 64 prompts x 128 tokens. On 2 CPU cores the full run
takes about an hour. ``--quick``: 16 + 16 problems x 96 tokens, ratio on all 16, HF on 8 x 32.
Writes bench/results/evals[_quick].json; the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "bench" / "results"


def plain_generate(model, tok, prompts, batch_size, max_new_tokens):
    """The anchor: batched model.generate with left padding, greedy, no llmkit code."""
    import torch

    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None)
            new = out[:, enc["input_ids"].shape[1]:]
            tokens += int((new != pad).sum())
    return tokens


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small slices (a few minutes)")
    ap.add_argument("--n", type=int, default=None, help="problems per task (default: all, or 16 with --quick)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="GSM8K (default 256; 96 with --quick)")
    ap.add_argument("--math-max-new-tokens", type=int, default=None, help="MATH-500 (default 512; 96 with --quick)")
    ap.add_argument("--raw-n", type=int, default=None,
                    help="GSM8K prompts for the vLLM-vs-raw ratio (default 128; all with --quick)")
    ap.add_argument("--hf-prompts", type=int, default=None)
    ap.add_argument("--hf-tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    n = args.n or (16 if args.quick else None)
    mnt = args.max_new_tokens or (96 if args.quick else 256)
    math_mnt = args.math_max_new_tokens or (96 if args.quick else 512)
    raw_n = args.raw_n or (n if args.quick else 128)
    hf_n = args.hf_prompts or (8 if args.quick else 64)
    hf_t = args.hf_tokens or (32 if args.quick else 128)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from llmkit.engines.vllm import VLLMEngine, to_sampling_params
    from llmkit.evals import get_task, run_eval
    from llmkit.generation import GenerationParams

    res: dict = {"quick": args.quick, "max_new_tokens": mnt, "math_max_new_tokens": math_mnt}
    gsm_path, math_path = DATA / "gsm8k" / "test.jsonl", DATA / "math500" / "test.jsonl"

    t0 = time.perf_counter()
    eng = VLLMEngine(None, max_model_len=2048, enforce_eager=True)
    res["vllm_start_s"] = round(time.perf_counter() - t0, 1)
    print(f"vllm engine start: {res['vllm_start_s']} s", flush=True)
    try:
        task = get_task("gsm8k")
        samples = task.load(gsm_path, raw_n)
        prompts = [task.render(eng, s) for s in samples]
        sp = to_sampling_params(GenerationParams(max_new_tokens=mnt))
        eng.llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up, not timed
        t = time.perf_counter()
        raw = eng.llm.generate(prompts, sp, use_tqdm=True)
        raw_s = time.perf_counter() - t
        raw_tokens = sum(len(o.outputs[0].token_ids) for o in raw)
        print(f"raw vLLM LLM.generate: {raw_s:.1f} s, {raw_tokens / raw_s:.1f} tok/s ({len(prompts)} prompts)",
              flush=True)
        r = run_eval("gsm8k", eng, data=gsm_path, limit=raw_n, max_new_tokens=mnt)
        res.update(raw_n=len(prompts), raw_vllm_s=round(raw_s, 2), llmkit_same_prompts_s=r["wall_s"],
                   vllm_vs_raw_ratio=round(raw_s / r["wall_s"], 3))
        print(f"llmkit eval (vllm) on the same {len(prompts)} prompts: {r['wall_s']:.1f} s", flush=True)
        print(f"vllm_vs_raw_ratio: {res['vllm_vs_raw_ratio']:.3f} (target >= 0.9)", flush=True)
        g = r if (n is not None and n <= raw_n) else run_eval("gsm8k", eng, data=gsm_path, limit=n,
                                                                max_new_tokens=mnt)
        res.update(gsm8k_accuracy=g["accuracy"], gsm8k_metrics=g["metrics"], gsm8k_n=g["n"],
                   gsm8k_wall_s=g["wall_s"], gsm8k_tok_per_s=g["tokens_per_s"])
        print(f"gsm8k (vllm, n={g['n']}, {mnt} new tokens): accuracy {100 * g['accuracy']:.2f}% (flexible-extract); "
              f"strict {100 * g['metrics']['strict_match']:.2f}%, math-verify {100 * g['metrics']['math_verify']:.2f}%; "
              f"wall {g['wall_s']:.1f} s, {g['tokens_per_s']} tok/s", flush=True)
        m = run_eval("math500", eng, data=math_path, limit=n, max_new_tokens=math_mnt)
        res.update(math500_accuracy=m["accuracy"], math500_n=m["n"], math500_wall_s=m["wall_s"],
                   math500_boxed=m["metrics"]["boxed"])
        print(f"math500 (vllm, n={m['n']}, {math_mnt} new tokens): accuracy {100 * m['accuracy']:.2f}% (boxed in "
              f"{100 * m['metrics']['boxed']:.1f}%); wall {m['wall_s']:.1f} s", flush=True)
    finally:
        eng.close()

    if not args.skip_hf:
        from llmkit.engines.hf import HFEngine
        from llmkit.models import load

        model, tok = load(None)
        hf = HFEngine(model, tok, batch_size=args.batch_size)
        hf.model_name = "smollm2-135m-instruct"
        task = get_task("gsm8k")
        prompts = [task.render(hf, s) for s in task.load(gsm_path, hf_n)]
        plain_generate(model, tok, prompts[:1], 1, 2)  # warm-up
        t = time.perf_counter()
        plain_tokens = plain_generate(model, tok, prompts, args.batch_size, hf_t)
        plain_s = time.perf_counter() - t
        print(f"plain model.generate batch {args.batch_size}: {plain_s:.1f} s ({plain_tokens} tokens)", flush=True)
        h = run_eval("gsm8k", hf, data=gsm_path, limit=hf_n, max_new_tokens=hf_t)
        res.update(hf_plain_s=round(plain_s, 2), hf_eval_s=h["wall_s"], hf_batch_size=args.batch_size,
                   hf_prompts=hf_n, hf_tokens=hf_t, hf_vs_generate_ratio=round(plain_s / h["wall_s"], 3))
        print(f"llmkit eval hf engine batch {args.batch_size}: {h['wall_s']:.1f} s ({h['completion_tokens']} tokens)")
        print(f"hf_vs_generate_ratio: {res['hf_vs_generate_ratio']:.3f} (target >= 1.0)", flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("evals_quick.json" if args.quick else "evals.json")
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"results: {out}")
    keys = ("vllm_vs_raw_ratio", "hf_vs_generate_ratio", "gsm8k_accuracy", "math500_accuracy", "gsm8k_n",
            "math500_n", "gsm8k_wall_s", "math500_wall_s", "max_new_tokens")
    print(json.dumps({k: res[k] for k in keys if k in res}))
    return res


if __name__ == "__main__":
    main()
