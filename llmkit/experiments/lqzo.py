"""What ``bench/lqzo.py`` measures: MeZO, QZO and LQZO at INT4 / INT2 and first-order QLoRA on one model.

Pieces, each tested on its own:

* models and data: quantized copies of the model (cached per bit-width), chat batches, the disjoint
  train / validation / test splits of the tuned comparison (``bench_splits``);
* training runs through the same trainers users run (``train_zo``: ``LQZOTrainer``; ``train_qlora``: TRL's
  ``SFTTrainer`` on a bitsandbytes NF4 base with LoRA);
* the tuned comparison (``tuned_runs``): per-method learning rate chosen on validation with
  ``harness.lr_sweep``, reruns per seed, test-only reporting; ``merge_sweeps`` extends a saved sweep;
* probes (``run_probe``): peak memory of one inference forward, one LQZO step and one QLoRA step, each in a
  fresh process so no other model or allocator history is in it, plus LQZO's step time against two forwards;
* the bench itself (``LqzoBench``): every run cell saved as a ``harness.ResultStore`` part as soon as it
  finishes, so a rerun of the same command continues; ``summarize`` and ``plot`` turn the cells into the
  JSON summary and the figure. Results: bench/results/lqzo_quick.md.
* the long preset (``presets(long=True)``, ``llmkit.experiments.lqzo_long``): QZO vs LQZO at INT2 / INT4 on
  the short sentiment rows, each training run saved on its own.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from llmkit.experiments.harness import ResultStore, lr_sweep, peak_memory_during
from llmkit.experiments.stats import mean_ci, paired_diff

MODEL = "smollm2-135m-instruct"
# QZO's additive steps on the scales, 1024x in steps of 4 (the long preset stops at 2.5e-4)
QZO_LRS = [9.765625e-7, 3.90625e-6, 1.5625e-5, 6.25e-5, 2.5e-4, 1e-3]
CELLS = ("mezo", "qzo_int4", "lqzo_int4", "qzo_int2", "lqzo_int2", "qlora_nf4")
# other pieces --only can name: the untrained metrics per precision, the memory / step-time probes, the
# estimator-quality table
PIECES = ("fp", "int4", "int2", "probes", "estimator")


def _print(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- models and data


def load_model(bits: int, group_size: int, cache_dir: str | Path | None = None, name: str = MODEL):
    """``(model, tok)``: the model in float32, quantized to ``bits`` (0: full precision). The quantized state
    is cached in ``cache_dir`` so each bit-width is quantized once."""
    from safetensors.torch import load_file, save_file

    from llmkit.models import load
    from llmkit.train.lqzo.quant import load_quant_state, quant_state, quantize_model

    model, tok = load(name)
    model.train()
    if not bits:
        return model, tok
    f = Path(cache_dir) / f"int{bits}-g{group_size}.safetensors" if cache_dir is not None else None
    if f is not None and f.is_file():
        load_quant_state(model, load_file(str(f)), json.loads(f.with_suffix(".json").read_text()))
        return model, tok
    quantize_model(model, bits, group_size, progress=True)
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        tensors, meta = quant_state(model)
        save_file(tensors, str(f))
        f.with_suffix(".json").write_text(json.dumps(meta))
    return model, tok


def lm_batch(tok, rows: list[dict], max_length: int) -> dict:
    """A padded chat batch with completion-only labels (what the trainers see)."""
    import torch

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
    """``{eval_loss, accuracy}``: the recipe's held-out metrics."""
    from llmkit.train.lqzo.recipe import measure as recipe_measure

    return recipe_measure(model, tok, eval_rows, acc_rows, max_length, batch_size)


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

    if data_dir is None:
        train_src, test_src, config = "openai/gsm8k", "openai/gsm8k", "main"
    else:
        train_src, test_src, config = str(Path(data_dir) / "train.jsonl"), str(Path(data_dir) / "test.jsonl"), None
    n_gsm = n_train // 2
    zargs = LQZOArguments(dataset_name=train_src, max_train_samples=n_gsm, task_train_samples=n_train - n_gsm,
                          eval_data=test_src, eval_data_config=config, max_eval_samples=n_test,
                          accuracy_samples=n_acc_test)
    train_ds, _, test_rows, test_acc = load_data(zargs, seed=seed)
    val_rows = load_records(train_src, "train", config, n_gsm + n_val)[n_gsm:]
    if len(val_rows) < n_val:
        raise ValueError(f"{train_src} has too few rows for {n_gsm} training + {n_val} validation problems")
    return {"train_ds": train_ds, "val_rows": val_rows, "test_rows": test_rows, "test_acc_rows": test_acc}


# ----------------------------------------------------------------------------- training runs


def _train_args(cls, output_dir, steps, lr, batch_size, max_length, seed, **kw):
    import torch

    return cls(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
               lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
               use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none", max_length=max_length,
               dataloader_num_workers=0, seed=seed, **kw)


def train_zo(model, tok, train_ds, settings: dict, steps: int, lr: float, batch_size: int, max_length: int,
             output_dir: str | Path, seed: int = 0) -> list[dict]:
    """``steps`` ZO steps with ``LQZOTrainer`` (the recipe's trainer); returns the log history."""
    from llmkit.train.lqzo.config import LQZOConfig
    from llmkit.train.lqzo.trainer import LQZOTrainer

    args = _train_args(LQZOConfig, output_dir, steps, lr, batch_size, max_length, seed, disable_tqdm=False)
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
    return get_peft_model(model, get_peft_config(margs)), tok


def train_qlora(model, tok, train_ds, steps: int, lr: float, batch_size: int, max_length: int,
                output_dir: str | Path, seed: int = 0) -> list[dict]:
    """First-order QLoRA SFT with TRL's SFTTrainer (AdamW), the memory/accuracy reference."""
    import warnings

    from trl import SFTConfig, SFTTrainer

    args = _train_args(SFTConfig, output_dir, steps, lr, batch_size, max_length, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = SFTTrainer(model=model, args=args, train_dataset=train_ds, processing_class=tok)
        tr.train()
    return [r for r in tr.state.log_history if "loss" in r]


# ----------------------------------------------------------------------------- tuned comparison


def recovered_fraction(before: float, after: float, reference: float) -> float:
    """Share of the quantization loss gap ``before - reference`` that training closed (1 = back to full precision)."""
    gap = before - reference
    return (before - after) / gap if gap > 0 else float("nan")


def _val_scores(sweep: list[dict]) -> dict:
    return {e["lr"]: (e["val_loss"] if e["val_loss"] is not None else float("nan")) for e in sweep}


def tuned_runs(base, lrs: list[float], seeds: list[int], train_fn, val_fn, test_fn, log=print, name: str = "",
               beat: float | None = None, make: Callable[[], object] | None = None) -> dict:
    """A fair per-method comparison at a fixed budget: pick the learning rate on validation, report on test.

    For each ``lr`` in ``lrs`` (``harness.lr_sweep``, smallest first): a fresh copy of ``base`` is trained by
    ``train_fn(model, lr, seed)`` (returns the train-loss history) with ``seeds[0]`` and scored by
    ``val_fn(model)`` (a loss, lower is better; non-finite = diverged). The best copy is kept and scored by
    ``test_fn(model)`` (a dict); then the best lr is rerun for every other seed and scored on test. Validation
    never sees the test rows, and test never picks anything. Returns ``{sweep: [{lr, val_loss, train_loss}],
    best_lr, best_lr_at_edge, runs: [{seed, test, train_loss}]}``. ``beat``: the best validation loss of an
    earlier sweep being extended (``merge_sweeps``); when no lr here beats it, nothing is tested or rerun.
    ``make``: builds each fresh model instead of copying ``base`` (a bitsandbytes 4-bit model is reloaded).
    """
    if not lrs or not seeds:
        raise ValueError("tuned_runs needs at least one learning rate and one seed")
    sweep: list[dict] = []
    best: dict = {}  # the best model so far: kept to be tested instead of trained again

    def fresh():
        return make() if make is not None else copy.deepcopy(base)

    def score(lr: float) -> float:
        model = fresh()
        hist = train_fn(model, lr, seeds[0])
        v = float(val_fn(model))
        ok = math.isfinite(v)
        sweep.append({"lr": lr, "val_loss": v if ok else None, "train_loss": hist})
        log(f"{name} lr {lr:g}: validation loss {v:.4f}")
        if ok and ("val" not in best or v < best["val"]):
            best.update(val=v, model=model, i=len(sweep) - 1)
        return v

    picked = lr_sweep(score, lrs)
    best_lr = picked["best_lr"]
    if beat is not None and not best["val"] < beat:
        return {"sweep": sweep, "best_lr": best_lr, "best_lr_at_edge": None, "runs": []}
    runs = [{"seed": seeds[0], "test": test_fn(best.pop("model")), "train_loss": sweep[best["i"]]["train_loss"]}]
    for s in seeds[1:]:
        model = fresh()
        hist = train_fn(model, best_lr, s)
        runs.append({"seed": s, "test": test_fn(model), "train_loss": hist})
        del model
    return {"sweep": sweep, "best_lr": best_lr, "best_lr_at_edge": picked["at_edge"], "runs": runs}


def merge_sweeps(old: dict, new: dict) -> dict:
    """One sweep from an earlier ``tuned_runs`` result and one over further learning rates (run with
    ``beat`` = the earlier best validation loss): the best lr over both, its test runs, the sweep sorted by lr."""
    sweep = sorted(old["sweep"] + new["sweep"], key=lambda e: e["lr"])
    lrs = [e["lr"] for e in sweep]
    if len(set(lrs)) != len(lrs):
        raise ValueError(f"the sweeps overlap: {lrs}")
    scores = _val_scores(sweep)
    picked = lr_sweep(scores.__getitem__, lrs)
    runs = new["runs"] if picked["best_lr"] in _val_scores(new["sweep"]) else old["runs"]
    if not runs:
        raise ValueError("the best lr has no test runs (run the new sweep with beat=<old best validation loss>)")
    return {"sweep": sweep, "best_lr": picked["best_lr"], "best_lr_at_edge": picked["at_edge"], "runs": runs}


def seed_stats(runs: list[dict], key: str) -> dict:
    """``{mean, std, lo, hi, n, values}`` of ``run['test'][key]`` over seeds (``stats.mean_ci``)."""
    vals = [r["test"][key] for r in runs if key in r["test"]]
    if not vals:
        return {"mean": None, "std": None, "values": []}
    return mean_ci(vals) | {"values": vals}


def paired_seed_diff(runs_a: list[dict], runs_b: list[dict], key: str = "eval_loss") -> dict:
    """``a - b`` of ``run['test'][key]`` for the seeds both cells ran (same seed = same batch order and the
    same test rows, so the pairing removes the data-order part of the spread): ``stats.paired_diff`` named
    for seeds, ``{seeds, diffs, mean, std, lo, hi, n, a_better}`` (``a_better``: seeds with ``a < b``)."""
    a = {r["seed"]: r["test"][key] for r in runs_a if key in r["test"]}
    b = {r["seed"]: r["test"][key] for r in runs_b if key in r["test"]}
    if not set(a) & set(b):
        raise ValueError(f"no seed has {key!r} in both cells (seeds {sorted(a)} vs {sorted(b)})")
    d = paired_diff(a, b)
    return {"seeds": d["keys"], "diffs": d["diffs"], "mean": d["mean"], "std": d["std"], "lo": d["lo"],
            "hi": d["hi"], "n": d["n"], "a_better": d["a_lower"]}


# ----------------------------------------------------------------------------- probes (fresh process each)


def _lqzo_step_probe(model, batch, reps: int) -> dict:
    import torch

    from llmkit.optim.zo import SeedZO
    from llmkit.train.lqzo.trainer import zo_trainable

    _, tensors, modes, _ = zo_trainable(model, {})
    zo = SeedZO(tensors, modes=modes, mu=1e-3, rank=4, distribution="rademacher", isotropic=True, v_interval=10)

    def loss_fn():
        return model(**batch).loss

    def step(i):
        d = zo.estimate(loss_fn, i)
        zo.update(i, d, lr=1e-5)
        return d

    def two_forwards():
        loss_fn()
        loss_fn()

    with torch.no_grad():
        step(0)  # warm-up (allocates the restore copy of the scales)
        m = peak_memory_during(lambda: step(1))
        t_step, t_fwd, t_pert = [], [], []
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
    return {"peak_bytes": m["peak"], "base_bytes": m["base"], "step_s": statistics.median(t_step),
            "two_forward_s": statistics.median(t_fwd), "zo_overhead_s": statistics.median(t_pert),
            "step_s_all": t_step, "two_forward_s_all": t_fwd, "zo_copy_bytes": zo.backup_bytes(),
            "trainable_elements": zo.num_elements()}


def probe(kind: str, bits: int = 4, group_size: int = 64, batch_size: int = 4, max_length: int = 128,
          cache_dir: str | None = None, reps: int = 7) -> dict:
    """Peak memory of one operation on one batch: ``inference`` (a forward, no_grad), ``lqzo`` (one LQZO step:
    two forwards + perturb/restore/update), ``qlora`` (forward + backward + AdamW step). ``lqzo`` also
    times the step against two plain forwards of the same batch (medians of ``reps`` interleaved runs, order
    alternating) and the ZO machinery alone (perturb, restore, update without the forwards)."""
    if kind not in ("inference", "lqzo", "qlora"):
        raise ValueError(f"unknown probe {kind!r}")
    import torch

    from llmkit.train.lqzo.task import compare_rows

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
    return {"kind": kind, **_lqzo_step_probe(model, batch, reps)}


def run_probe(kind: str, **kw) -> dict:
    """``probe`` in a fresh (spawned) Python process; any failure there, a crash included, is a RuntimeError."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
            return ex.submit(probe, kind, **kw).result()
    except Exception as e:  # the caller records it (bitsandbytes' CPU support varies)
        raise RuntimeError(f"probe {kind} failed: {type(e).__name__}: {e}"[-2000:]) from e


# ----------------------------------------------------------------------------- the bench


def presets(quick: bool, steps: int | None = None, lr_sweep: list[float] | None = None,
            mezo_lr_sweep: list[float] | None = None, seeds: int | None = None, batch: int | None = None,
            long: bool = False, qlora_lr_sweep: list[float] | None = None,
            qzo_lr_sweep: list[float] | None = None) -> dict:
    """The run's sizes: the flags given, else the quick, full or long preset.

    --long (``llmkit.experiments.lqzo_long``): QZO and LQZO at INT2 (5 seeds: the paper's claim) and INT4 (3), on the
    sentiment task alone (rows of ~60 tokens), batch 1 and 1000 steps per run; every training row is seen
    once (n_train = steps x batch). Validation 64 rows (the lr choice), test 128 rows (completion loss and
    two-choice accuracy on the same rows). The lr grid spans 64x in steps of 4.

    Each parameterization has its own lr units, so its own grid: LQZO's (``lrs``) is a relative step on
    log-scales, QZO's (``qzo_lrs``) an additive step on the scales themselves (paper-style; it diverges
    above ~1.6e-5 in the long runs, so its grid sits lower), MeZO's on raw weights, QLoRA's AdamW's.
    ``lr_sweep`` given alone sets QZO's grid too (one grid per ``--only`` cell, as the long runs were made).

    --quick is sized for a CPU: each cell's seconds are ``runs.<cell>.wall_s`` in lqzo_quick.json (split the
    cells over two processes with ``--only``); a full-precision MeZO step costs about 3x a scale-ZO step (it
    draws 135M Gaussians 4x per step). The full run is for a GPU. Quick gives the INT2 cells, whose
    comparison is the paper's claim, 3 seeds and the others 1. n_val 12 / n_test 24: the INT2 methods differ
    by a few hundredths of a nat, and the lr choice and the test figure should not hinge on a handful of rows.
    """
    if long:
        from llmkit.experiments.lqzo_long import LONG_CELLS, LONG_SKIPPED

        if quick:
            raise ValueError("--long and --quick are two different presets: choose one")
        p = {"long": True, "steps": steps or 1000, "lrs": lr_sweep or [1.5625e-5, 6.25e-5, 2.5e-4, 1e-3],
             "qzo_lrs": qzo_lr_sweep or lr_sweep or QZO_LRS[:-1],
             "mezo_lrs": [], "cell_seeds": ({c: 5 if c.endswith("int2") else 3 for c in LONG_CELLS} if seeds is None
                                            else dict.fromkeys(LONG_CELLS, seeds)),
             "batch": batch or 1, "skip": list(LONG_SKIPPED)}
        p["n_train"], p["n_val"], p["n_test"], p["n_acc"] = p["steps"] * p["batch"], 64, 128, 128
        if p["steps"] < 1 or min(p["cell_seeds"].values()) < 1 or p["batch"] < 1:
            raise ValueError("--steps, --seeds and --batch must be >= 1")
        return p
    if seeds is not None:
        cell_seeds = dict.fromkeys(CELLS, seeds)
    elif quick:
        cell_seeds = {"mezo": 1, "qzo_int4": 1, "lqzo_int4": 1, "qzo_int2": 3, "lqzo_int2": 3, "qlora_nf4": 1}
    else:
        cell_seeds = dict.fromkeys(CELLS, 3)
    p = {"steps": steps or (40 if quick else 200),
         "lrs": lr_sweep or [6.25e-5, 2.5e-4, 1e-3, 4e-3],
         "mezo_lrs": mezo_lr_sweep or ([5e-7, 2e-6, 8e-6, 3.2e-5, 1.28e-4, 5.12e-4] if quick else [3e-7, 1e-6, 3e-6]),
         "qzo_lrs": qzo_lr_sweep or lr_sweep or QZO_LRS,
         "qlora_lrs": qlora_lr_sweep or [5e-5, 2e-4, 8e-4, 3.2e-3],
         "cell_seeds": cell_seeds, "batch": batch or (2 if quick else 4)}
    p["n_val"], p["n_test"], p["n_acc"], p["n_train"] = (12, 24, 24, 400) if quick else (32, 64, 200, 1000)
    if p["steps"] < 1 or min(cell_seeds.values()) < 1 or p["batch"] < 1:
        raise ValueError("--steps, --seeds and --batch must be >= 1")
    return p


class LqzoBench:
    """The bench's cells over one configuration, each a ``ResultStore`` part under ``parts_dir``.

    A part is reused when the configuration it was made with matches: the untrained metrics (``before_*``)
    depend on the data and the quantizer only, the probes on the model and the batch shape, the rest on
    the whole configuration (seeds and lr grids may differ per cell: the part records them).
    """

    def __init__(self, p: dict, *, parts_dir: str | Path, data_dir: str | Path | None, cache: str | Path,
                 clip: float | None = None, max_length: int = 128, group_size: int = 64,
                 quick: bool = False, fresh: bool = False, estimator_seeds: int | None = None,
                 log: Callable[[str], None] = _print):
        self.p, self.data_dir, self.cache, self.clip, self.quick, self.log = p, data_dir, str(cache), clip, quick, log
        self.long = bool(p.get("long"))
        self.estimator_seeds = estimator_seeds or (6 if quick else 16)
        self.config = {"model": MODEL, "steps": p["steps"], "clip": clip, "batch": p["batch"],
                       "max_length": max_length, "group_size": group_size,
                       "n_train": p["n_train"], "n_val": p["n_val"], "n_test": p["n_test"], "n_acc": p["n_acc"]}
        if self.long:  # other data than the quick / full presets' (their parts' configs stay as they were)
            self.config["task"] = "sentiment"
        self.data_config = {k: self.config[k] for k in ("model", "max_length", "group_size", "n_train", "n_val",
                                                        "n_test", "n_acc", "task") if k in self.config}
        self.probe_config = {k: self.config[k] for k in ("model", "batch", "max_length", "group_size")}
        self.store = ResultStore(parts_dir, self.config, fresh)
        self.fwd = p["steps"] * 2  # forward passes per ZO run (q = 1)

    @cached_property
    def sp(self) -> dict:
        c = self.config
        if self.long:
            from llmkit.experiments.lqzo_long import long_splits

            return long_splits(c["n_train"], c["n_val"], c["n_test"])
        return bench_splits(c["n_train"], c["n_val"], c["n_test"], c["n_acc"], seed=0, data_dir=self.data_dir)

    @cached_property
    def tmp(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="lqzo-bench-"))

    def _config_of(self, name: str) -> dict:
        return self.data_config if name.startswith("before") else self.config

    def part(self, name: str) -> dict | None:
        """A saved part with the configuration it was made with (``None``: not saved, or another config)."""
        cfg = self._config_of(name)
        value = self.store.load(name, cfg)
        return None if value is None else {"config": cfg, **value}

    def save(self, name: str, body: dict) -> dict:
        cfg = self._config_of(name)
        self.store.save(name, body, cfg)
        return {"config": cfg, **body}

    def val_loss(self, model, tok) -> float:
        from llmkit.train.common import completion_loss

        return completion_loss(model, tok, self.sp["val_rows"], max_length=256, batch_size=8)

    def test(self, model, tok) -> dict:
        return measure(model, tok, self.sp["test_rows"], self.sp["test_acc_rows"], max_length=256, batch_size=8)

    def _load(self, bits: int):
        return load_model(bits, self.config["group_size"], self.cache if bits else None)

    def before(self, bits: int) -> dict:
        """Validation and test metrics of the untrained model at this bit-width (0: full precision)."""
        name = f"before_int{bits}" if bits else "before_fp"
        part = self.part(name)
        if part is None:
            model, tok = self._load(bits)
            part = self.save(name, {"val_loss": self.val_loss(model, tok), "test": self.test(model, tok)})
            del model
        t = part["test"]
        label = f"INT{bits} quantized" if bits else "full precision"
        self.log(f"{label}: test loss {t['eval_loss']:.4f}, accuracy {t['accuracy']:.3f} "
                 f"(validation loss {part['val_loss']:.4f})")
        return part

    def grid(self, method: str) -> list[float]:
        """The lr grid of ``mezo``, ``qzo`` or ``lqzo`` (see ``presets``: each its own units)."""
        return self.p["mezo_lrs"] if method == "mezo" else self.p["qzo_lrs"] if method == "qzo" else self.p["lrs"]

    def train_cell(self, name: str, extend: bool = False) -> dict:
        """One ZO cell (``mezo``, ``qzo_int4`` ...): the tuned runs, saved. ``extend``: only the lrs a saved
        part lacks, merged with it."""
        from llmkit.train.lqzo.config import LQZOArguments

        method, _, b = name.partition("_int")
        bits = int(b) if b else 0
        model, tok = self._load(bits)
        c = self.config
        settings = LQZOArguments(zo_method=method, quant_bits=bits or 4, quant_group_size=c["group_size"],
                                 zo_clip=self.clip).resolved()
        t0 = time.perf_counter()

        def train(m, lr, seed):
            hist = train_zo(m, tok, self.sp["train_ds"], settings, c["steps"], lr, c["batch"], c["max_length"],
                            self.tmp / f"{name}-{lr:g}-{seed}", seed=seed)
            return [r["loss"] for r in hist]

        if self.long:
            return self._train_cell_by_run(name, model, tok, settings, train, self.grid(method), extend)
        return self._tuned(name, self.grid(method), train, tok, extend, t0, {"settings": settings}, base=model)

    def _tuned(self, name: str, grid: list[float], train, tok, extend: bool, t0: float, extra: dict,
               base=None, make=None) -> dict:
        """``tuned_runs`` over ``grid`` for one cell, saved with ``extra``; ``extend``: only the lrs the saved
        part lacks, merged with it (``merge_sweeps``; the saved seeds are kept)."""
        prev = self.part(name) if extend else None
        seeds = prev["seeds"] if prev else list(range(self.p["cell_seeds"][name]))
        if prev is not None:
            grid = [lr for lr in grid if lr not in prev["lrs"]]
            if not grid:
                return prev
        beat = min(e["val_loss"] for e in prev["sweep"] if e["val_loss"] is not None) if prev else None
        r = tuned_runs(base, grid, seeds, train, lambda m: self.val_loss(m, tok), lambda m: self.test(m, tok),
                       name=name, log=self.log, beat=beat, make=make)
        wall = time.perf_counter() - t0
        if prev is not None:
            r = merge_sweeps(prev, r)
            grid, wall = prev["lrs"] + grid, prev["wall_s"] + wall
        return self.save(name, {**extra, "seeds": seeds, "lrs": sorted(grid), "wall_s": wall, **r})

    def _train_cell_by_run(self, name: str, model, tok, settings: dict, train, grid: list[float],
                           extend: bool) -> dict:
        """The long preset's cell: ``lqzo_long.tuned_runs_by_part``, each (lr, seed) run a part of its own.
        ``extend``: the grid is the saved cell's lrs plus ``grid`` (saved runs are reused either way)."""
        from llmkit.experiments import lqzo_long as LL
        from llmkit.train.lqzo.trainer import zo_trainable

        prev = self.part(name) if extend else None
        grid = sorted(set(grid) | set(prev["lrs"] if prev else ()))
        seeds = list(range(self.p["cell_seeds"][name]))
        names = zo_trainable(model, settings)[0]

        def load(lr, seed):
            return self.store.load(LL.run_name(name, lr, seed))

        def save(lr, seed, rec):
            self.store.save(LL.run_name(name, lr, seed), rec)

        def snap(lr, seed):
            return LL.snapshot_path(self.cache, self.config, name, lr, seed)

        r = LL.tuned_runs_by_part(model, grid, seeds, train, lambda m: self.val_loss(m, tok),
                                  lambda m: self.test(m, tok), load, save,
                                  snapshot=lambda lr, seed, m: LL.save_trained(m, names, snap(lr, seed)),
                                  restore=lambda lr, seed, base: LL.load_trained(base, snap(lr, seed)),
                                  log=self.log, name=name)
        wall = sum(e["train_s"] for e in r["sweep"]) + sum(x["train_s"] for x in r["runs"][1:])
        return self.save(name, {"settings": settings, "seeds": seeds, "lrs": grid, "wall_s": wall, **r})

    def qlora_cell(self, extend: bool = False) -> dict:
        """First-order QLoRA (NF4 base + LoRA, AdamW through TRL) for as many steps as a ZO run makes forward
        passes, its lr chosen on validation from ``p["qlora_lrs"]`` like the ZO cells': the accuracy reference.
        ``before`` is the untrained NF4 model (another quantizer than the ZO cells' INT4)."""
        c = self.config
        prev = self.part("qlora_nf4") if extend else None
        base, tok = qlora_model()
        before = prev["before"] if prev is not None and "before" in prev else self.test(base, tok)
        del base  # each run loads its own (``make``)
        t0 = time.perf_counter()

        def train(m, lr, seed):
            hist = train_qlora(m, tok, self.sp["train_ds"], self.fwd, lr, c["batch"], c["max_length"],
                               self.tmp / f"qlora-{lr:g}-{seed}", seed=seed)
            return [r["loss"] for r in hist]

        return self._tuned("qlora_nf4", sorted(self.p["qlora_lrs"]), train, tok, extend, t0, {"before": before},
                           make=lambda: qlora_model()[0])

    def probes(self) -> dict:
        """Memory and step time, one fresh process per probe."""
        def make():
            c = self.config
            kw = {"bits": 4, "group_size": c["group_size"], "batch_size": c["batch"], "max_length": c["max_length"],
                  "cache_dir": self.cache, "reps": 3 if self.quick else 7}
            memory = {"inference_int4": run_probe("inference", **kw), "lqzo_step_int4": run_probe("lqzo", **kw)}
            try:
                memory["qlora_step_nf4"] = run_probe("qlora", batch_size=c["batch"], max_length=c["max_length"])
            except RuntimeError as e:
                memory["qlora_step_nf4"] = {"error": str(e)[-500:]}
            return memory

        return self.store.memo("probes", make, self.probe_config)

    def estimator(self) -> dict:
        """The estimator-quality table (``llmkit.experiments.lqzo_estimator``) on validation rows."""
        part = self.part("estimator")
        if part is None:
            from llmkit.experiments.lqzo_estimator import bench_table

            table = bench_table(self._load, self.sp["val_rows"][:4], seeds=range(self.estimator_seeds),
                                max_length=self.config["max_length"], log=self.log)
            part = self.save("estimator", table)
        return part

    def cell_line(self, name: str, part: dict, before: dict) -> str:
        """The printed line of a cell: the sweep, the chosen lr and the test figures before -> after."""
        loss, acc = part["test_loss"], part["test_accuracy"]
        sweep = ", ".join(f"{e['lr']:g}: {e['val_loss']:.4f}" if e["val_loss"] is not None else f"{e['lr']:g}: diverged"
                          for e in part["sweep"])
        n = len(part["runs"])
        return (f"{name}: validation loss by lr {{{sweep}}} -> lr {part['best_lr']:g}"
                + (" (edge of the sweep)" if part["best_lr_at_edge"] else "")
                + f"; test loss {before['test']['eval_loss']:.4f} -> {loss['mean']:.4f} +- {loss['std']:.4f}, "
                f"accuracy {before['test']['accuracy']:.3f} -> {acc['mean']:.3f} +- {acc['std']:.3f} "
                f"({n} seed{'s' if n > 1 else ''}, {self.fwd} "
                + ("first-order steps" if name == "qlora_nf4" else "forward passes") + " each)")

    def run(self, only: list[str] | None = None, skip: list[str] = (), extend: bool = False) -> dict:
        """Every cell this invocation needs: run what ``only`` names (all when ``None``), load the rest from
        saved parts. A cell neither run nor saved is absent from ``res["runs"]`` (no summary then)."""
        res: dict = {"model": MODEL, "quick": self.quick, "zo_steps": self.p["steps"],
                     "forward_passes_per_method": self.fwd, "config": self.config, "accuracy_task": "sentiment",
                     "runs": {}}
        if self.long:
            res |= {"long": True, "accuracy_task": "sentiment (training, validation and test)"}
        skip = sorted(set(skip) | set(self.p.get("skip", ())))
        todo = only if only is not None else [c for c in CELLS if c not in skip]
        need = {0, 4, 2} if only is None else {b for b, n in ((0, "fp"), (4, "int4"), (2, "int2")) if n in todo}
        for bits in (0, 4, 2):  # measured where asked (or missing), else read from its saved part
            if bits in need or self.part(f"before_int{bits}" if bits else "before_fp") is not None:
                res[f"int{bits}_before" if bits else "full_precision"] = self.before(bits)
        for name in CELLS:
            if name in skip:
                res["runs"][name] = {"skipped": "left out of this run (--skip)"}
                self.log(f"{name}: skipped (not measured in this run)")
                continue
            # a cell this invocation does not run is still read from its saved part (the summary needs every cell)
            part = None if (extend and name in todo) else self.part(name)
            if part is None and name in todo:
                part = self._run_cell(name, extend)
            if part is None:
                continue
            res["runs"][name] = part
            if "runs" not in part:  # a QLoRA run that failed (its error is the part)
                continue
            if name == "qlora_nf4":
                b = {"test": part["before"]}
            else:
                key = "full_precision" if name == "mezo" else f"int{name[-1]}_before"  # set above when saved
                b = res.get(key) or {"test": {"eval_loss": float("nan"), "accuracy": float("nan")}}
            part["test_loss"], part["test_accuracy"] = (seed_stats(part["runs"], "eval_loss"),
                                                        seed_stats(part["runs"], "accuracy"))
            self.log(self.cell_line(name, part, b))
        if only is not None and "probes" in todo:
            self.probes()
        if (only is None and not self.long) or (only is not None and "estimator" in todo):
            res["estimator_quality"] = self.estimator()
        elif self.part("estimator") is not None:
            res["estimator_quality"] = self.part("estimator")
        return res

    def _run_cell(self, name: str, extend: bool) -> dict:
        if name != "qlora_nf4":
            return self.train_cell(name, extend)
        try:
            return self.qlora_cell(extend)
        except Exception as e:  # noqa: BLE001 - bitsandbytes CPU support varies: report instead of losing the run
            self.log(f"qlora_nf4: failed ({type(e).__name__}: {e})")
            return {"error": f"{type(e).__name__}: {e}"}


def summarize(res: dict, memory: dict, log: Callable[[str], None] = _print) -> dict:
    """The JSON summary of a complete run (every cell present); adds ``memory``, the recovered fractions per
    seed and the LQZO - QZO paired differences to ``res`` and logs one line per figure."""
    inf, lq = memory["inference_int4"], memory["lqzo_step_int4"]
    ql = memory["qlora_step_nf4"] if "peak_bytes" in memory["qlora_step_nf4"] else None
    res["memory"] = memory
    mem_ratio = lq["peak_bytes"] / inf["peak_bytes"]
    time_ratio = lq["step_s"] / lq["two_forward_s"]
    log(f"peak memory: inference {inf['peak_bytes'] / 2**20:.0f} MiB, LQZO step {lq['peak_bytes'] / 2**20:.0f} MiB"
        + (f", QLoRA step {ql['peak_bytes'] / 2**20:.0f} MiB" if ql else "")
        + f"; LQZO / inference = {mem_ratio:.3f} (target <= 1.1)")
    if ql:
        log(f"LQZO / QLoRA peak memory = {lq['peak_bytes'] / ql['peak_bytes']:.3f}")
    log(f"step time: LQZO step / two forwards = {time_ratio:.3f} (target <= 1.2)")
    machinery_ratio = (lq["two_forward_s"] + lq["zo_overhead_s"]) / lq["two_forward_s"]
    log(f"step time from the ZO machinery alone: (two forwards + perturb/restore/update) / two forwards = "
        f"{machinery_ratio:.3f} ({1000 * lq['zo_overhead_s']:.0f} ms per direction)")

    runs = res["runs"]
    fp_loss = res["full_precision"]["test"]["eval_loss"]
    for bits in (4, 2):
        for method in ("qzo", "lqzo"):
            cell = runs[f"{method}_int{bits}"]
            if "runs" not in cell:
                continue
            rec = [recovered_fraction(res[f"int{bits}_before"]["test"]["eval_loss"], r["test"]["eval_loss"], fp_loss)
                   for r in cell["runs"]]
            cell["recovered_fraction_of_quantization_loss"] = rec
            sd = f" +- {100 * statistics.stdev(rec):.1f}%" if len(rec) > 1 else ""
            log(f"INT{bits} {method}: recovered {100 * statistics.fmean(rec):.1f}%{sd} of the quantization loss gap "
                f"(per seed: {', '.join(f'{100 * x:.1f}%' for x in rec)})")
        # the claim is relative: LQZO vs QZO with the same seed (same batches, same test rows)
        lq_cell, qz_cell = runs[f"lqzo_int{bits}"], runs[f"qzo_int{bits}"]
        if "runs" in lq_cell and "runs" in qz_cell:
            d = res[f"paired_lqzo_minus_qzo_int{bits}"] = paired_seed_diff(lq_cell["runs"], qz_cell["runs"])
            log(f"INT{bits} test loss LQZO - QZO, paired by seed: {d['mean']:+.4f} +- {d['std']:.4f} "
                f"(per seed: {', '.join(f'{x:+.4f}' for x in d['diffs'])}; LQZO lower in {d['a_better']} of "
                f"{len(d['diffs'])})")

    def after(cell, key):  # skipped or failed cells have no runs
        return runs[cell][f"test_{key}"]["mean"] if "runs" in runs[cell] else None

    def recovered(cell):
        rec = runs[cell].get("recovered_fraction_of_quantization_loss")
        return sum(rec) / len(rec) if rec else None

    paired2, paired4 = res.get("paired_lqzo_minus_qzo_int2") or {}, res.get("paired_lqzo_minus_qzo_int4") or {}
    return {
        "loss_full_precision": fp_loss,
        "loss_before_int4": res["int4_before"]["test"]["eval_loss"],
        "loss_after_lqzo_int4": after("lqzo_int4", "loss"),
        "loss_after_qzo_int4": after("qzo_int4", "loss"),
        "loss_after_mezo": after("mezo", "loss"),
        "loss_before_int2": res["int2_before"]["test"]["eval_loss"],
        "loss_after_lqzo_int2": after("lqzo_int2", "loss"),
        "loss_after_qzo_int2": after("qzo_int2", "loss"),
        "recovered_fraction_lqzo_int2": recovered("lqzo_int2"),
        "recovered_fraction_qzo_int2": recovered("qzo_int2"),
        "loss_lqzo_minus_qzo_int2": paired2.get("mean"),
        "loss_lqzo_minus_qzo_int2_std": paired2.get("std"),
        "loss_lqzo_minus_qzo_int4": paired4.get("mean"),
        "acc_full_precision": res["full_precision"]["test"]["accuracy"],
        "acc_before_int4": res["int4_before"]["test"]["accuracy"],
        "acc_after_lqzo_int4": after("lqzo_int4", "accuracy"),
        "acc_after_qzo_int4": after("qzo_int4", "accuracy"),
        "acc_before_int2": res["int2_before"]["test"]["accuracy"],
        "acc_after_lqzo_int2": after("lqzo_int2", "accuracy"),
        "acc_after_qzo_int2": after("qzo_int2", "accuracy"),
        "acc_after_mezo": after("mezo", "accuracy"),
        "loss_before_qlora_nf4": runs["qlora_nf4"].get("before", {}).get("eval_loss"),
        "loss_after_qlora_nf4": after("qlora_nf4", "loss"),
        "acc_before_qlora_nf4": runs["qlora_nf4"].get("before", {}).get("accuracy"),
        "acc_after_qlora_nf4": after("qlora_nf4", "accuracy"),
        **{f"lr_{c}": runs[c].get("best_lr") for c in CELLS},
        **{f"seeds_{c}": len(runs[c].get("runs", [])) for c in CELLS},
        "lr_at_edge": [c for c in CELLS if runs[c].get("best_lr_at_edge")],
        "skipped": [c for c in CELLS if "skipped" in runs[c]],
        "mem_ratio_vs_inference": mem_ratio,
        "mem_ratio_vs_qlora": lq["peak_bytes"] / ql["peak_bytes"] if ql else None,
        "step_time_ratio_vs_2fwd": time_ratio,
        "step_time_ratio_from_zo_overhead": machinery_ratio,
        "forward_passes_per_method": res["forward_passes_per_method"],
        **(res.get("estimator_quality") or {}).get("keys", {}),
    }


def plot(res: dict, path: str | Path) -> None:
    """Train loss at the chosen lr, the validation sweep, and test loss before / after per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in CELLS if c != "qlora_nf4" and "sweep" in res["runs"].get(c, {})]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.2))
    for name in cells:  # train loss of the chosen lr, first seed
        ys = res["runs"][name]["runs"][0]["train_loss"]
        w = min(8, len(ys))
        avg = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
        a.plot(range(1, len(ys) + 1), avg, label=f"{name} (lr {res['runs'][name]['best_lr']:g})", linewidth=1)
    a.set_xlabel("ZO step")
    a.set_ylabel("train loss, running mean of 8 steps")
    a.set_yscale("log")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    for name in cells:  # the lr sweep on validation
        sw = [e for e in res["runs"][name]["sweep"] if e["val_loss"] is not None]
        b.plot([e["lr"] for e in sw], [e["val_loss"] for e in sw], marker="o", label=name)
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("learning rate")
    b.set_ylabel("validation loss (held-out sentiment rows)" if res.get("long")
                 else "validation loss (held-out GSM8K train rows)")
    b.legend(fontsize=7)
    b.grid(alpha=0.3)
    before = [(res["full_precision"] if n == "mezo" else res[f"int{n[-1]}_before"])["test"]["eval_loss"] for n in cells]
    after = [res["runs"][n]["test_loss"]["mean"] for n in cells]
    err = [res["runs"][n]["test_loss"]["std"] for n in cells]
    x = range(len(cells))
    c.bar([i - 0.2 for i in x], before, 0.4, label="before")
    c.bar([i + 0.2 for i in x], after, 0.4, yerr=err, capsize=3, label="after (mean +- std over seeds)")
    c.axhline(res["full_precision"]["test"]["eval_loss"], color="gray", linestyle="--", linewidth=1,
              label="full precision")
    c.set_xticks(list(x), cells, rotation=30, fontsize=8)
    c.set_ylabel(f"held-out {'sentiment' if res.get('long') else 'GSM8K'} test completion loss")
    c.legend(fontsize=7)
    fig.suptitle(f"LQZO bench: {res['forward_passes_per_method']} forward passes per run, lr tuned per method on "
                 "validation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
