"""``llmkit tools exec|build|eval``: SMITH's pieces without training.

    llmkit tools exec --code tool.py --function f --args '{"x": 3}' [--timeout 5] [--memory-mb 512]
    llmkit tools build --model smollm2-135m-instruct --task gcd --examples 3 --out runs/pool
    llmkit tools eval --pool runs/pool --user-model smollm2-135m-instruct --tasks heldout

``exec`` prints exactly one JSON object {"ok", "value", "error", "stdout", "timed_out", "wall_s"} and exits 0
whenever the sandbox ran (whatever the code did); bad input to the command itself exits 2 with one line.
``--model``/``--user-model`` take a local model (alias, folder, hub id) or, with ``--base-url``, a model name on
an OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub):
    p = sub.add_parser("tools", help="SMITH tools: run code in the sandbox, build tools with a model, evaluate a "
                       "tool pool", description="Sandboxed tool execution, tool building and tool-use evaluation "
                       "(the pieces of `llmkit train smith`).")
    tsub = p.add_subparsers(dest="tools_command", metavar="ACTION")

    e = tsub.add_parser("exec", help="run one function from a file inside the sandbox; prints one JSON object")
    e.add_argument("--code", required=True, help="Python file defining the function")
    e.add_argument("--function", required=True, help="function name")
    e.add_argument("--args", default="{}", help="JSON object (keyword arguments) or array (positional)")
    e.add_argument("--timeout", type=float, default=5.0, help="wall-clock seconds (default 5)")
    e.add_argument("--memory-mb", type=int, default=512, help="address-space limit in MiB (default 512)")
    e.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="where user namespaces are unavailable, run WITHOUT isolation (rlimits only)")
    e.set_defaults(func=run_exec)

    b = tsub.add_parser("build", help="ask a model to write a tool for a task family, verify it, add it to a pool")
    _model_args(b, "--model", "the tool writer")
    b.add_argument("--task", required=True, help="task family, comma list, 'train', 'heldout' or 'all'")
    b.add_argument("--examples", type=int, default=3, help="K input/output examples shown (default 3)")
    b.add_argument("--out", required=True, help="pool: a folder, or a .sqlite file")
    b.add_argument("--attempts", type=int, default=1, help="replies sampled per family (best one kept)")
    b.add_argument("--checks", type=int, default=8, help="fresh instances the tool is verified on")
    b.add_argument("--min-score", type=float, default=1.0, help="verification accuracy needed to join the pool")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=run_build)

    v = tsub.add_parser("eval", help="held-out accuracy of a (frozen) model calling pooled tools vs no tools")
    _model_args(v, "--user-model", "the model that answers questions")
    v.add_argument("--pool", required=True, help="pool folder or .sqlite file")
    v.add_argument("--tasks", default="heldout", help="'heldout' (default), 'train', 'all' or a comma list")
    v.add_argument("--n", type=int, default=10, help="questions per family")
    v.add_argument("--out", default=None, help="write the JSON report here as well")
    v.set_defaults(func=run_eval)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _model_args(p, flag, what):
    p.add_argument(flag, required=True, dest="model", help=f"{what}: alias, folder or hub id; with --base-url a "
                   "model name on an OpenAI-compatible endpoint")
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint (e.g. http://localhost:8000/v1)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="where user namespaces are unavailable, run tool code WITHOUT isolation")


def run_exec(args) -> int:
    from llmkit.cli import UserError
    from llmkit.tools import sandbox

    path = Path(args.code)
    if not path.is_file():
        raise UserError(f"--code: no such file: {args.code}")
    try:
        call_args = json.loads(args.args)
    except json.JSONDecodeError as e:
        raise UserError(f"--args is not valid JSON: {e}") from None
    if not isinstance(call_args, (dict, list)):
        raise UserError("--args must be a JSON object (keyword arguments) or array (positional arguments)")
    if not args.function.isidentifier():
        raise UserError(f"--function must be a Python identifier, got '{args.function}'")
    if args.timeout <= 0 or args.memory_mb < 16:
        raise UserError("--timeout must be > 0 and --memory-mb >= 16")
    try:
        code = path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"--code: {args.code} is not a UTF-8 text file") from None
    try:
        r = sandbox.run_function(code, args.function, call_args, timeout=args.timeout, memory_mb=args.memory_mb,
                                 unsafe=args.unsafe_no_sandbox)
    except sandbox.SandboxUnavailable as e:
        raise UserError(str(e)) from None
    print(json.dumps(r.to_json()))
    return 0


def _generator(args):
    from llmkit.tools.evaluate import local_generator, openai_generator

    if args.base_url:
        return openai_generator(args.model, args.base_url, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature)
    return local_generator(args.model, max_new_tokens=args.max_new_tokens, temperature=args.temperature)


def _families(which: str):
    from llmkit.cli import UserError
    from llmkit.tools import tasks

    try:
        return tasks.names(which)
    except KeyError as e:
        raise UserError(str(e).strip("'\"")) from None


def _check_sandbox(unsafe: bool):
    from llmkit.cli import UserError
    from llmkit.tools import sandbox

    ok, why = sandbox.check_available()
    if not ok and not unsafe:
        raise UserError(f"{why}. Refusing to run model-written code unconfined; pass --unsafe-no-sandbox to "
                        "run it without isolation at your own risk.")


def run_build(args) -> int:
    from llmkit.tools.evaluate import build_tools
    from llmkit.tools.pool import ToolPool

    fams = _families(args.task)
    _check_sandbox(args.unsafe_no_sandbox)
    pool = ToolPool(args.out)
    report = build_tools(_generator(args), fams, pool, examples=args.examples, attempts=args.attempts,
                         checks=args.checks, min_score=args.min_score, source=args.model, seed=args.seed,
                         unsafe=args.unsafe_no_sandbox)
    for fam, r in report.items():
        print(f"{fam}: schema {r['schema']:.2f} code {r['code']:.2f} outcome {r['outcome']:.2f} "
              f"{'-> added to pool' if r['added'] else '(not added)'}")
    print(f"pool {args.out}: {len(pool)} tool(s)")
    return 0


def run_eval(args) -> int:
    from llmkit.cli import UserError
    from llmkit.tools.evaluate import evaluate
    from llmkit.tools.pool import ToolPool

    fams = _families(args.tasks)
    if not Path(args.pool).exists():
        raise UserError(f"--pool: no such pool: {args.pool}")
    _check_sandbox(args.unsafe_no_sandbox)
    pool = ToolPool(args.pool)
    gen = _generator(args)
    with_tools = evaluate(gen, fams, pool=pool, mode="pool", n=args.n, unsafe=args.unsafe_no_sandbox)
    without = evaluate(gen, fams, mode="none", n=args.n)
    report = {"with_tools": with_tools, "no_tools": without, "model": args.model, "pool": args.pool}
    for fam in fams:
        print(f"{fam}: with tools {with_tools['per_family'][fam]:.3f} "
              f"({'pooled tool' if with_tools['used_tool'][fam] else 'no tool in pool'}), "
              f"without {without['per_family'][fam]:.3f}")
    print(f"macro: with tools {with_tools['macro']:.3f}, without {without['macro']:.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"macro_with_tools": with_tools["macro"], "macro_no_tools": without["macro"]}),
          file=sys.stdout)
    return 0
