"""``llmkit eval TASK[,TASK...]``: evaluate a model on GSM8K / MATH-500 / IHEval; ``llmkit eval compare DIR...``."""

from __future__ import annotations

from llmkit.cli_types import nonneg_int, positive_int, unit_float


def register(sub):
    p = sub.add_parser(
        "eval", help="evaluate on gsm8k, math500, iheval (or compare saved runs)",
        description="Evaluate a model: TASK is gsm8k, math500, iheval or iheval:<category>/<task>, several "
        "separated by commas. Writes DIR/summary.json, DIR/<task>.jsonl and DIR/report.md. "
        "`llmkit eval compare DIR1 DIR2 ...` prints a table of saved runs and saves a bar chart PNG.")
    p.add_argument("tasks", metavar="TASK[,TASK...]|compare", help="tasks to run, or 'compare'")
    p.add_argument("dirs", nargs="*", metavar="DIR", help="with 'compare': the run folders to compare")
    p.add_argument("--model", default=None, help="alias, local folder or HF id (default: smollm2-135m-instruct)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="generation engine (default hf)")
    p.add_argument("--data", default=None,
                   help="local JSONL/JSON file or folder (IHEval: its benchmark/ folder) or a hub dataset id; with "
                   "several tasks use TASK=PATH,TASK=PATH. Default: the hub dataset (openai/gsm8k, "
                   "HuggingFaceH4/MATH-500; IHEval: $LLMKIT_IHEVAL, else zhihz0535/IHEval). Offline: the GSM8K "
                   "sample shipped in llmkit/data/gsm8k")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="first N samples only (IHEval: first N of each setting file)")
    p.add_argument("--num-fewshot", type=nonneg_int, default=0, help="few-shot examples as earlier chat turns")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the task's own")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=unit_float, default=1.0)
    p.add_argument("--samples", "-n", dest="n", type=positive_int, default=1,
                   help="samples per prompt; >1 reports pass@1 and pass@n (use --temperature > 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=positive_int, default=16, help="hf engine batch size")
    p.add_argument("--max-model-len", type=positive_int, default=4096, help="vllm context length")
    p.add_argument("--enforce-eager", action="store_true", help="vllm without graph capture/compile "
                   "(starts much faster on CPU)")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 for hf, bfloat16 for vllm)")
    p.add_argument("--kv-cache", default=None, metavar="NAME",
                   help="hf engine: a quantized KV cache for generation, e.g. inquant (see `llmkit serve --help`)")
    p.add_argument("--device", default=None,
                   help="hf engine: cpu (default), cuda, cuda:N, mps, or 'auto' (device_map='auto' over the GPUs)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=None,
                   help="vllm engine: GPUs to shard the model over")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vllm engine: fraction of GPU memory vLLM may take (vLLM's default 0.9)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from its folder/hub")
    p.add_argument("--output", default=None, help="output folder (default ./eval-runs/<time>); answers are saved "
                   "there as they come, so rerunning an interrupted command with the same --output generates only "
                   "what is missing; with compare: the PNG path (default ./eval-compare.png)")
    p.add_argument("--chunk-size", type=positive_int, default=256,
                   help="prompts per engine call; answers are saved after each (default 256: an interrupted run "
                   "loses at most one chunk)")
    p.add_argument("--prompt-style", choices=["chat", "lm-eval"], default="chat",
                   help="chat (default): the model's chat template, llmkit's instruction, --num-fewshot shots as "
                   "earlier turns; lm-eval: lm-eval's own gsm8k prompt (5-shot 'Question: ... Answer:' as plain "
                   "text, its few-shot sampler, stop at 'Question:', 256 tokens) so scores compare with lm-eval's")
    p.add_argument("--score-gold", action="store_true",
                   help="score the reference solutions as if they were model outputs (grader self-check)")
    p.set_defaults(func=run)


def _data_map(spec: str | None, tasks: list[str]) -> dict[str, str | None]:
    from llmkit.cli import UserError

    if spec is None:
        return {t: None for t in tasks}
    if "=" not in spec:
        if len(tasks) > 1:
            raise UserError("--data with several tasks needs TASK=PATH pairs, e.g. gsm8k=a.jsonl,math500=b.jsonl")
        return {tasks[0]: spec}
    out = {t: None for t in tasks}
    for item in spec.split(","):
        name, _, path = item.partition("=")
        if name not in out:
            raise UserError(f"--data names task '{name}', which is not among {', '.join(tasks)}")
        out[name] = path
    return out


def _compare(args) -> int:
    from llmkit.cli import UserError
    from llmkit.evals.compare import compare_plot, compare_table, load_runs

    if not args.dirs:
        raise UserError("compare needs at least one run folder")
    runs = load_runs(args.dirs)
    print("\n".join(compare_table(runs)))
    png = compare_plot(runs, args.output or "eval-compare.png")
    print(f"chart: {png}")
    return 0


def run(args) -> int:
    import time
    from pathlib import Path

    from llmkit.cli import UserError

    if args.tasks == "compare":
        return _compare(args)
    if args.dirs:
        raise UserError(f"unexpected arguments: {' '.join(args.dirs)}")
    if args.temperature < 0:
        raise UserError("--temperature must be >= 0")
    from llmkit.evals import get_task, run_eval, write_report

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in tasks:
        get_task(t)  # unknown names fail before any model loads
    if args.prompt_style == "lm-eval" and any(t.lower() != "gsm8k" for t in tasks):
        raise UserError("--prompt-style lm-eval is available for gsm8k (other lm-eval tasks: run lm-eval with "
                        "--model llmkit, see `python -m llmkit.evals.lmeval --help`)")
    data = _data_map(args.data, tasks)
    out = Path(args.output or Path("eval-runs") / time.strftime("%Y%m%d-%H%M%S"))
    engine = None
    if not args.score_gold:
        from llmkit.commands.serve import build_engine

        engine = build_engine(args, **({"batch_size": args.batch_size} if args.engine == "hf" else {}))
    summaries = {}
    try:
        for t in tasks:
            task = t
            num_fewshot = args.num_fewshot
            if args.prompt_style == "lm-eval":
                from llmkit.evals.lmeval import LmEvalGSM8K

                task, num_fewshot = LmEvalGSM8K(), LmEvalGSM8K.default_fewshot
            s = run_eval(task, engine, data=data[t], limit=args.limit, num_fewshot=num_fewshot,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         n=args.n, seed=args.seed, score_gold=args.score_gold, output_dir=out,
                         chunk_size=args.chunk_size)
            s["prompt_style"] = args.prompt_style
            summaries[t] = s
            extra = "".join(f", {k} {100 * s[k]:.2f}%" for k in s if k.startswith("pass@"))
            print(f"{t}: {s['primary']} {100 * s['accuracy']:.2f}% (n={s['n']}){extra}; "
                  + ", ".join(f"{m} {100 * v:.2f}%" for m, v in s["metrics"].items() if ":" not in m))
    finally:
        if engine is not None:
            engine.close()
    sj, rp = write_report(summaries, out)
    from llmkit.evals.lmeval import write_results_json

    lj = write_results_json(summaries, out, {"pretrained": args.model, "engine": args.engine})
    print(f"results: {sj} and {rp}; lm-eval layout: {lj}")
    return 0
