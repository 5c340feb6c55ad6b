"""Run a task on an engine: prompts -> generations -> scores -> summary, per-sample JSONL and report.

``run_eval`` is the one entry point (the CLI, the benchmarks and the demo call
it). Every sample's prompt is rendered with the engine's chat template, the
prompts go to the engine longest first (in one call, or in ``chunk_size`` calls
when answers are saved; the engine batches), and each output is
scored by the task. With greedy decoding a prompt that occurs more than once is
generated once and its answer copied (IHEval repeats ~5% of its prompts across
settings). With ``n > 1`` samples per prompt the per-sample score is
the mean over samples and ``pass@k`` (the unbiased estimator of Chen et al.
2021) is reported for the primary metric.

Long runs are resumable: with an ``output_dir``, answers are saved to
``<task>.partial.jsonl`` after every ``chunk_size`` prompts (longest first), and a
rerun with the same folder and settings generates only the prompts not yet
answered there (a row is reused only if its prompt, model and generation settings
match). The checkpoint is removed once ``<task>.jsonl`` is written.
"""

from __future__ import annotations

import hashlib
import json
import time
from math import comb
from pathlib import Path

from llmkit.evals.tasks import get_task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k draws (without replacement) from n samples with c correct is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _file_stem(label: str) -> str:
    return label.replace(":", "_").replace("/", "_")


def _row_key(prompt: str, model: str, params, n: int) -> str:
    """What must match for a saved answer to be reused: the prompt, the model and the generation settings."""
    settings = json.dumps([model, params.max_new_tokens, params.temperature, params.top_p, list(params.stop),
                           params.seed, n])
    return hashlib.sha256((settings + "\x00" + prompt).encode()).hexdigest()


def _load_checkpoint(path: Path) -> dict[str, dict]:
    saved: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interruption: its prompts are generated again
            saved[rec["key"]] = rec
    return saved


def _jsonable(x):
    return x if isinstance(x, (str, int, float, bool, type(None), list, dict)) else str(x)


def run_eval(task, engine=None, *, data=None, limit: int | None = None, num_fewshot: int = 0,
             max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             n: int = 1, seed: int | None = 0, score_gold: bool = False, output_dir=None,
             model: str | None = None, engine_name: str = "hf", progress: bool = True,
             chunk_size: int = 256) -> dict:
    """Evaluate one task; return its summary dict (``accuracy`` = the task's primary metric).

    ``task``: a name (``"gsm8k"``, ``"math500"``, ``"iheval"``, ``"iheval:safety/user-prompt-hijack"``)
    or a Task object. ``engine``: an ``llmkit.engines`` Engine; if None one is made from
    ``engine_name``/``model`` (not needed with ``score_gold``, which scores the reference
    solutions instead of generations). ``output_dir``: if given, writes ``<task>.jsonl``
    (one row per sample) there and returns the path in the summary; answers are
    checkpointed there every ``chunk_size`` prompts and reused by a rerun (module docstring).
    """
    from llmkit.generation import GenerationParams

    task_obj = get_task(task) if isinstance(task, str) else task
    label = task if isinstance(task, str) else task_obj.name
    samples = task_obj.load(data, limit)
    owns_engine = False
    if engine is None and not score_gold:
        from llmkit.engines import get_engine

        engine = get_engine(engine_name, model)
        owns_engine = True
    params = GenerationParams(max_new_tokens=max_new_tokens or task_obj.max_new_tokens,
                              temperature=temperature, top_p=top_p, stop=list(task_obj.stop), seed=seed)
    t0 = time.perf_counter()
    gen_s = 0.0
    gen_tokens = 0
    try:
        if score_gold:
            prompts = [None] * len(samples)
            outputs = [[task_obj.gold_output(s)] for s in samples]
        else:
            prompts = [task_obj.render(engine, s, num_fewshot) for s in samples]
            model_id = str(getattr(engine, "model_name", model))
            keys = [_row_key(p, model_id, params, n) for p in prompts]
            ckpt = Path(output_dir) / f"{_file_stem(label)}.partial.jsonl" if output_dir is not None else None
            saved = _load_checkpoint(ckpt) if ckpt is not None else {}
            outputs = [saved[k]["outputs"] if k in saved else None for k in keys]
            reused = sum(o is not None for o in outputs)
            if reused and progress:
                print(f"[{label}] reusing {reused} of {len(prompts)} answers saved in {ckpt}", flush=True)
            missing = [i for i in range(len(prompts)) if outputs[i] is None]
            first = {}  # key -> the sample that generates it
            for i in missing:
                # greedy: a repeated prompt (IHEval repeats ~5% across its settings) is answered once
                first.setdefault(keys[i] if temperature == 0 else i, i)
            # longest first: batches of similar length waste less padding (hf), and the slowest
            # prompts start early (vllm); results go back to sample order
            order = sorted(first.values(), key=lambda i: -len(prompts[i]))
            step = max(1, len(order) if ckpt is None else chunk_size)
            if ckpt is not None:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
            for start in range(0, len(order), step):
                chunk = order[start : start + step]
                g0 = time.perf_counter()
                done = engine.generate([prompts[i] for i in chunk], params, n=n, progress=progress)
                gen_s += time.perf_counter() - g0
                lines = []
                for i, cs in zip(chunk, done):
                    outputs[i] = [c.text for c in cs]
                    toks = sum(c.completion_tokens for c in cs)
                    gen_tokens += toks
                    lines.append(json.dumps({"key": keys[i], "outputs": outputs[i], "completion_tokens": toks},
                                            ensure_ascii=False))
                if ckpt is not None:
                    with ckpt.open("a", encoding="utf-8") as f:
                        f.write("\n".join(lines) + "\n")
            for i in missing:
                if outputs[i] is None:
                    outputs[i] = outputs[first[keys[i]]]
    finally:
        if owns_engine:
            engine.close()

    from tqdm.auto import tqdm

    rows, per_sample = [], []
    for s, prompt, outs in tqdm(list(zip(samples, prompts, outputs)), desc=f"score[{label}]",
                                disable=not progress, unit="sample"):
        scores = [task_obj.score(o, s) for o in outs]
        # "_"-prefixed entries are bookkeeping for the task's own aggregation (IHEval), not metrics
        public = [{k: v for k, v in sc.items() if not k.startswith("_")} for sc in scores]
        mean = {m: sum(sc[m] for sc in public if sc.get(m) is not None) / max(1, sum(sc.get(m) is not None
                                                                                     for sc in public))
                for m in public[0]}
        per_sample.append({**mean, **{k: v for k, v in scores[0].items() if k.startswith("_")}})
        row = {"id": s.get("id", s.get("unique_id", s.get("_source"))), "source": s.get("_source"),
               "prompt": prompt, "output": outs[0] if n == 1 else outs,
               "extracted": task_obj.extract(outs[0]), "gold": _jsonable(task_obj.gold(s)),
               "score": mean if n == 1 else {"mean": mean, "per_output": public}}
        rows.append(row)
    metrics = task_obj.aggregate(per_sample)
    primary = metrics.get(task_obj.primary)
    summary = {
        "task": label,
        "primary": task_obj.primary,
        "accuracy": primary,
        "metrics": metrics,
        "n": len(samples),
        "model": "gold" if score_gold else getattr(engine, "model_name", model),
        "engine": "score-gold" if score_gold else getattr(engine, "name", engine_name),
        "num_fewshot": num_fewshot,
        "max_new_tokens": params.max_new_tokens,
        "temperature": temperature,
        "samples_per_prompt": n,
        "wall_s": round(time.perf_counter() - t0, 3),
        "generation_s": round(gen_s, 3),
        "completion_tokens": gen_tokens,
        "tokens_per_s": round(gen_tokens / gen_s, 2) if gen_s > 0 else None,
    }
    if not score_gold and reused:
        summary["reused_answers"] = reused  # wall_s, completion_tokens, tokens_per_s cover this run only
    if n > 1:
        prim = task_obj.primary
        for k in sorted({1, n}):
            vals = [pass_at_k(n, sum((sc.get(prim) or 0) >= 1.0 for sc in r["score"]["per_output"]), k)
                    for r in rows]
            summary[f"pass@{k}"] = sum(vals) / len(vals)
    if hasattr(task_obj, "tables"):
        summary["tables"] = task_obj.tables(metrics)
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{_file_stem(label)}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        summary["samples_file"] = str(path)
        (out / f"{_file_stem(label)}.partial.jsonl").unlink(missing_ok=True)
    return summary


def write_report(summaries: dict[str, dict], output_dir) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``report.md`` for several task summaries; return both paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sj = out / "summary.json"
    sj.write_text(json.dumps(summaries, indent=2, ensure_ascii=False) + "\n")
    lines = ["# Eval report", "", "| task | metric | value | n | model | engine | wall s | tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        for m, v in s["metrics"].items():
            if isinstance(v, (int, float)):
                star = " (primary)" if m == s["primary"] else ""
                lines.append(f"| {name} | {m}{star} | {100 * v:.2f}% | {s['n']} | {s['model']} | {s['engine']} | "
                             f"{s['wall_s']:.1f} | {s['tokens_per_s'] if s['tokens_per_s'] is not None else '-'} |")
    for name, s in summaries.items():
        if s.get("tables"):
            lines += ["", f"## {name}", ""] + s["tables"]
    rp = out / "report.md"
    rp.write_text("\n".join(lines) + "\n")
    return sj, rp
