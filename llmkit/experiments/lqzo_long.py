"""The long LQZO comparison (``bench/lqzo.py --long``): QZO vs LQZO at INT2 and INT4, sized to separate them on CPU.

What differs from the quick / full presets (``llmkit.experiments.lqzo``):

* data (``long_splits``): the sentiment task only (short rows), so a ZO step is cheap enough for about a
  thousand steps per run; validation (lr choice) and test (reported) are sentiment rows from other generator
  seeds, with no question shared between the three splits. Test: completion loss and two-choice accuracy on
  the same held-out rows.
* resumable runs (``tuned_runs_by_part``): the tuned comparison of ``tuned_runs`` (lr chosen on validation at
  the first seed, then that lr rerun per seed, only test figures reported), with every single training run
  (cell, lr, seed) saved as soon as it finishes, so a multi-hour run that is stopped loses at most the run in
  progress. The trained scales of each sweep run are kept in the cache folder so the chosen one is tested
  without training it again (if they are gone, the run is repeated: same seed, same run).
* the summary (``summarize_long``): the quick/full summary plus the LQZO - QZO differences paired by seed
  (test loss and accuracy, with t intervals), the measured cost of a step and whether each chosen lr is at
  the edge of its sweep (then it is not known to be the best, and ``--extend`` adds learning rates).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from llmkit.experiments.harness import lr_sweep

LONG_CELLS = ("qzo_int4", "lqzo_int4", "qzo_int2", "lqzo_int2")
LONG_SKIPPED = ("mezo", "qlora_nf4")
# generator seeds of the sentiment splits (training's is the recipe's 10_000 + seed 0)
TRAIN_SEED, VAL_SEED, TEST_SEED = 10_000, 30_000, 20_000


def long_splits(n_train: int, n_val: int, n_test: int) -> dict:
    """``{train_ds, val_rows, test_rows, test_acc_rows}``: procedural sentiment rows, no question in two splits
    (validation and test skip rows seen earlier; test_acc_rows is test_rows)."""
    from llmkit.train.common import chat_dataset
    from llmkit.train.lqzo.task import sentiment_rows

    train = sentiment_rows(n_train, seed=TRAIN_SEED)
    seen = {r["question"] for r in train}

    def held_out(n: int, seed: int) -> list[dict]:
        out = []
        for r in sentiment_rows(2 * n + 100, seed=seed):  # a prefix of the same stream, whatever n is
            if r["question"] not in seen and len(out) < n:
                seen.add(r["question"])
                out.append(r)
        if len(out) < n:
            raise ValueError(f"too few distinct sentiment rows for {n} held-out problems")
        return out

    val, test = held_out(n_val, VAL_SEED), held_out(n_test, TEST_SEED)
    train_ds = chat_dataset([{"question": r["question"], "answer": r["answer"]} for r in train], "prompt_completion",
                            where="sentiment")
    return {"train_ds": train_ds, "val_rows": val, "test_rows": test, "test_acc_rows": test}


def tuned_runs_by_part(base, lrs: list[float], seeds: list[int], train_fn, val_fn, test_fn, load, save,
                       snapshot=None, restore=None, log: Callable[[str], None] = print, name: str = "") -> dict:
    """``tuned_runs`` with each training run saved on its own and reused when saved.

    ``train_fn(model, lr, seed)`` trains a fresh copy of ``base`` (returns the train-loss history),
    ``val_fn(model)`` is the validation loss (non-finite = diverged), ``test_fn(model)`` the test dict.
    ``load(lr, seed)`` gives a saved run record or None, ``save(lr, seed, record)`` stores one; a record is
    ``{lr, seed, val_loss, train_loss, train_s}`` plus ``test`` once tested. ``snapshot(lr, seed, model)`` /
    ``restore(lr, seed, base)`` (optional) keep a sweep run's trained state so the chosen one is tested without
    training it again; without one the chosen run is repeated with its seed. The sweep is at ``seeds[0]``; the
    best lr on validation (``harness.lr_sweep``) is tested and rerun for the other seeds. Returns ``tuned_runs``'
    ``{sweep, best_lr, best_lr_at_edge, runs}``.
    """
    if not lrs or not seeds:
        raise ValueError("tuned_runs_by_part needs at least one learning rate and one seed")
    lrs, s0 = sorted(float(x) for x in lrs), seeds[0]
    kept: dict = {}  # the best sweep model trained in this process: tested without a restore

    def trained(lr: float, seed: int):
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        hist = train_fn(model, lr, seed)
        train_s = time.perf_counter() - t0
        v = float(val_fn(model))
        return model, {"lr": lr, "seed": seed, "val_loss": v if math.isfinite(v) else None, "train_loss": hist,
                       "train_s": train_s}

    sweep = {}
    for lr in lrs:
        rec = load(lr, s0)
        if rec is None:
            model, rec = trained(lr, s0)
            if snapshot is not None:
                snapshot(lr, s0, model)
            save(lr, s0, rec)
            best_v = kept.get("val")
            if rec["val_loss"] is not None and (best_v is None or rec["val_loss"] < best_v):
                kept.update(val=rec["val_loss"], lr=lr, model=model)
            del model
        v = rec["val_loss"]
        log(f"{name} lr {lr:g} (seed {s0}): validation loss " + (f"{v:.4f}" if v is not None else "diverged"))
        sweep[lr] = rec
    picked = lr_sweep(lambda lr: sweep[lr]["val_loss"] if sweep[lr]["val_loss"] is not None else math.nan, lrs)
    best = picked["best_lr"]
    if picked["at_edge"]:
        log(f"!!! {name}: the best learning rate {best:g} is at the edge of the sweep {lrs}: the optimum may lie "
            f"outside it; extend the sweep (--extend --lr-sweep ...) before reading the comparison !!!")
    runs = []
    for s in seeds:
        rec = sweep[best] if s == s0 else load(best, s)
        if rec is None or "test" not in rec:
            model = kept.get("model") if s == s0 and kept.get("lr") == best else None
            if model is None and rec is not None and restore is not None:
                model = restore(best, s, base)
            if model is None:
                model, new = trained(best, s)
                rec = new if rec is None else rec
            rec = dict(rec, test=test_fn(model))
            save(best, s, rec)
            del model
        kept.pop("model", None)
        runs.append({"seed": s, "test": rec["test"], "train_loss": rec["train_loss"], "val_loss": rec["val_loss"],
                     "train_s": rec["train_s"]})
    return {"sweep": [{k: sweep[lr][k] for k in ("lr", "val_loss", "train_loss", "train_s")} for lr in lrs],
            "best_lr": best, "best_lr_at_edge": picked["at_edge"], "runs": runs}


def run_name(cell: str, lr: float, seed: int) -> str:
    return f"run_{cell}_lr{lr:g}_seed{seed}"


def snapshot_path(cache: str | Path, config: dict, cell: str, lr: float, seed: int) -> Path:
    key = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache) / "lqzo_long_runs" / f"{key}_{cell}_lr{lr:g}_seed{seed}.safetensors"


def save_trained(model, names: list[str], path: Path) -> None:
    """The trained tensors (``zo_trainable``'s names) of a run, to test it later without training it again."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: params[n].detach().contiguous() for n in names}, str(path))


def load_trained(base, path: Path):
    """A copy of ``base`` with the saved trained tensors, or None when the file is gone or does not fit."""
    import torch
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    saved = load_file(str(path))
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    if any(n not in params or params[n].shape != t.shape for n, t in saved.items()):
        return None
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t)
    return model


def _extend_hint(part: dict) -> str:
    lrs, best = sorted(e["lr"] for e in part["sweep"]), part["best_lr"]
    return f"{best / 4:g}" if best == lrs[0] else f"{best * 4:g}"


def summarize_long(res: dict, memory: dict, log: Callable[[str], None] = print) -> dict:
    """``lqzo.summarize`` plus the long comparison: LQZO - QZO paired by seed at INT2 and INT4 (test loss and
    accuracy, ``paired_seed_diff`` with t intervals), the measured step cost, and the sweeps' edges."""
    from llmkit.experiments.lqzo import paired_seed_diff, summarize

    s = summarize(res, memory, log=log)
    runs = res["runs"]
    out: dict = {}
    for bits in (2, 4):
        lq, qz = runs.get(f"lqzo_int{bits}", {}), runs.get(f"qzo_int{bits}", {})
        for key, label in (("eval_loss", "paired_diff"), ("accuracy", "paired_acc_diff")):
            out[f"{label}_int{bits}"] = (paired_seed_diff(lq["runs"], qz["runs"], key)
                                         if "runs" in lq and "runs" in qz else None)
        d, a = out[f"paired_diff_int{bits}"], out[f"paired_acc_diff_int{bits}"]
        if d:
            log(f"INT{bits} LQZO - QZO, paired by seed: test loss {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}], "
                f"accuracy {a['mean']:+.3f} [{a['lo']:+.3f}, {a['hi']:+.3f}] (95% t intervals over {d['n']} seeds; "
                f"LQZO loss lower in {d['a_better']} of {d['n']})")
    d2 = out["paired_diff_int2"]
    if not d2 or d2["n"] < 2:
        claim = "not measured"
    elif d2["hi"] < 0:
        claim = "shown: LQZO's INT2 test loss is lower than QZO's (the paired interval excludes 0)"
    elif d2["lo"] > 0:
        claim = "contradicted: LQZO's INT2 test loss is higher than QZO's (the paired interval excludes 0)"
    else:
        claim = (f"not separated at this budget: the paired interval [{d2['lo']:+.4f}, {d2['hi']:+.4f}] contains 0")
    log(f"the paper's INT2 claim (LQZO below QZO): {claim}")
    # every training run once: the sweep (first seed) and the other seeds' reruns
    trained = [r for c in LONG_CELLS if "runs" in runs.get(c, {})
               for r in runs[c]["sweep"] + [x for x in runs[c]["runs"] if x["seed"] != runs[c]["runs"][0]["seed"]]]
    steps = res["zo_steps"]
    step_s = statistics.median(r["train_s"] / steps for r in trained) if trained else None
    edges = [c for c in LONG_CELLS if runs.get(c, {}).get("best_lr_at_edge")]
    for c in edges:
        log(f"!!! {c}: chosen lr {runs[c]['best_lr']:g} is at the edge of its sweep; run "
            f"`bench/lqzo.py --long --only {c} --extend --lr-sweep {_extend_hint(runs[c])}` !!!")
    if step_s is not None:
        log(f"cost: {step_s:.3f} s per ZO step (median over the runs), {steps} steps per run")
    return s | out | {
        "int2_claim": claim, "steps_per_run": steps, "batch": res["config"]["batch"], "step_s": step_s,
        "train_core_hours": sum(r["train_s"] for r in trained) / 3600 if trained else None,
        "lr_at_edge": edges,
    }
