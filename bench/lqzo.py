"""LQZO bench: MeZO (full precision), QZO and LQZO at INT4 and INT2, and first-order QLoRA, on the bundled model.

    python bench/lqzo.py --quick      # 40 ZO steps per run, lr swept per method, 3 seeds at INT2; ends with one JSON line
    python bench/lqzo.py              # 200 steps, 3 seeds everywhere, more validation / test rows

A fair comparison at an equal budget: every ZO run gets the same number of forward passes (steps x 2)
on the same data (GSM8K train solutions interleaved with the procedural sentiment task, see
llmkit/train/lqzo/task.py for why that task). Each method (and bit-width) gets its OWN learning rate,
chosen from a small sweep (``--lr-sweep`` for the scale-training methods, ``--mezo-lr-sweep`` for MeZO
on raw weights) by the completion loss on validation problems (GSM8K *train* problems never trained
on); the chosen lr is then rerun for each of ``--seeds`` seeds, and only the test figures are reported:
completion loss on held-out GSM8K *test* solutions and two-choice accuracy on held-out sentiment
problems (``llmkit.train.lqzo.benchlib.tuned_runs``). Also: peak memory of an LQZO step vs a forward of
the same batch vs a QLoRA step (fresh process per probe); LQZO step time vs two forwards.

Each run cell (mezo, qzo_int4, lqzo_int4, qzo_int2, lqzo_int2, qlora_nf4) is saved to
bench/results/lqzo[_quick]_parts/<cell>.json as soon as it finishes and reused by later invocations with
the same configuration (``--only`` trains a subset, e.g. in two processes; ``--fresh`` ignores saved
parts). Writes bench/results/lqzo.json (lqzo_quick.json for --quick) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CELLS = ("mezo", "qzo_int4", "lqzo_int4", "qzo_int2", "lqzo_int2", "qlora_nf4")
# other pieces --only can name: the untrained metrics per precision, the memory / step-time probes
PIECES = ("fp", "int4", "int2", "probes", "estimator")


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"learning rates must be positive, got {text!r}")
    return vals


def _cells(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in CELLS + PIECES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown cell(s) {', '.join(bad)}; choose from {', '.join(CELLS + PIECES)}")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="ZO steps per run (quick 40, full 200)")
    ap.add_argument("--lr-sweep", type=_floats, default=None,
                    help="comma-separated ZO step sizes for the scales (relative), swept per method and bit-width "
                         "(quick 6.25e-5,2.5e-4,1e-3; full 6.25e-5,2.5e-4,1e-3,4e-3)")
    ap.add_argument("--mezo-lr-sweep", type=_floats, default=None,
                    help="comma-separated MeZO step sizes (raw weights; quick 5e-7,2e-6; full 3e-7,1e-6,3e-6)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds per cell at the chosen lr, all cells (default: full 3; quick 3 for the INT2 cells, "
                         "whose comparison is the paper's claim, 1 for INT4 and MeZO (a MeZO step costs ~3x))")
    ap.add_argument("--clip", type=float, default=None, help="clip each projected derivative to [-c, c] (all methods)")
    ap.add_argument("--qlora-lr", type=float, default=2e-4)
    ap.add_argument("--batch", type=int, default=None, help="training batch (quick 2, full 4)")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--only", type=_cells, default=None,
                    help=f"run only these pieces now (comma-separated from {', '.join(CELLS + PIECES)}: fp/int4/int2 are "
                         "the untrained metrics, probes the memory/time probes); the rest must be saved parts, "
                         "else the summary is not written")
    ap.add_argument("--fresh", action="store_true", help="ignore saved parts")
    ap.add_argument("--extend", action="store_true",
                    help="for the cells in --only that have a saved part: run only the --lr-sweep values it lacks and "
                         "merge (the best lr over both sweeps is reported; it is tested only if it is a new one)")
    ap.add_argument("--skip-qlora", action="store_true", help="leave out the QLoRA training run (its memory probe stays)")
    ap.add_argument("--skip", type=_cells, default=[],
                    help="run cells to leave out of this result (recorded as skipped, their summary keys null)")
    ap.add_argument("--estimator-seeds", type=int, default=None,
                    help="draws of the directions per variant in the estimator-quality table (quick 6, full 16)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "llmkit-lqzo-bench"))
    args = ap.parse_args()
    if args.skip_qlora:
        args.skip = sorted(set(args.skip) | {"qlora_nf4"})
    # --quick is sized for ~60 single-threaded CPU slot-minutes (measured on 2 quiet cores, one thread each: a
    # scale-ZO step ~2.5 s at batch 2 x 128, a full-precision MeZO step ~7 s (it draws 135M Gaussians 4x per
    # step), a completion-loss eval ~1.6 s per GSM8K row); the full run is for a GPU
    steps = args.steps or (40 if args.quick else 200)
    lrs = args.lr_sweep or ([6.25e-5, 2.5e-4, 1e-3] if args.quick else [6.25e-5, 2.5e-4, 1e-3, 4e-3])
    mezo_lrs = args.mezo_lr_sweep or ([5e-7, 2e-6] if args.quick else [3e-7, 1e-6, 3e-6])
    if args.seeds is not None:
        cell_seeds = dict.fromkeys(CELLS, args.seeds)
    elif args.quick:
        cell_seeds = {"mezo": 1, "qzo_int4": 1, "lqzo_int4": 1, "qzo_int2": 3, "lqzo_int2": 3}
    else:
        cell_seeds = dict.fromkeys(CELLS, 3)
    args.batch = args.batch or (2 if args.quick else 4)
    if steps < 1 or min(cell_seeds.values()) < 1 or args.batch < 1:
        ap.error("--steps, --seeds and --batch must be >= 1")
    # n_val 12 / n_test 24 (was 8 / 12): the INT2 methods differ by ~0.05 nats, and the lr choice and the test
    # figure should not hinge on a handful of problems (more is not cheap here: ~1.6 s per row per eval)
    n_val, n_test, n_acc, n_train = (12, 24, 24, 400) if args.quick else (32, 64, 200, 1000)

    import torch

    torch.manual_seed(0)
    from llmkit.train.lqzo import benchlib as B
    from llmkit.train.lqzo.config import LQZOArguments

    stem = "lqzo_quick" if args.quick else "lqzo"
    out_dir = ROOT / "bench" / "results"
    parts = out_dir / f"{stem}_parts"
    parts.mkdir(parents=True, exist_ok=True)
    # what must match for a saved part to be reused; seeds and lr grids may differ per cell (the part records them)
    config = {"model": B.MODEL, "steps": steps, "clip": args.clip,
              "batch": args.batch, "max_length": args.max_length, "group_size": args.group_size,
              "qlora_lr": args.qlora_lr, "n_train": n_train, "n_val": n_val, "n_test": n_test, "n_acc": n_acc}
    sp = B.bench_splits(n_train, n_val, n_test, n_acc, seed=0, data_dir=ROOT.parent / "shared" / "data" / "gsm8k")
    fwd = steps * 2  # q = 1
    tmp = Path(tempfile.mkdtemp(prefix="lqzo-bench-"))

    # the untrained models' metrics depend on the data and the quantizer only
    data_config = {k: config[k] for k in ("model", "max_length", "group_size", "n_train", "n_val", "n_test", "n_acc")}

    def load_part(name):
        f = parts / f"{name}.json"
        if args.fresh or not f.is_file():
            return None
        part = json.loads(f.read_text())
        return part if part.get("config") == (data_config if name.startswith("before") else config) else None

    def save_part(name, body):
        body = {"config": data_config if name.startswith("before") else config, **body}
        (parts / f"{name}.json").write_text(json.dumps(body, indent=1) + "\n")
        return body

    def val_fn(model, tok):
        from llmkit.train.common import completion_loss

        return completion_loss(model, tok, sp["val_rows"], max_length=256, batch_size=8)

    def test_fn(model, tok):
        return B.measure(model, tok, sp["test_rows"], sp["test_acc_rows"], max_length=256, batch_size=8)

    def before(bits):  # val + test metrics of the untrained model at this bit-width (0: full precision)
        name = f"before_int{bits}" if bits else "before_fp"
        part = load_part(name)
        if part is None:
            model, tok = B.load_model(bits, args.group_size, args.cache if bits else None)
            part = save_part(name, {"val_loss": val_fn(model, tok), "test": test_fn(model, tok)})
            del model
        t = part["test"]
        label = f"INT{bits} quantized" if bits else "full precision"
        print(f"{label}: test loss {t['eval_loss']:.4f}, "
              f"accuracy {t['accuracy']:.3f} (validation loss {part['val_loss']:.4f})", flush=True)
        return part

    def train_cell(name):
        method, _, b = name.partition("_int")
        bits = int(b) if b else 0
        model, tok = B.load_model(bits, args.group_size, args.cache if bits else None)
        settings = LQZOArguments(zo_method=method, quant_bits=bits or 4, quant_group_size=args.group_size,
                                 zo_clip=args.clip).resolved()
        t0 = time.perf_counter()

        def train(m, lr, seed):
            hist = B.train_zo(m, tok, sp["train_ds"], settings, steps, lr, args.batch, args.max_length,
                              tmp / f"{name}-{lr:g}-{seed}", seed=seed)
            return [r["loss"] for r in hist]

        grid = mezo_lrs if method == "mezo" else lrs
        seeds = list(range(cell_seeds[name]))
        prev = load_part(name) if args.extend else None
        if prev is not None:
            grid = [lr for lr in grid if lr not in prev["lrs"]]
            if not grid:
                return prev
        beat = min(e["val_loss"] for e in prev["sweep"] if e["val_loss"] is not None) if prev else None
        r = B.tuned_runs(model, grid, seeds if prev is None else prev["seeds"], train, lambda m: val_fn(m, tok),
                         lambda m: test_fn(m, tok), name=name, log=lambda msg: print(msg, flush=True), beat=beat)
        wall = time.perf_counter() - t0
        if prev is not None:
            r = B.merge_sweeps(prev, r)
            grid, wall = prev["lrs"] + grid, prev["wall_s"] + wall
        return save_part(name, {"settings": settings, "seeds": seeds if prev is None else prev["seeds"],
                                "lrs": sorted(grid), "wall_s": wall, **r})

    def qlora_cell():
        model, tok = B.qlora_model()
        b = test_fn(model, tok)
        t0 = time.perf_counter()
        hist = B.train_qlora(model, tok, sp["train_ds"], fwd, args.qlora_lr, args.batch, args.max_length,
                             tmp / "qlora")
        return save_part("qlora_nf4", {"before": b, "after": test_fn(model, tok), "lr": args.qlora_lr,
                                       "train_loss": [r["loss"] for r in hist], "wall_s": time.perf_counter() - t0})

    def probes():  # memory and step time, one fresh process per probe
        probe_config = {k: config[k] for k in ("model", "batch", "max_length", "group_size")}
        f = parts / "probes.json"
        if not args.fresh and f.is_file() and json.loads(f.read_text()).get("config") == probe_config:
            return json.loads(f.read_text())["memory"]
        kw = {"bits": 4, "group_size": args.group_size, "batch_size": args.batch, "max_length": args.max_length,
              "cache_dir": args.cache, "reps": 3 if args.quick else 7}
        memory = {"inference_int4": B.run_probe("inference", **kw), "lqzo_step_int4": B.run_probe("lqzo", **kw)}
        try:
            memory["qlora_step_nf4"] = B.run_probe("qlora", batch_size=args.batch, max_length=args.max_length)
        except RuntimeError as e:
            memory["qlora_step_nf4"] = {"error": str(e)[-500:]}
        f.write_text(json.dumps({"config": probe_config, "memory": memory}, indent=1) + "\n")
        return memory

    def estimator():  # the estimator-quality table (llmkit.experiments.lqzo_estimator): seconds per estimate
        part = load_part("estimator")
        if part is None:
            from llmkit.experiments.lqzo_estimator import bench_table

            n = args.estimator_seeds or (6 if args.quick else 16)
            table = bench_table(lambda bits: B.load_model(bits, args.group_size, args.cache), sp["val_rows"][:4],
                                seeds=range(n), max_length=args.max_length, log=lambda m: print(m, flush=True))
            part = save_part("estimator", table)
        return part

    res: dict = {"model": B.MODEL, "quick": args.quick, "zo_steps": steps, "forward_passes_per_method": fwd,
                 "config": config, "accuracy_task": "sentiment", "runs": {}}
    todo = args.only if args.only is not None else [c for c in CELLS if c not in args.skip]
    # the untrained metrics this invocation needs (all of them when it writes the summary)
    need = {0, 4, 2} if args.only is None else {b for b, n in ((0, "fp"), (4, "int4"), (2, "int2")) if n in todo}
    for bits in (0, 4, 2):
        if bits in need:
            res[f"int{bits}_before" if bits else "full_precision"] = before(bits)
    for name in CELLS:
        if name in args.skip:
            res["runs"][name] = {"skipped": "left out of this run (--skip)"}
            print(f"{name}: skipped (not measured in this run)", flush=True)
            continue
        if args.only is not None and name not in todo:
            continue
        part = None if (args.extend and name in todo) else load_part(name)
        if part is None and name in todo:
            try:
                part = qlora_cell() if name == "qlora_nf4" else train_cell(name)
            except Exception as e:  # bitsandbytes CPU support varies: report instead of losing the run
                if name != "qlora_nf4":
                    raise
                part = {"error": f"{type(e).__name__}: {e}"}
                print(f"qlora_nf4: failed ({type(e).__name__}: {e})", flush=True)
        if part is None:
            continue
        res["runs"][name] = part
        if name == "qlora_nf4":
            if "after" in part:
                print(f"qlora_nf4 (first order, lr {part['lr']:g}, {fwd} steps): test loss "
                      f"{part['before']['eval_loss']:.4f} -> {part['after']['eval_loss']:.4f}, accuracy "
                      f"{part['before']['accuracy']:.3f} -> {part['after']['accuracy']:.3f}", flush=True)
            continue
        key, piece = ("full_precision", "before_fp") if name == "mezo" else (f"int{name[-1]}_before",
                                                                              f"before_int{name[-1]}")
        b = res.get(key) or load_part(piece) or {"test": {"eval_loss": float("nan"), "accuracy": float("nan")}}
        loss, acc = B.seed_stats(part["runs"], "eval_loss"), B.seed_stats(part["runs"], "accuracy")
        sweep = ", ".join(f"{e['lr']:g}: {e['val_loss']:.4f}" if e["val_loss"] is not None else f"{e['lr']:g}: diverged"
                          for e in part["sweep"])
        print(f"{name}: validation loss by lr {{{sweep}}} -> lr {part['best_lr']:g}"
              + (" (edge of the sweep)" if part["best_lr_at_edge"] else "")
              + f"; test loss {b['test']['eval_loss']:.4f} -> {loss['mean']:.4f} +- {loss['std']:.4f}, accuracy "
              f"{b['test']['accuracy']:.3f} -> {acc['mean']:.3f} +- {acc['std']:.3f} ({len(part['runs'])} seed{'s' if len(part['runs']) > 1 else ''}, "
              f"{fwd} forward passes each)", flush=True)
        part["test_loss"], part["test_accuracy"] = loss, acc
    if args.only is not None and "probes" in todo:
        probes()
    if args.only is None or "estimator" in todo:
        res["estimator_quality"] = estimator()
    elif load_part("estimator") is not None:
        res["estimator_quality"] = load_part("estimator")
    missing = [c for c in CELLS if c not in res["runs"]]
    if missing:
        print(f"saved parts in {parts}; still missing: {', '.join(missing)} (summary not written)", flush=True)
        return 0

    memory = probes()
    inf, lq = memory["inference_int4"], memory["lqzo_step_int4"]
    ql = memory["qlora_step_nf4"] if "peak_bytes" in memory["qlora_step_nf4"] else None
    res["memory"] = memory
    mem_ratio = lq["peak_bytes"] / inf["peak_bytes"]
    time_ratio = lq["step_s"] / lq["two_forward_s"]
    print(f"peak memory: inference {inf['peak_bytes'] / 2**20:.0f} MiB, LQZO step {lq['peak_bytes'] / 2**20:.0f} MiB"
          + (f", QLoRA step {ql['peak_bytes'] / 2**20:.0f} MiB" if ql else "")
          + f"; LQZO / inference = {mem_ratio:.3f} (target <= 1.1)", flush=True)
    if ql:
        print(f"LQZO / QLoRA peak memory = {lq['peak_bytes'] / ql['peak_bytes']:.3f}", flush=True)
    print(f"step time: LQZO step / two forwards = {time_ratio:.3f} (target <= 1.2)", flush=True)
    machinery_ratio = (lq["two_forward_s"] + lq["zo_overhead_s"]) / lq["two_forward_s"]
    print(f"step time from the ZO machinery alone: (two forwards + perturb/restore/update) / two forwards = "
          f"{machinery_ratio:.3f} ({1000 * lq['zo_overhead_s']:.0f} ms per direction)", flush=True)

    # the fraction of the quantization loss gap each method closes (test loss, mean over seeds)
    fp_loss = res["full_precision"]["test"]["eval_loss"]
    for bits in (4, 2):
        for method in ("qzo", "lqzo"):
            cell = res["runs"][f"{method}_int{bits}"]
            if "runs" not in cell:
                continue
            rec = [B.recovered_fraction(res[f"int{bits}_before"]["test"]["eval_loss"], r["test"]["eval_loss"], fp_loss)
                   for r in cell["runs"]]
            cell["recovered_fraction_of_quantization_loss"] = rec
            sd = f" +- {100 * statistics.stdev(rec):.1f}%" if len(rec) > 1 else ""
            print(f"INT{bits} {method}: recovered {100 * statistics.fmean(rec):.1f}%{sd} of the quantization loss gap "
                  f"(per seed: {', '.join(f'{100 * x:.1f}%' for x in rec)})", flush=True)
        # the claim is relative: LQZO vs QZO with the same seed (same batches, same test rows)
        lq_cell, qz_cell = res["runs"][f"lqzo_int{bits}"], res["runs"][f"qzo_int{bits}"]
        if "runs" in lq_cell and "runs" in qz_cell:
            d = B.paired_seed_diff(lq_cell["runs"], qz_cell["runs"])
            res[f"paired_lqzo_minus_qzo_int{bits}"] = d
            print(f"INT{bits} test loss LQZO - QZO, paired by seed: {d['mean']:+.4f} +- {d['std']:.4f} "
                  f"(per seed: {', '.join(f'{x:+.4f}' for x in d['diffs'])}; LQZO lower in {d['a_better']} of "
                  f"{len(d['diffs'])})", flush=True)

    def after(cell, key):
        return res["runs"][cell][f"test_{key}"]["mean"] if "runs" in res["runs"][cell] else None

    def recovered(cell):
        rec = res["runs"][cell].get("recovered_fraction_of_quantization_loss")
        return sum(rec) / len(rec) if rec else None

    summary = {
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
        "loss_lqzo_minus_qzo_int2": (res.get("paired_lqzo_minus_qzo_int2") or {}).get("mean"),
        "loss_lqzo_minus_qzo_int2_std": (res.get("paired_lqzo_minus_qzo_int2") or {}).get("std"),
        "loss_lqzo_minus_qzo_int4": (res.get("paired_lqzo_minus_qzo_int4") or {}).get("mean"),
        "acc_full_precision": res["full_precision"]["test"]["accuracy"],
        "acc_before_int4": res["int4_before"]["test"]["accuracy"],
        "acc_after_lqzo_int4": after("lqzo_int4", "accuracy"),
        "acc_after_qzo_int4": after("qzo_int4", "accuracy"),
        "acc_before_int2": res["int2_before"]["test"]["accuracy"],
        "acc_after_lqzo_int2": after("lqzo_int2", "accuracy"),
        "acc_after_qzo_int2": after("qzo_int2", "accuracy"),
        "acc_after_mezo": after("mezo", "accuracy"),
        **{f"lr_{c}": res["runs"][c].get("best_lr") for c in CELLS if c != "qlora_nf4"},
        **{f"seeds_{c}": len(res["runs"][c].get("runs", [])) for c in CELLS if c != "qlora_nf4"},
        "skipped": [c for c in CELLS if "skipped" in res["runs"][c]],
        "mem_ratio_vs_inference": mem_ratio,
        "mem_ratio_vs_qlora": lq["peak_bytes"] / ql["peak_bytes"] if ql else None,
        "step_time_ratio_vs_2fwd": time_ratio,
        "step_time_ratio_from_zo_overhead": machinery_ratio,
        "forward_passes_per_method": fwd,
        **(res.get("estimator_quality") or {}).get("keys", {}),
    }
    res["summary"] = summary
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    _plot(res, out_dir / f"{stem}.png")
    print(json.dumps(summary), flush=True)
    return 0


def _plot(res, path):
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
    b.set_ylabel("validation loss (held-out GSM8K train rows)")
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
    c.set_ylabel("held-out GSM8K test completion loss")
    c.legend(fontsize=7)
    fig.suptitle(f"LQZO bench: {res['forward_passes_per_method']} forward passes per run, lr tuned per method on "
                 "validation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
