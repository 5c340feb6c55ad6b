"""``llmkit tune``: tune one scalar (noisy 1-D localization), several (batched BO) or a sphere direction (ES)."""

from __future__ import annotations

from llmkit.cli_types import open_unit_float, positive_float, positive_int

BUDGET_DEFAULT = 40  # evaluations for bo / es when --budget is not given (1-D: no cap then)


def register(sub):
    p = sub.add_parser(
        "tune", help="tune parameters of an objective with few evaluations (1-D search, batched BO, sphere ES)",
        description="Minimize OBJECTIVE (module:function or file.py:function, called with the parameters as "
        "keyword arguments, returning a float; --maximize negates). One --param: noisy convex 1-D localization "
        "(--eps, --delta, --sigma); several: GP batched Thompson sampling (--budget, --batch-size); --sphere N: "
        "one direction on the unit sphere in R^N with the Riemannian (1+1)-ES. Every evaluation goes to "
        "OUT/evals.jsonl; rerunning with the same settings resumes.")
    p.add_argument("--param", action="append", required=True, help="parameter name (repeat for several)")
    p.add_argument("--range", action="append", default=[], help="lo,hi for each --param, in order")
    p.add_argument("--sphere", type=positive_int, default=None, help="the single --param is a unit vector in R^N")
    p.add_argument("--objective", required=True, help="module:function or path/file.py:function")
    p.add_argument("--maximize", action="store_true")
    p.add_argument("--method", choices=["auto", "bisection", "bo", "es"], default="auto")
    p.add_argument("--eps", type=positive_float, default=None, help="1-D: precision (default 1%% of the range)")
    p.add_argument("--delta", type=open_unit_float, default=0.1, help="1-D: error probability in (0, 1) (default 0.1)")
    p.add_argument("--sigma", type=positive_float, default=1.0, help="1-D: noise scale of the objective")
    p.add_argument("--budget", type=positive_int, default=None,
                   help=f"evaluations for bo / es (default {BUDGET_DEFAULT}); 1-D: a cap on evaluations "
                   "(default: none, the search runs to its guarantee)")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="tune-run", help="folder for evals.jsonl and result.json")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from pathlib import Path

    import numpy as np
    from tqdm.auto import tqdm

    from llmkit.cli import UserError
    from llmkit.tuning import EvalLog, load_objective

    try:
        obj = load_objective(args.objective)
    except ValueError as e:
        raise UserError(str(e)) from None
    sign = -1.0 if args.maximize else 1.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = EvalLog(out / "evals.jsonl")
    bar = tqdm(desc="tune: evaluations", unit="eval")

    def call(params):
        bar.update(1)
        return sign * log(obj, params)

    names = args.param
    method = args.method
    if args.sphere:
        if len(names) != 1:
            raise UserError("--sphere takes exactly one --param")
        method = "es" if method == "auto" else method
        if method != "es":
            raise UserError(f"--sphere is tuned with --method es (auto), not {method}")
    else:
        if len(args.range) != len(names):
            raise UserError(f"give one --range lo,hi per --param ({len(names)} params, {len(args.range)} ranges)")
        bounds = []
        for r in args.range:
            try:
                lo, hi = (float(v) for v in r.split(","))
            except ValueError:
                raise UserError(f"--range '{r}' is not lo,hi") from None
            if not hi > lo:
                raise UserError(f"--range '{r}': need lo < hi")
            bounds.append((lo, hi))
        method = ("bisection" if len(names) == 1 else "bo") if method == "auto" else method
    # bo / es need a budget (default BUDGET_DEFAULT); bisection treats --budget as an optional cap
    budget = args.budget if args.budget is not None else BUDGET_DEFAULT
    try:
        if method == "es":
            from llmkit.optim.es import RiemannianOnePlusOneES

            if not args.sphere:
                raise UserError("--method es needs --sphere N")
            x0 = np.random.default_rng(args.seed).standard_normal(args.sphere)
            x0 /= np.linalg.norm(x0)
            es = RiemannianOnePlusOneES("sphere", 0.3 / np.sqrt(args.sphere), seed=args.seed)
            x, fx, _ = es.minimize(lambda v: call({names[0]: v}), x0, budget)
            best = {names[0]: np.asarray(x).tolist()}
        elif method == "bisection":
            if len(names) != 1:
                raise UserError("--method bisection tunes one --param")
            from llmkit.optim.bandits import localize_minimizer

            lo, hi = bounds[0]
            eps = args.eps or 0.01 * (hi - lo)
            x, _ = localize_minimizer(lambda v: call({names[0]: v}), lo, hi, eps, args.delta,
                                      max_evals=args.budget, sigma=args.sigma)
            best = {names[0]: float(x)}
            fx = None
        else:
            from llmkit.optim.bo import BatchedThompsonSampling, run_ask_tell

            opt = BatchedThompsonSampling(bounds, args.batch_size, seed=args.seed)
            x, fx, _ = run_ask_tell(opt, lambda p: call(dict(zip(names, p))), budget)
            best = dict(zip(names, x))
    finally:
        bar.close()
    res = {"method": method, "best": best, "value": None if fx is None else sign * fx, "evaluations": log.i,
           "budget": budget if method != "bisection" else args.budget, "replayed": log.replayed,
           "objective": args.objective, "maximize": args.maximize}
    (out / "result.json").write_text(json.dumps(res, indent=2))
    print(f"best ({method}): " + ", ".join(f"{k}={v if not isinstance(v, list) else '[...]'}" for k, v in best.items())
          + ("" if fx is None else f"; objective {sign * fx:.6g}"))
    print(f"evaluations: {log.i} ({log.replayed} replayed from {out / 'evals.jsonl'}); result: {out / 'result.json'}")
    return 0
