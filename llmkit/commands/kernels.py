"""``llmkit kernels``: the Hawkeye kernel workbench.

- ``llmkit kernels verify --ref REF.py --candidate CAND.py [--arch hopper] [--precision bf16]`` prints one
  JSON object ``{"compiled", "correct", "max_abs_err", "max_rel_err", "strategies", "speedup", "reasons",
  "checks", "sandboxed", "flags", ...}``; exit 0 when the verification ran (whatever it found), 2 for bad input
  or when the sandbox cannot run here (``--unsafe-no-sandbox`` runs the candidate without isolation).
- ``llmkit kernels generate --ref REF.py --arch hopper --endpoint URL --model M [--budget N] --out DIR``: the
  agent loop against an OpenAI-compatible endpoint; saves every candidate, the trajectory and the best kernel.
- ``llmkit kernels strategies [--arch hopper]``: the taxonomy (name, precisions, unit test).
"""

from __future__ import annotations

ARCH_CHOICES = ("ampere", "hopper", "blackwell", "mi350")
UNSAFE_HELP = ("run candidates in a plain subprocess when the bubblewrap sandbox is unavailable (no isolation: "
               "the candidate can read and write your files and reach the network); without it verification refuses")


def register(sub):
    p = sub.add_parser("kernels", help="Hawkeye kernel workbench: verify / generate Triton kernels",
                       description="Verify and generate Triton kernels against a per-architecture strategy "
                       "taxonomy (kernels/taxonomy/<arch>.yaml).")
    ksub = p.add_subparsers(dest="kernels_command", metavar="ACTION")
    v = ksub.add_parser("verify", help="verify a candidate ModelNew against a reference Model (prints JSON)")
    v.add_argument("--ref", required=True, help="reference .py defining Model, get_inputs(), get_init_inputs()")
    v.add_argument("--candidate", required=True, help="candidate .py defining ModelNew and >= 1 @triton.jit kernel")
    v.add_argument("--arch", default="hopper", help=f"target architecture: {', '.join(ARCH_CHOICES)} (default hopper)")
    v.add_argument("--precision", default="bf16", help="fp32, tf32, fp16, bf16, fp8, mxfp8, fp4, mxfp4, nvfp4, int8")
    v.add_argument("--trials", type=int, default=2, help="fresh random inputs per shape (default 2)")
    v.add_argument("--timeout", type=float, default=300.0, help="seconds before the candidate is killed (default 300)")
    v.add_argument("--unsafe-no-sandbox", action="store_true", help=UNSAFE_HELP)
    v.set_defaults(func=run_verify)
    g = ksub.add_parser("generate", help="agent loop: prompt a model, verify candidates, feed failures back")
    g.add_argument("--ref", required=True, help="reference .py (KernelBench convention)")
    g.add_argument("--arch", default="hopper", help=f"target architecture: {', '.join(ARCH_CHOICES)}")
    g.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--model", required=True, help="model name to send to the endpoint")
    g.add_argument("--budget", type=int, default=4, help="candidates in total (default 4)")
    g.add_argument("--candidates", type=int, default=2, help="candidates per refinement round (default 2)")
    g.add_argument("--parallel", type=int, default=2, help="candidates requested/verified at once (default 2)")
    g.add_argument("--precision", default="bf16")
    g.add_argument("--max-tokens", type=int, default=2048)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--max-examples", type=int, default=2, help="strategy tests shown as worked examples")
    g.add_argument("--trials", type=int, default=2)
    g.add_argument("--timeout", type=float, default=300.0, help="verification timeout per candidate (s)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait for one model reply")
    g.add_argument("--out", required=True, help="output folder (candidates/, trajectory.jsonl, best.py, summary.json)")
    g.add_argument("--unsafe-no-sandbox", action="store_true", help=UNSAFE_HELP)
    g.set_defaults(func=run_generate)
    s = ksub.add_parser("strategies", help="list the strategy taxonomy of an architecture")
    s.add_argument("--arch", default=None, help="one architecture (default: all)")
    s.set_defaults(func=run_strategies)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _check_arch(arch):
    from llmkit.cli import UserError

    if arch not in ARCH_CHOICES:
        raise UserError(f"unknown --arch {arch!r}; choose one of {', '.join(ARCH_CHOICES)}")


def _check_sandbox(unsafe: bool):
    """Refuse before anything runs when the sandbox cannot (as ``llmkit tools`` does)."""
    from llmkit.cli import UserError
    from llmkit.tools import sandbox

    try:
        sandbox.require(unsafe, what="a candidate kernel")
    except sandbox.SandboxUnavailable as e:
        raise UserError(str(e)) from None


def run_verify(args) -> int:
    import json

    from llmkit.cli import UserError
    from llmkit.kernels.workbench.verify import VerifyInputError, verify

    _check_arch(args.arch)
    _check_sandbox(args.unsafe_no_sandbox)
    try:
        result = verify(args.ref, args.candidate, args.arch, args.precision, trials=args.trials,
                        timeout=args.timeout, unsafe=args.unsafe_no_sandbox)
    except VerifyInputError as e:
        raise UserError(str(e)) from e
    print(json.dumps(result))
    return 0


def run_generate(args) -> int:
    import json
    from pathlib import Path

    from llmkit.cli import UserError
    from llmkit.kernels.workbench.generate import generate
    from llmkit.kernels.workbench.verify import PRECISIONS, VerifyInputError, check_reference_source

    _check_arch(args.arch)
    if not Path(args.ref).is_file():
        raise UserError(f"reference file not found: {args.ref}")
    if args.precision not in PRECISIONS:
        raise UserError(f"unknown --precision {args.precision!r}; known: {', '.join(PRECISIONS)}")
    if args.budget < 1 or args.candidates < 1:
        raise UserError("--budget and --candidates must be >= 1")
    try:
        check_reference_source(Path(args.ref))
    except VerifyInputError as e:
        raise UserError(str(e)) from e
    _check_sandbox(args.unsafe_no_sandbox)
    summary = generate(args.ref, args.arch, args.endpoint, args.model, args.out, budget=args.budget,
                       candidates=args.candidates, parallel=args.parallel, precision=args.precision,
                       temperature=args.temperature, max_tokens=args.max_tokens, max_examples=args.max_examples,
                       verify_timeout=args.timeout, trials=args.trials,
                       request_timeout=args.request_timeout, unsafe=args.unsafe_no_sandbox)
    print(json.dumps({k: summary[k] for k in ("n_candidates", "n_correct", "n_errors", "rounds")}
                     | {"best": summary["best"]["path"] if summary["best"] else None, "out": args.out}))
    return 0


def run_strategies(args) -> int:
    from llmkit.kernels.workbench.taxonomy import load_taxonomy

    archs = [args.arch] if args.arch else list(ARCH_CHOICES)
    for a in archs:
        _check_arch(a)
        tax = load_taxonomy(a)
        print(f"{a}  ({tax.target})")
        for s in tax.strategies:
            print(f"  {s.name:<24} {','.join(s.precisions):<28} {s.test}")
    return 0
