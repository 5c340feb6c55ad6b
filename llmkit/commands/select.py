"""``llmkit select``: which model (or generation setting) is best on a task, with few evaluations."""

from __future__ import annotations

from llmkit.cli_types import open_unit_float, positive_int


def register(sub):
    p = sub.add_parser(
        "select", help="pick the best model/config on a task with adaptive (top-two) sampling",
        description="Evaluate arms (--models A,B,C, or --configs FILE of generation / KV-cache / guard settings) on "
        "task problems drawn adaptively with the beta-EB-TCI top-two rule until a GLR test is sure at level "
        "--delta; prints the winner, each arm's estimate and interval, and evaluations spent vs a full "
        "evaluation. Writes --output (JSON).")
    p.add_argument("--models", default=None, help="comma-separated aliases / folders / HF ids")
    p.add_argument("--configs", default=None,
                   help="JSON or YAML file: a list of {name, model, system_prompt, max_new_tokens, temperature, "
                   "top_p, num_fewshot, seed, kv_cache, kv_cache_options, guard, guard_action, guard_threshold} "
                   "(or a name -> settings mapping). kv_cache: inquant|kivi|outlier-buffer|none (hf engine; "
                   "kv_cache_options: that cache's keyword arguments, e.g. {group_size: 64}); guard: a `llmkit guard "
                   "fit` folder applied to every answer of the arm with guard_action annotate (default: only "
                   "counted) | block (graded as the server's refusal) | correct (the guard's regenerated answer is "
                   "graded); guard_threshold overrides the fitted threshold. One engine per distinct (model, "
                   "kv_cache, kv_cache_options)")
    p.add_argument("--model", default=None, help="model for --configs entries that name none (default: bundled)")
    p.add_argument("--task", default="gsm8k", help="gsm8k (default) or math500")
    p.add_argument("--data", default=None, help="local task file or folder, or a hub dataset id (default: the "
                   "task's hub dataset, openai/gsm8k or HuggingFaceH4/MATH-500)")
    p.add_argument("--limit", type=positive_int, default=None, help="problem pool: first N problems")
    p.add_argument("--delta", type=open_unit_float, default=0.05, help="error probability in (0, 1) (default 0.05)")
    p.add_argument("--beta", type=open_unit_float, default=0.5, help="leader fraction in (0, 1) (default 0.5)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="problems generated together per arm (lookahead; counted as spent)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="select-result.json", help="result JSON path")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from pathlib import Path

    from llmkit.cli import UserError
    from llmkit.selection import Arm, EngineScorer, arms_from_config, select_best

    if bool(args.models) == bool(args.configs):
        raise UserError("give exactly one of --models A,B,... or --configs FILE")
    if args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        arms = [Arm(name=m, model=m, max_new_tokens=args.max_new_tokens) for m in names]
    else:
        path = Path(args.configs)
        if not path.is_file():
            raise UserError(f"--configs: no such file: {path}")
        text = path.read_text()
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            import yaml

            items = yaml.safe_load(text)
        try:
            arms = arms_from_config(items)
        except (ValueError, TypeError) as e:
            raise UserError(f"--configs {path}: {e}") from None
        for a in arms:
            a.model = a.model or args.model
    if len(arms) < 2:
        raise UserError("select needs at least two arms")
    if args.engine == "vllm":
        cached = [a.name for a in arms if a.engine_settings()]
        if cached:
            raise UserError(f"--configs: kv_cache works only with --engine hf (vLLM manages its own KV cache); "
                            f"set in: {', '.join(cached)}")
    from llmkit.evals import get_task

    try:
        task = get_task(args.task)
    except (KeyError, ValueError) as e:
        raise UserError(str(e)) from None
    problems = task.load(args.data, args.limit)

    from tqdm.auto import tqdm

    from llmkit.engines import get_engine

    def factory(model, kv_cache=None, kv_cache_options=None):
        kw = {"batch_size": args.batch_size} if args.engine == "hf" else {"enforce_eager": True}
        if kv_cache is not None:
            from llmkit.serving.kv_cache import cache_factory

            kw["cache_factory"] = cache_factory(kv_cache, **(kv_cache_options or {}))
        return get_engine(args.engine, model, **kw)

    bar = tqdm(desc="select: generations", unit="gen")
    scorer = EngineScorer(arms, problems, task, factory, lookahead=args.batch_size, progress=bar)
    for k, a in enumerate(arms):  # load every guard now: a wrong folder or model fails before any generation
        try:
            scorer.guard_for(k)
        except (ValueError, FileNotFoundError) as e:
            bar.close()
            raise UserError(f"--configs {a.name}: guard {a.guard}: {e}") from None
    try:
        res = select_best(scorer.score, len(arms), len(problems), delta=args.delta, beta=args.beta, seed=args.seed,
                          generated=lambda: len(scorer.cache))
    finally:
        bar.close()
        scorer.close()
    res["arm_names"] = [a.name for a in arms]
    res["arm_settings"] = [{k: v for k, v in a.__dict__.items() if k not in ("name", "extra")} for a in arms]
    res["engines_built"] = len(scorer.engines)
    for k, (a, s) in enumerate(zip(arms, res["arms"])):
        if a.guard is not None:
            s["guard_flagged"] = scorer.guard_flagged[k]
    res["task"], res["data"] = args.task, args.data or task.hub_id
    w = res["winner"]
    print(f"winner: {arms[w].name}" + ("" if res["stopped"] else " (not separated at this delta: pool exhausted)"))
    for a, s in zip(arms, res["arms"]):
        lo, hi = s["interval"] or (float("nan"), float("nan"))
        est = float("nan") if s["estimate"] is None else s["estimate"]
        print(f"  {a.name}: {est:.3f} [{lo:.3f}, {hi:.3f}] pulls {s['pulls']}, problems {s['problems_scored']}"
              + (f", guard flagged {s['guard_flagged']} ({a.guard_action})" if "guard_flagged" in s else ""))
    print(f"evaluations: {res['evaluations']} of {res['full_evaluations']} for a full evaluation "
          f"(ratio {res['evals_vs_full']:.3f})")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(res, indent=2))
    print(f"result: {args.output}")
    return 0
