"""The GPU-only measurements behind ``bench/gpu.py``, sized to one prepared run of ~8 minutes on one H100.

Each measurement compares llmkit with its anchor in the same run:

- ``hawkeye_kernels``: the verifier's good fixture kernels and the project's own kernels (InQuant
  quantize/dequantize, ZO perturbation) timed natively against eager PyTorch and ``torch.compile`` of
  their references: CUDA events, warm-up, median, L2 flushed before every call
  (``llmkit.kernels.workbench.timing`` through ``verify``), on the GPU's own architecture.
- ``inquant_decode``: decode tokens/s and peak memory of the hf engine at long contexts with the
  InQuant cache (its Triton kernels) vs transformers' dynamic cache in bf16, both through
  ``model.generate`` (the same loop; the engine's own greedy loop runs only without a custom cache);
  decode rate = (tokens - 1 per row) / (time of the full generation - time of a 1-token generation).
  Capacity: sequences of each context length that fit the GPU's free memory, from the bytes per
  token each cache holds (``llmkit.experiments.kv_cache``).
- ``served_throughput``: ``llmkit serve`` with the hf engine (bf16, CUDA) and with the vLLM engine,
  each driven by vLLM's own benchmark client (``vllm.benchmarks.serve``, random prompts, fixed
  input/output lengths, EOS ignored); the hf/vLLM ratio of output tokens/s.
- ``lqzo_int2``: LQZO vs QZO on the INT2-quantized bundled model at GPU step counts (the run the CPU
  could not afford), learning rate chosen per method on validation, paired over seeds on test
  (``llmkit.experiments.lqzo``, the same protocol as ``bench/lqzo.py``).

:func:`plan` sizes every measurement to a budget; :func:`run` takes them in order, skips what no
longer fits, records an error instead of losing the run, and saves after each one. Without a GPU
:func:`dry_run` exercises the same plumbing on CPU with the tiny model and names what a GPU run takes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

MEASUREMENTS = ("hawkeye_kernels", "inquant_decode", "served_throughput", "lqzo_int2")
MODEL = "smollm2-135m-instruct"

# full-size settings and their estimated seconds on one H100 (first run, compile caches cold)
FULL = {
    # each kernel: a fresh verifier process, Triton compiles, torch.compile of the reference (~25 s)
    "hawkeye_kernels": {"est_s": 125, "kernels": 5, "trials": 1},
    "inquant_decode": {"est_s": 65, "contexts": [2048, 4096, 8000], "batch": 8, "new_tokens": 128},
    "served_throughput": {"est_s": 130, "num_prompts": 256, "input_len": 512, "output_len": 128,
                          "max_concurrency": 64},
    "lqzo_int2": {"est_s": 160, "steps": 600, "lrs": [2.5e-4, 5e-4], "seeds": 3, "batch": 8, "max_length": 256,
                  "n_train": 2000, "n_val": 32, "n_test": 64, "n_acc": 200},
}
# what each size shrinks to at most (below this the figure means nothing)
FLOORS = {"steps": 50, "num_prompts": 32, "new_tokens": 32, "kernels": 2, "seeds": 2, "n_train": 200}


def plan(budget_s: float = 480.0, quick: bool = False) -> dict:
    """Settings per measurement scaled so their estimates sum to about ``budget_s`` (``quick``: a quarter)."""
    if budget_s <= 0:
        raise ValueError(f"--budget-s must be positive, got {budget_s}")
    total = sum(m["est_s"] for m in FULL.values())
    f = min(1.0, budget_s / total) * (0.25 if quick else 1.0)
    out = {}
    for name, full in FULL.items():
        p = {}
        for k, v in full.items():
            if k in FLOORS and isinstance(v, int):
                p[k] = max(FLOORS[k], min(v, round(v * f)))
            else:
                p[k] = v
        if name == "inquant_decode" and f < 0.5:
            p["contexts"] = full["contexts"][:2]
        if name == "lqzo_int2" and f < 0.5:
            p["lrs"] = full["lrs"][:1]
        p["est_s"] = round(full["est_s"] * max(f, 0.15))
        out[name] = p
    return out


# ----------------------------------------------------------------------------- measurements


def hawkeye_kernels(kernels: int = 5, trials: int = 2, arch: str | None = None, **_) -> dict:
    from llmkit.kernels.workbench import report
    from llmkit.kernels.workbench.compiled import native_arch

    arch = arch or native_arch() or "hopper"
    items = (report.GOOD_CANDIDATES + report.PROJECT_KERNELS)[:kernels]
    res = report.verify_set(items, arch, trials=trials, timeout=600, parallel=1)
    keep = ("correct", "max_abs_err", "speedup", "speedup_vs_compile", "ms_candidate", "ms_eager", "ms_compile",
            "suspicious", "timing_error", "strategies")
    return {"arch": arch, "kernels": {n: {k: r.get(k) for k in keep} for n, r in res.items()}}


def _long_prompts(tok, n: int, length: int) -> list[str]:
    """``n`` distinct texts of about ``length`` tokens (rotations of one numbered passage)."""
    words = " ".join(f"Item {i}: the value of register {i % 97} is {(i * 7919) % 1000}." for i in range(length))
    ids = tok(words, add_special_tokens=False)["input_ids"]
    return [tok.decode(ids[k * 13 : k * 13 + length]) for k in range(n)]


def inquant_decode(model: str = MODEL, contexts=(2048,), batch: int = 8, new_tokens: int = 128,
                   device: str = "cuda", dtype: str = "bfloat16", **_) -> dict:
    import torch
    from transformers import DynamicCache

    from llmkit.engines.hf import HFEngine
    from llmkit.experiments import kv_cache as kve
    from llmkit.generation import GenerationParams
    from llmkit.serving.kv_cache import inquant_serving_factory

    engine = HFEngine(model, dtype=dtype, device=device, batch_size=batch)
    inquant, msg = inquant_serving_factory(engine.model)
    arms = {"bf16": lambda m: DynamicCache(config=m.config), "inquant": inquant}
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(prompts, n):
        sync()
        t0 = time.perf_counter()
        out = engine.generate(prompts, GenerationParams(max_new_tokens=n, ignore_eos=True))
        sync()
        return time.perf_counter() - t0, sum(c[0].completion_tokens for c in out)

    rows = []
    for L in contexts:
        prompts = _long_prompts(engine.tokenizer, batch, L)
        row = {"context": L, "batch": batch}
        for arm, factory in arms.items():
            engine.cache_factory = factory
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t1, _ = timed(prompts, 1)
            tn, toks = timed(prompts, new_tokens)
            row[arm] = {"decode_tok_s": (toks - batch) / max(tn - t1, 1e-9), "total_s": tn, "tokens": toks,
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        row["decode_ratio_inquant_vs_bf16"] = row["inquant"]["decode_tok_s"] / row["bf16"]["decode_tok_s"]
        rows.append(row)
    cfg = engine.model.config
    g = getattr(inquant(engine.model).layers[0], "group_size", 128)
    ids = torch.randint(0, cfg.vocab_size, (1, max(g, 128) * 2), device=engine.model.device)
    held = kve.bytes_per_token(engine.model, lambda: inquant(engine.model), ids)
    bf16 = kve.bf16_bytes_per_token(cfg)
    free = torch.cuda.mem_get_info()[0] if cuda else 8 * 2**30
    cap = {L: {"bf16": kve.capacity(bf16, free, L), "inquant": kve.capacity(held["held"], free, L,
                                                                            held.get("window_bytes", 0.0))}
           for L in contexts}
    return {"model": engine.model_name, "cache": msg, "rows": rows, "bytes_per_token": {"bf16": bf16, **held},
            "capacity_budget_gib": round(free / 2**30, 2), "capacity_sequences": cap}


def bench_serve_args(model: str, tokenizer: str, base_url: str, num_prompts: int, input_len: int, output_len: int,
                     max_concurrency: int, result_dir: str, label: str):
    """The argument namespace of ``vllm bench serve`` for one run against ``base_url`` (parsed by vLLM's parser)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
        "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--max-concurrency",
        str(max_concurrency), "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", result_dir,
        "--result-filename", f"{label}.json", "--label", label, "--disable-tqdm"])


SERVE_KEYS = ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "completed", "duration")


def served_throughput(model: str = MODEL, num_prompts: int = 256, input_len: int = 512, output_len: int = 128,
                      max_concurrency: int = 64, engines=("hf", "vllm"), device: str = "cuda", **_) -> dict:
    """``llmkit serve`` per engine, loaded by ``vllm bench serve``'s client in this process."""
    import tempfile

    from vllm.benchmarks.serve import main as bench_main

    from llmkit.experiments.harness import ServeProcess
    from llmkit.models import resolve

    flags = {"hf": ["--engine", "hf", "--device", device, "--max-batch-size", str(max_concurrency)]
             + (["--dtype", "bfloat16"] if device == "cuda" else ["--threads", "1"]),
             "vllm": ["--engine", "vllm"] + (["--gpu-memory-utilization", "0.6"] if device == "cuda" else
                                             ["--enforce-eager"])}
    out = {"model": model, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
           "max_concurrency": max_concurrency}
    # random token ids may decode to text that re-tokenizes longer (bytes split by the decoder): leave room
    max_len = 2 * input_len + output_len + 64
    with tempfile.TemporaryDirectory(prefix="llmkit-gpu-serve-") as tmp:
        for name in engines:
            with ServeProcess(["--model", model, "--served-model-name", model, "--max-model-len", str(max_len),
                               "--max-concurrency", str(4 * max_concurrency), *flags[name]]) as srv:
                args = bench_serve_args(model, str(resolve(model)), srv.url, num_prompts, input_len, output_len,
                                        max_concurrency, tmp, name)
                r = bench_main(args)
            out[name] = {k: r[k].item() if hasattr(r.get(k), "item") else r.get(k) for k in SERVE_KEYS}  # numpy -> JSON
    if "hf" in out and "vllm" in out:
        out["output_throughput_ratio_hf_vs_vllm"] = out["hf"]["output_throughput"] / out["vllm"]["output_throughput"]
    return out


def lqzo_int2(steps: int = 600, lrs=(2.5e-4,), seeds: int = 3, batch: int = 8, max_length: int = 256,
              n_train: int = 2000, n_val: int = 32, n_test: int = 64, n_acc: int = 200, data_dir=None,
              budget_s: float | None = None, group_size: int = 64, model: str = MODEL, **_) -> dict:
    """LQZO vs QZO at INT2; ``steps`` is cut to what ``budget_s`` allows after timing a few steps."""
    import tempfile

    from llmkit.experiments import lqzo as B
    from llmkit.train.common import completion_loss
    from llmkit.train.lqzo.config import LQZOArguments

    sp = B.bench_splits(n_train, n_val, n_test, n_acc, seed=0, data_dir=data_dir)
    name = model
    model, tok = B.load_model(2, group_size, name=name)
    tmp = Path(tempfile.mkdtemp(prefix="llmkit-gpu-lqzo-"))
    runs_per_method = len(lrs) + seeds - 1
    settings = {m: LQZOArguments(zo_method=m, quant_bits=2, quant_group_size=group_size).resolved()
                for m in ("qzo", "lqzo")}
    if budget_s:  # time a short run of the slower method and fit every run of both methods into the budget
        import copy

        t0 = time.perf_counter()
        B.train_zo(copy.deepcopy(model), tok, sp["train_ds"], settings["lqzo"], 10, lrs[0], batch, max_length,
                   tmp / "probe")
        per_step = (time.perf_counter() - t0) / 10
        fit = int(0.8 * budget_s / (per_step * 2 * runs_per_method))
        steps = max(min(steps, FLOORS["steps"]), min(steps, fit))
        res_probe = {"probe_s_per_step": per_step, "steps_that_fit": fit}
    res = {"model": name, "steps": steps, "lrs": list(lrs), "seeds": list(range(seeds)), "batch": batch,
           **(res_probe if budget_s else {})}
    for m in ("qzo", "lqzo"):
        def train(mm, lr, seed, m=m):
            return [r["loss"] for r in B.train_zo(mm, tok, sp["train_ds"], settings[m], steps, lr, batch, max_length,
                                                  tmp / f"{m}-{lr:g}-{seed}", seed=seed)]

        res[m] = B.tuned_runs(model, list(lrs), list(range(seeds)), train,
                              lambda mm: completion_loss(mm, tok, sp["val_rows"], max_length=max_length, batch_size=8),
                              lambda mm: B.measure(mm, tok, sp["test_rows"], sp["test_acc_rows"], max_length, 8),
                              name=f"{m}_int2")
    res["paired_lqzo_minus_qzo"] = B.paired_seed_diff(res["lqzo"]["runs"], res["qzo"]["runs"])
    return res


FUNCS = {"hawkeye_kernels": hawkeye_kernels, "inquant_decode": inquant_decode,
         "served_throughput": served_throughput, "lqzo_int2": lqzo_int2}


def run(settings: dict, out_path: Path, budget_s: float, model: str = MODEL, data_dir=None, only=None,
        log=print) -> dict:
    """Take the planned measurements in order within ``budget_s``; save ``out_path`` after each."""
    import torch

    t_start = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(0), "budget_s": budget_s, "plan": settings, "results": {}}
    for name in MEASUREMENTS:
        if only and name not in only:
            continue
        left = budget_s - (time.perf_counter() - t_start)
        p = dict(settings[name])
        if left < 0.5 * p["est_s"]:
            res["results"][name] = {"skipped": f"budget: {left:.0f} s left, needs ~{p['est_s']} s"}
            log(f"{name}: skipped ({res['results'][name]['skipped']})")
            continue
        kw = {"model": model} if name != "hawkeye_kernels" else {}
        if name == "lqzo_int2":
            kw = {"data_dir": data_dir, "budget_s": min(left, p["est_s"])}
        t0 = time.perf_counter()
        try:
            res["results"][name] = FUNCS[name](**p, **kw)
        except Exception as e:  # noqa: BLE001 - one failed measurement must not lose the others
            res["results"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res["results"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        log(f"{name}: {summary_line(name, res['results'][name])}")
        save(res, out_path)
        _release()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    save(res, out_path)
    return res


def _release():
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
    tmp.replace(path)


def summary_line(name: str, r: dict) -> str:
    """One printed line per measurement (the figure compared with its anchor)."""
    try:
        return _summary(name, r)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # a partial result: print it rather than crash
        return json.dumps(r, default=str)[:300]


def _summary(name: str, r: dict) -> str:
    if "error" in r or "skipped" in r:
        return r.get("error") or f"skipped: {r['skipped']}"
    if name == "hawkeye_kernels":
        return "; ".join(f"{k}: correct={v['correct']} eager x{v['speedup'] or 0:.2f} compile x"
                         f"{v['speedup_vs_compile'] or 0:.2f}" for k, v in r["kernels"].items())
    if name == "inquant_decode":
        return "; ".join(f"ctx {w['context']}: InQuant/bf16 decode x{w['decode_ratio_inquant_vs_bf16']:.2f}"
                         for w in r["rows"]) + "; capacity " + ", ".join(
            f"{L}: {c['inquant']}/{c['bf16']} seqs" for L, c in r["capacity_sequences"].items())
    if name == "served_throughput":
        return (f"output tok/s hf {r['hf']['output_throughput']:.0f}, vllm {r['vllm']['output_throughput']:.0f} "
                f"(hf/vllm x{r['output_throughput_ratio_hf_vs_vllm']:.2f})")
    if name == "lqzo_int2":
        d = r["paired_lqzo_minus_qzo"]
        return (f"{r['steps']} steps: LQZO - QZO test loss {d['mean']:+.4f} (std {d['std']:.4f}, "
                f"LQZO better on {d['a_better']}/{len(d['seeds'])} seeds)")
    return json.dumps(r)[:200]


def dry_run(settings: dict, workdir: Path, data_dir=None) -> dict:
    """The CPU rehearsal: each measurement's plumbing on the tiny model or without a model; {name: 'ok' | error}."""
    import torch

    from llmkit.kernels.workbench.report import FIXTURES, GOOD_CANDIDATES, PROJECT_KERNELS
    from llmkit.kernels.workbench.timing import speedups
    from llmkit.models import prepare_model_path

    checks = {}

    def step(name, fn):
        try:
            fn()
            checks[name] = "ok"
        except Exception as e:  # noqa: BLE001 - the rehearsal reports every broken piece, not the first
            checks[name] = f"{type(e).__name__}: {e}"[:500]

    def hawkeye():
        for _, ref, cand, _ in (GOOD_CANDIDATES + PROJECT_KERNELS)[: settings["hawkeye_kernels"]["kernels"]]:
            assert (FIXTURES / f"{ref}.py").is_file() and (FIXTURES / f"{cand}.py").is_file(), f"{ref}/{cand} missing"
        t = speedups(torch.relu, torch.relu, (torch.ones(4),))
        assert t["speedup"] is None, "CPU timing should be None (CUDA events only)"

    def decode():
        tiny = prepare_model_path("tiny-llama", workdir)
        r = inquant_decode(tiny, contexts=[200], batch=2, new_tokens=4, device="cpu", dtype="float32")
        assert r["rows"][0]["inquant"]["tokens"] == 8 and r["capacity_sequences"][200]["inquant"] > 0, r

    def serve():
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("vllm not installed: served_throughput needs it")
        # the real path on the tiny model: `llmkit serve` (hf engine, CPU) under vLLM's benchmark client
        r = served_throughput(prepare_model_path("tiny-llama", workdir), num_prompts=4, input_len=32, output_len=8,
                              max_concurrency=2, engines=("hf",), device="cpu")
        assert r["hf"]["completed"] == 4 and r["hf"]["output_throughput"] > 0, r

    def lqzo():
        from llmkit.train.lqzo.config import LQZOArguments

        for m in ("qzo", "lqzo"):
            LQZOArguments(zo_method=m, quant_bits=2, quant_group_size=64).resolved()
        if data_dir is None or not (Path(data_dir) / "train.jsonl").is_file():
            raise FileNotFoundError(f"GSM8K train.jsonl/test.jsonl not found in {data_dir}; pass --gsm8k-dir")
        r = lqzo_int2(steps=2, lrs=[1e-3], seeds=2, batch=2, max_length=1024, n_train=8, n_val=2, n_test=2, n_acc=4,
                      data_dir=data_dir, group_size=32, model=prepare_model_path("tiny-llama", workdir), budget_s=600)
        assert len(r["paired_lqzo_minus_qzo"]["seeds"]) == 2 and r["steps"] == 2 and r["probe_s_per_step"] > 0, r

    for name, fn in (("hawkeye_kernels", hawkeye), ("inquant_decode", decode), ("served_throughput", serve),
                     ("lqzo_int2", lqzo)):
        step(name, fn)
    return checks

