"""lm-evaluation-harness interop: its prompts in ``llmkit eval``, its results layout, and llmkit as an lm-eval model.

* ``LmEvalGSM8K`` (``llmkit eval gsm8k --prompt-style lm-eval``): the prompts come from lm-eval's own
  ``gsm8k`` task object (5-shot ``Question: ... Answer:`` plain-text completion, few-shot examples drawn by
  lm-eval's seeded sampler from the train split, stop at ``Question:``, 256 new tokens), built over the
  local JSONL files instead of the hub, so ``llmkit eval`` and lm-eval score the same prompts. Scoring uses
  llmkit's GSM8K filters, which a test checks against lm-eval's own filter and metric code.
* ``write_results_json``: lm-eval's ``results_<time>.json`` layout (``results`` with ``metric,filter`` keys and
  ``metric_stderr,filter`` standard errors, ``n-shot``, ``n-samples``, ``config``), beside llmkit's summary.
* ``LlmkitLM``: an ``lm_eval.api.model.LM`` registered as ``llmkit``; generation goes through llmkit's
  engines (``engine=hf|vllm``) and serving features (``kv_cache=inquant``, ``guard=DIR``), loglikelihoods
  through the transformers model. lm-eval 0.4.13 has no plugin entry point for models, so the name exists
  once this module is imported: ``python -m llmkit.evals.lmeval run --model llmkit --model_args ...`` (lm-eval's
  own command line with llmkit registered) or ``import llmkit.evals.lmeval`` before
  ``lm_eval.simple_evaluate(model="llmkit", ...)``.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
import time
from pathlib import Path

from llmkit.evals.tasks.gsm8k import GSM8K

# lm-eval's gsm8k.yaml, read through its own TaskManager with the dataset swapped for local files
_TASK_YAML = """include: {include}
task: {name}
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
"""


def lmeval_task(task: str, test_file: str | Path, train_file: str | Path | None = None):
    """lm-eval's task ``task`` (a ConfigurableTask) reading ``test_file`` / ``train_file`` (few-shot pool)."""
    import lm_eval
    from lm_eval.tasks import TaskManager, get_task_dict

    test_file = Path(test_file).resolve()
    train_file = Path(train_file).resolve() if train_file else test_file.parent / "train.jsonl"
    if not train_file.is_file():
        from llmkit.evals.data import DataError

        raise DataError(f"lm-eval's {task} prompt draws few-shot examples from a train split: "
                        f"{train_file} not found")
    include = Path(lm_eval.__file__).parent / "tasks" / task / f"{task}.yaml"
    name = f"{task}_llmkit_local"
    folder = Path(tempfile.mkdtemp(prefix="llmkit-lmeval-"))
    (folder / f"{name}.yaml").write_text(_TASK_YAML.format(include=include, name=name, train=train_file,
                                                           test=test_file))
    # our YAML names lm-eval's by path (include:), so the index of its ~14,000 built-in task YAMLs, which
    # TaskManager parses by default (30-50 s on one core), is never consulted
    return get_task_dict([name], TaskManager(include_path=str(folder), include_defaults=False))[name]


@functools.cache
def lmeval_task_manager():
    """A TaskManager to hand ``lm_eval.simple_evaluate(tasks=[lmeval_task(...)], task_manager=...)``.

    Given none, simple_evaluate indexes every built-in task YAML (30-50 s on one core) even when its tasks are
    task objects, which it passes through without a lookup; this one indexes nothing, once per process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False)


def lmeval_contexts(task, limit: int | None) -> list[tuple[dict, str, dict]]:
    """``(doc, context, generation kwargs)`` per test document, as lm-eval would send them to a model."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED

    # simple_evaluate seeds the few-shot sampler with this before building requests; without it the
    # shots (and so every prompt) differ from what lm-eval sends
    task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    out = []
    for inst in sorted(task.instances, key=lambda i: i.doc_id):
        context, gen_kwargs = inst.args
        out.append((inst.doc, context, dict(gen_kwargs)))
    return out


class LmEvalGSM8K(GSM8K):
    """GSM8K with lm-eval's own prompt: contexts built by lm-eval, sent as plain text (no chat template)."""

    max_new_tokens = 256  # lm-eval's default max_gen_toks
    default_fewshot = 5

    def __init__(self):
        super().__init__()
        self._contexts: dict[str, str] = {}
        self.stop = ("Question:", "</s>", "<|im_end|>")

    def load(self, data=None, limit=None):
        rows = super().load(data, limit)
        if data is None:
            from llmkit.evals.data import DataError

            raise DataError("--prompt-style lm-eval needs local GSM8K files (--data PATH/test.jsonl with "
                            "train.jsonl beside it)")
        p = Path(data)
        test_file = p / "test.jsonl" if p.is_dir() else p
        built = lmeval_contexts(lmeval_task("gsm8k", test_file), limit)
        self._contexts = {doc["question"]: ctx for doc, ctx, _ in built}
        self.stop = tuple(built[0][2].get("until", self.stop)) if built else self.stop
        return rows

    def render(self, engine, sample, num_fewshot: int = 0) -> str:
        # lm-eval's task fixes the shots (5) and their sampler; num_fewshot is not ours to change here
        return self._contexts[sample["question"]]


# ---------------------------------------------------------------------------------------------- results


def _stderr(values: list[float]) -> float:
    """lm-eval's ``mean_stderr``: sample standard deviation / sqrt(n)."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1) / n)


# llmkit metric -> (lm-eval metric, lm-eval filter)
_LMEVAL_NAMES = {"strict_match": ("exact_match", "strict-match"),
                 "flexible_extract": ("exact_match", "flexible-extract")}


def write_results_json(summaries: dict[str, dict], output_dir, model_args: dict | None = None) -> Path:
    """Write ``results_<time>.json`` in lm-eval's layout from llmkit summaries and their per-sample files."""
    results, n_shot, n_samples, versions = {}, {}, {}, {}
    for label, s in summaries.items():
        rows = []
        if s.get("samples_file") and Path(s["samples_file"]).is_file():
            with open(s["samples_file"], encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        entry = {"alias": label}
        for metric, value in s["metrics"].items():
            if ":" in metric or not isinstance(value, (int, float)):
                continue
            name, filt = _LMEVAL_NAMES.get(metric, (metric, "none"))
            per = [float(r["score"][metric]) for r in rows
                   if isinstance(r.get("score"), dict) and isinstance(r["score"].get(metric), (int, float))]
            entry[f"{name},{filt}"] = value
            entry[f"{name}_stderr,{filt}"] = _stderr(per) if per else float("nan")
        results[label] = entry
        n_shot[label] = s.get("num_fewshot", 0)
        n_samples[label] = {"original": s["n"], "effective": s["n"]}
        versions[label] = s.get("prompt_style", "llmkit")
    doc = {"results": results, "group_subtasks": {k: [] for k in results}, "versions": versions,
           "n-shot": n_shot, "n-samples": n_samples,
           "config": {"model": "llmkit", "model_args": model_args or {},
                      "gen_kwargs": {k: next(iter(summaries.values())).get(k) for k in ("max_new_tokens", "temperature")}
                      if summaries else {}},
           "date": time.time()}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"results_{time.strftime('%Y-%m-%dT%H-%M-%S')}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- lm-eval model


def _register():
    # lm-eval fills its registry with the built-in models (local-completions, hf, vllm ...) only when the
    # registry is empty at first lookup; registering ours first would hide them all.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    @register_model("llmkit")
    class LlmkitLM(LM):
        """lm-eval model over llmkit: ``pretrained`` (alias/folder/hub id/adapter), ``engine`` (hf|vllm),
        ``kv_cache`` (default|inquant, hf engine), ``guard`` (a fitted guard folder, hf engine),
        ``batch_size``, ``device`` (hf: cpu|cuda|cuda:N|auto), ``dtype``, ``trust_remote_code``,
        ``max_model_len``, ``tensor_parallel_size``, ``gpu_memory_utilization`` (vllm). An argument it does
        not know is an error naming it (lm-eval's own models drop them silently, so ``device=cuda`` could
        quietly run on the CPU)."""

        def __init__(self, pretrained: str | None = None, engine: str = "hf", kv_cache: str | None = None,
                     guard: str | None = None, batch_size: int | str = 16, max_model_len: int = 4096,
                     dtype: str | None = None, device: str | None = None, trust_remote_code: bool | str = False,
                     tensor_parallel_size: int | None = None, gpu_memory_utilization: float | None = None,
                     max_batch_size: int | None = None, **unknown):
            super().__init__()
            from llmkit.engines import get_engine

            if unknown:
                raise ValueError(f"unknown model_args for --model llmkit: {', '.join(sorted(unknown))} (known: "
                                 "pretrained, engine, kv_cache, guard, batch_size, device, dtype, trust_remote_code, "
                                 "max_model_len, tensor_parallel_size, gpu_memory_utilization)")
            if engine not in ("hf", "vllm"):
                raise ValueError(f"engine must be hf or vllm, got {engine!r}")
            self.model_name = pretrained
            bs = int(batch_size) if str(batch_size).isdigit() else 16  # "auto" / "auto:N": our engines batch themselves
            remote = str(trust_remote_code).lower() in ("1", "true", "yes")
            if engine == "hf":
                kw = {"batch_size": bs, "dtype": dtype or "float32", "trust_remote_code": remote}
                if device == "auto":
                    kw["device_map"] = "auto"
                elif device:
                    kw["device"] = device
            else:
                if device and device not in ("cuda", "auto") and not device.startswith("cuda"):
                    raise ValueError(f"engine=vllm places the model itself; device={device!r} does not apply")
                kw = {"max_model_len": int(max_model_len), "dtype": dtype or "bfloat16",
                      "trust_remote_code": remote}
                if tensor_parallel_size:
                    kw["tensor_parallel_size"] = int(tensor_parallel_size)
                if gpu_memory_utilization:
                    kw["gpu_memory_utilization"] = float(gpu_memory_utilization)
            if kv_cache and kv_cache != "default":
                if engine != "hf":
                    raise ValueError("kv_cache=inquant needs engine=hf (vLLM manages its own KV cache)")
                from llmkit.serving.kv_cache import cache_factory

                kw["cache_factory"] = cache_factory(kv_cache)
            self.engine = get_engine(engine, pretrained, **kw)
            if kv_cache and kv_cache.lower() == "inquant":
                # the cache `llmkit serve` builds: the saved calibration (per-token keys, score gate) when the
                # model has one, else the uncalibrated per-channel cache, and a line saying which
                import sys

                from llmkit.serving.kv_cache import inquant_serving_factory

                self.engine.cache_factory, msg = inquant_serving_factory(self.engine.model)
                print(msg, file=sys.stderr, flush=True)
            self.guard = None
            if guard:
                if engine != "hf":
                    raise ValueError("guard=DIR needs engine=hf (the guard reads hidden states)")
                from llmkit.serving.guard import Guard

                self.guard = Guard.load(guard, model_name=self.engine.model_name)
            self.guard_verdicts: list = []

        def generate_until(self, requests, disable_tqdm: bool = False):
            from llmkit.generation import GenerationParams

            outs = []
            for req in requests:
                context, gk = req.args
                until = gk.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                params = GenerationParams(max_new_tokens=int(gk.get("max_gen_toks", 256)),
                                          temperature=float(gk.get("temperature", 0.0) or 0.0),
                                          top_p=float(gk.get("top_p", 1.0)), stop=until)
                text = self.engine.generate([context], params)[0][0].text
                for s in until:  # engines stop at the string; lm-eval expects it cut off
                    text = text.split(s)[0]
                if self.guard is not None:
                    self.guard_verdicts.append(self.guard.check(self.engine, [{"role": "user", "content": context}],
                                                                text))
                outs.append(text)
            return outs

        def _logprob(self, context: str, continuation: str) -> tuple[float, bool]:
            import torch

            model, tok = self.engine.model, self.engine.tokenizer
            ctx = tok(context, add_special_tokens=False)["input_ids"] if context else [tok.eos_token_id]
            cont = tok(continuation, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ctx + cont], device=next(model.parameters()).device)
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, len(ctx) - 1:-1].float(), -1)
            target = torch.tensor(cont, device=logp.device)
            picked = logp.gather(-1, target[:, None]).squeeze(-1)
            return float(picked.sum()), bool((logp.argmax(-1) == target).all())

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            if not hasattr(self.engine, "model"):
                raise NotImplementedError("loglikelihood needs engine=hf")
            return [self._logprob(*req.args) for req in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            if not hasattr(self.engine, "model"):
                raise NotImplementedError("loglikelihood_rolling needs engine=hf")
            return [self._logprob("", req.args[0])[0] for req in requests]

    return LlmkitLM


LlmkitLM = _register()


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``llmkit`` model registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
