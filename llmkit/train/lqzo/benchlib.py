"""What ``bench/lqzo.py`` measures, as tested library code: quantized copies of a model (cached), the
training runs of each method through the same trainers users run, held-out metrics, the tuned comparison
(``bench_splits``: disjoint train / validation / test data; ``tuned_runs``: per-method learning rate chosen
on validation, reruns per seed, test-only reporting), and peak memory / step time probes.

Memory: peak resident set size (RSS, sampled every 2 ms from ``/proc/self/statm`` in a thread) while one
operation runs, in a fresh process per probe (``python -m llmkit.train.lqzo.benchlib probe KIND``) so
no other model or allocator history is in it; freed memory is returned to the OS (``malloc_trim``)
before the operation starts. On GPUs ``torch.cuda.max_memory_allocated`` is reported instead.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

MODEL = "smollm2-135m-instruct"


# ----------------------------------------------------------------------------- memory / time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim() -> None:
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def peak_memory_during(fn, interval: float = 0.002) -> dict:
    """Run ``fn()``; return ``{peak, base, result}`` in bytes (CUDA: max allocated; CPU: sampled RSS)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return {"peak": torch.cuda.max_memory_allocated(), "base": base, "result": result}
    trim()
    base = _rss()
    peak = [base]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(interval)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        stop.set()
        t.join()
    peak[0] = max(peak[0], _rss())
    return {"peak": peak[0], "base": base, "result": result}


# ----------------------------------------------------------------------------- models and data


def load_model(bits: int, group_size: int, cache_dir: str | Path | None = None, name: str = MODEL):
    """``(model, tok)``: the model in float32, quantized to ``bits`` (0: full precision). The quantized state
    is cached in ``cache_dir`` so each bit-width is quantized once."""
    from safetensors.torch import load_file

    from llmkit.models import load
    from llmkit.train.lqzo.quant import load_quant_state, quant_state, quantize_model

    model, tok = load(name)
    model.train()
    if not bits:
        return model, tok
    if cache_dir is not None:
        f = Path(cache_dir) / f"int{bits}-g{group_size}.safetensors"
        if f.is_file():
            meta = json.loads(f.with_suffix(".json").read_text())
            load_quant_state(model, load_file(str(f)), meta)
            return model, tok
    quantize_model(model, bits, group_size, progress=True)
    if cache_dir is not None:
        from safetensors.torch import save_file

        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        tensors, meta = quant_state(model)
        save_file(tensors, str(f))
        f.with_suffix(".json").write_text(json.dumps(meta))
    return model, tok


def lm_batch(tok, rows: list[dict], max_length: int) -> dict:
    """A padded chat batch with completion-only labels (what the trainers see)."""
    ids, labels = [], []
    for r in rows:
        p = tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False,
                                    add_generation_prompt=True)
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        c_ids = tok(str(r["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.append((p_ids + c_ids)[:max_length])
        labels.append(([-100] * len(p_ids) + c_ids)[:max_length])
    width = max(map(len, ids))
    pad = tok.pad_token_id
    return {"input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
            "labels": torch.tensor([y + [-100] * (width - len(y)) for y in labels])}


def measure(model, tok, eval_rows, acc_rows, max_length: int = 256, batch_size: int = 8) -> dict:
    from llmkit.train.lqzo.recipe import measure as recipe_measure

    return recipe_measure(model, tok, eval_rows, acc_rows, max_length, batch_size)


# ----------------------------------------------------------------------------- training runs


def train_zo(model, tok, train_ds, settings: dict, steps: int, lr: float, batch_size: int, max_length: int,
             output_dir: str | Path, seed: int = 0) -> list[dict]:
    """``steps`` ZO steps with ``LQZOTrainer`` (the recipe's trainer); returns the log history."""
    from llmkit.train.lqzo.config import LQZOConfig
    from llmkit.train.lqzo.trainer import LQZOTrainer

    args = LQZOConfig(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
                      learning_rate=lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                      use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none", max_length=max_length,
                      dataloader_num_workers=0, seed=seed, disable_tqdm=False)
    tr = LQZOTrainer(model=model, args=args, train_dataset=train_ds, processing_class=tok, zo_settings=settings)
    tr.train()
    return [r for r in tr.state.log_history if "loss" in r]


def qlora_model(name: str = MODEL, r: int = 8):
    """bitsandbytes NF4 4-bit base + LoRA adapters on all linear layers (peft), via ``load_for_training``."""
    from peft import get_peft_model
    from trl import ModelConfig, get_peft_config

    from llmkit.models import load_for_training

    margs = ModelConfig(model_name_or_path=name, load_in_4bit=True, use_peft=True, lora_r=r, lora_alpha=2 * r,
                        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    model, tok = load_for_training(margs)
    model = get_peft_model(model, get_peft_config(margs))
    return model, tok


def train_qlora(model, tok, train_ds, steps: int, lr: float, batch_size: int, max_length: int,
                output_dir: str | Path, seed: int = 0) -> list[dict]:
    """First-order QLoRA SFT with TRL's SFTTrainer (AdamW), the memory/accuracy reference."""
    import warnings

    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
                     learning_rate=lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                     use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none", max_length=max_length,
                     dataloader_num_workers=0, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = SFTTrainer(model=model, args=args, train_dataset=train_ds, processing_class=tok)
        tr.train()
    return [r for r in tr.state.log_history if "loss" in r]


# ----------------------------------------------------------------------------- tuned comparison


def bench_splits(n_train: int, n_val: int, n_test: int, n_acc_test: int, seed: int = 0,
                 data_dir: str | Path | None = None) -> dict:
    """Disjoint train / validation / test data for the tuned comparison.

    Train: the first ``n_train // 2`` GSM8K train problems interleaved with ``n_train // 2`` procedural
    sentiment problems (the recipe's ``load_data``). Validation (learning-rate selection only): the next
    ``n_val`` GSM8K *train* problems (never trained on). Test (reported): the first ``n_test`` GSM8K *test*
    problems and ``n_acc_test`` sentiment problems from another seed than training's. GSM8K comes from
    ``data_dir`` (a folder with its train.jsonl and test.jsonl) or, without one, the hub's ``openai/gsm8k``.
    Returns ``{train_ds, val_rows, test_rows, test_acc_rows}``.
    """
    from llmkit.train.common import load_records
    from llmkit.train.lqzo.config import LQZOArguments
    from llmkit.train.lqzo.recipe import load_data
    if data_dir is None:  # the hub's GSM8K, train and test splits
        train_src, test_src, config = "openai/gsm8k", "openai/gsm8k", "main"
    else:  # a folder with GSM8K's train.jsonl and test.jsonl
        train_src, test_src, config = str(Path(data_dir) / "train.jsonl"), str(Path(data_dir) / "test.jsonl"), None
    n_gsm = n_train // 2
    zargs = LQZOArguments(dataset_name=train_src, max_train_samples=n_gsm,
                          task_train_samples=n_train - n_gsm, eval_data=test_src, eval_data_config=config,
                          max_eval_samples=n_test, accuracy_samples=n_acc_test)
    train_ds, _, test_rows, test_acc = load_data(zargs, seed=seed)
    val_rows = load_records(train_src, "train", config, n_gsm + n_val)[n_gsm:]
    if len(val_rows) < n_val:
        raise ValueError(f"{train_src} has too few rows for {n_gsm} training + {n_val} validation problems")
    return {"train_ds": train_ds, "val_rows": val_rows, "test_rows": test_rows, "test_acc_rows": test_acc}


def pick_best(sweep: list[dict], key: str = "val_loss") -> int:
    """Index of the entry with the lowest finite ``key`` (first on ties); ``ValueError`` if every run diverged."""
    import math

    ok = [(e[key], i) for i, e in enumerate(sweep) if e.get(key) is not None and math.isfinite(e[key])]
    if not ok:
        raise ValueError(f"every run of the sweep diverged ({key} not finite): {[e.get('lr') for e in sweep]}")
    return min(ok)[1]


def recovered_fraction(before: float, after: float, reference: float) -> float:
    """Share of the quantization loss gap ``before - reference`` that training closed (1 = back to full precision)."""
    gap = before - reference
    return (before - after) / gap if gap > 0 else float("nan")


def tuned_runs(base, lrs: list[float], seeds: list[int], train_fn, val_fn, test_fn, log=print, name: str = "",
               beat: float | None = None) -> dict:
    """A fair per-method comparison at a fixed budget: pick the learning rate on validation, report on test.

    For each ``lr`` in ``lrs``: a fresh copy of ``base`` is trained by ``train_fn(model, lr, seed)`` (returns
    the train-loss history) with ``seeds[0]`` and scored by ``val_fn(model)`` (a loss, lower is better;
    non-finite = diverged). The best copy is kept and scored by ``test_fn(model)`` (a dict); then the best
    lr is rerun for every other seed and scored on test. Validation never sees the test rows, and test
    never picks anything. Returns ``{sweep: [{lr, val_loss, train_loss}], best_lr, best_lr_at_edge,
    runs: [{seed, test, train_loss}]}``. ``beat``: the best validation loss of an earlier sweep being extended
    (``merge_sweeps``); when no lr here beats it, nothing is tested or rerun (``runs`` is empty).
    """
    import copy
    import math

    if not lrs or not seeds:
        raise ValueError("tuned_runs needs at least one learning rate and one seed")
    sweep, best_model, best_i = [], None, None
    for lr in lrs:
        model = copy.deepcopy(base)
        hist = train_fn(model, lr, seeds[0])
        v = float(val_fn(model))
        sweep.append({"lr": lr, "val_loss": v if math.isfinite(v) else None, "train_loss": hist})
        log(f"{name} lr {lr:g}: validation loss {v:.4f}")
        i = len(sweep) - 1
        if math.isfinite(v) and (best_i is None or v < sweep[best_i]["val_loss"]):
            best_model, best_i = model, i
        else:
            del model
    best_i = pick_best(sweep)
    best_lr = lrs[best_i]
    if beat is not None and not sweep[best_i]["val_loss"] < beat:
        return {"sweep": sweep, "best_lr": best_lr, "best_lr_at_edge": None, "runs": []}
    runs = [{"seed": seeds[0], "test": test_fn(best_model), "train_loss": sweep[best_i]["train_loss"]}]
    del best_model
    for s in seeds[1:]:
        model = copy.deepcopy(base)
        hist = train_fn(model, best_lr, s)
        runs.append({"seed": s, "test": test_fn(model), "train_loss": hist})
        del model
    return {"sweep": sweep, "best_lr": best_lr, "best_lr_at_edge": len(lrs) > 1 and best_i in (0, len(lrs) - 1),
            "runs": runs}


def merge_sweeps(old: dict, new: dict) -> dict:
    """One sweep from an earlier ``tuned_runs`` result and one over further learning rates (run with
    ``beat`` = the earlier best validation loss): the best lr over both, its test runs, the sweep sorted by lr."""
    sweep = sorted(old["sweep"] + new["sweep"], key=lambda e: e["lr"])
    best = sweep[pick_best(sweep)]["lr"]
    lrs = [e["lr"] for e in sweep]
    if len(set(lrs)) != len(lrs):
        raise ValueError(f"the sweeps overlap: {lrs}")
    runs = new["runs"] if best in [e["lr"] for e in new["sweep"]] else old["runs"]
    if not runs:
        raise ValueError("the best lr has no test runs (run the new sweep with beat=<old best validation loss>)")
    return {"sweep": sweep, "best_lr": best, "best_lr_at_edge": len(lrs) > 1 and best in (lrs[0], lrs[-1]),
            "runs": runs}


def seed_stats(runs: list[dict], key: str) -> dict:
    """``{mean, std, values}`` of ``run['test'][key]`` over seeds (std 0 with one seed)."""
    vals = [r["test"][key] for r in runs if key in r["test"]]
    if not vals:
        return {"mean": None, "std": None, "values": []}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "values": vals}


def paired_seed_diff(runs_a: list[dict], runs_b: list[dict], key: str = "eval_loss") -> dict:
    """``a - b`` of ``run['test'][key]`` for the seeds both cells ran (same seed = same batch order and the
    same test rows, so the pairing removes the data-order part of the spread): ``{seeds, diffs, mean, std,
    a_better}`` (``a_better``: how many seeds have ``a < b``, i.e. a lower loss). ``ValueError`` without a
    shared seed."""
    a = {r["seed"]: r["test"][key] for r in runs_a if key in r["test"]}
    b = {r["seed"]: r["test"][key] for r in runs_b if key in r["test"]}
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"no seed has {key!r} in both cells (seeds {sorted(a)} vs {sorted(b)})")
    diffs = [a[s] - b[s] for s in seeds]
    return {"seeds": seeds, "diffs": diffs, "mean": statistics.fmean(diffs),
            "std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0, "a_better": sum(d < 0 for d in diffs)}


# ----------------------------------------------------------------------------- probes (fresh process each)


def probe(kind: str, bits: int = 4, group_size: int = 64, batch_size: int = 4, max_length: int = 128,
          cache_dir: str | None = None, reps: int = 7) -> dict:
    """Peak memory of one operation on one batch: ``inference`` (a forward, no_grad), ``lqzo`` (one LQZO step:
    two forwards + perturb/restore/update), ``qlora`` (forward + backward + AdamW step). ``lqzo`` also
    times the step against two plain forwards of the same batch (medians of ``reps`` interleaved runs, order
    alternating) and the ZO machinery alone (perturb, restore, update without the forwards)."""
    from llmkit.optim.zo import SeedZO
    from llmkit.train.lqzo.task import compare_rows
    from llmkit.train.lqzo.trainer import zo_trainable

    torch.manual_seed(0)
    rows = compare_rows(batch_size, seed=1)
    if kind == "qlora":
        model, tok = qlora_model()
        model.train()
        batch = lm_batch(tok, rows, max_length)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def op():
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)
        op()  # the first step allocates AdamW's state: measure a steady-state step
        m = peak_memory_during(op)
        return {"kind": kind, "peak_bytes": m["peak"], "base_bytes": m["base"]}
    model, tok = load_model(bits, group_size, cache_dir)
    batch = lm_batch(tok, rows, max_length)
    if kind == "inference":
        with torch.no_grad():
            model(**batch)  # warm-up
            m = peak_memory_during(lambda: float(model(**batch).loss))
        return {"kind": kind, "peak_bytes": m["peak"], "base_bytes": m["base"]}
    if kind != "lqzo":
        raise ValueError(f"unknown probe {kind!r}")
    _, tensors, modes, _ = zo_trainable(model, {})
    zo = SeedZO(tensors, modes=modes, mu=1e-3, rank=4, distribution="rademacher", isotropic=True, v_interval=10)

    def loss_fn():
        return model(**batch).loss

    def step(i):
        d = zo.estimate(loss_fn, i)
        zo.update(i, d, lr=1e-5)
        return d

    with torch.no_grad():
        step(0)  # warm-up (allocates the restore copy of the scales)
        m = peak_memory_during(lambda: step(1))
        t_step, t_fwd, t_pert = [], [], []

        def two_forwards():
            loss_fn()
            loss_fn()

        for i in range(reps):
            # alternate which runs first: on a shared 2-core box a neighbour's burst otherwise lands on one side
            order = [("fwd", two_forwards), ("step", lambda i=i: step(2 + i))]
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                fn()
                (t_fwd if name == "fwd" else t_step).append(time.perf_counter() - t0)
            # the ZO machinery alone (perturb +, perturb -, restore, update): what the step adds to two forwards
            t0 = time.perf_counter()
            zo.perturb(100 + i, 0, 1.0)
            zo.perturb(100 + i, 0, -1.0)
            zo.restore()
            zo.update(100 + i, [0.0] * (zo.q - 1) + [1e-3], lr=0.0)
            t_pert.append(time.perf_counter() - t0)
    return {"kind": kind, "peak_bytes": m["peak"], "base_bytes": m["base"], "step_s": statistics.median(t_step),
            "two_forward_s": statistics.median(t_fwd), "zo_overhead_s": statistics.median(t_pert),
            "step_s_all": t_step, "two_forward_s_all": t_fwd, "zo_copy_bytes": zo.backup_bytes(),
            "trainable_elements": zo.num_elements()}


def run_probe(kind: str, **kw) -> dict:
    """``probe`` in a fresh Python process (from /tmp, so the repo's top-level folders shadow nothing)."""
    import subprocess

    cmd = [sys.executable, "-m", "llmkit.train.lqzo.benchlib", "probe", kind, json.dumps(kw)]
    out = subprocess.run(cmd, cwd="/tmp", capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"probe {kind} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # python -m llmkit.train.lqzo.benchlib probe KIND '{"bits": 4, ...}'
    if len(sys.argv) >= 3 and sys.argv[1] == "probe":
        kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        print(json.dumps(probe(sys.argv[2], **kwargs)), flush=True)
