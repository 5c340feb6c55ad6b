"""LQZO bench: MeZO (full precision), QZO and LQZO at INT4 and INT2, and first-order QLoRA, on the bundled model.

    python bench/lqzo.py --quick      # a few ZO steps per method; ends with one JSON line
    python bench/lqzo.py              # more steps, more eval rows

Every ZO method gets the same number of forward passes (steps x 2q) on the same data (GSM8K train
solutions interleaved with the procedural sentiment task, see llmkit/train/lqzo/task.py for why that
task); QLoRA gets the same number of forward passes too (each with a backward). Reported: completion
loss on held-out GSM8K test solutions and two-choice accuracy on held-out sentiment problems, before and
after; peak memory of an LQZO step vs a forward of the same batch vs a QLoRA step (fresh process per
probe); LQZO step time vs two forwards. Writes bench/results/lqzo.json (lqzo_quick.json for --quick) and
a PNG.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Skip(Exception):
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="ZO steps per method (quick 4, full 40)")
    ap.add_argument("--lr", type=float, default=2e-3, help="ZO step size for the scales (relative)")
    ap.add_argument("--mezo-lr", type=float, default=1e-6, help="MeZO step size (raw weights)")
    ap.add_argument("--qlora-lr", type=float, default=2e-4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--skip-qlora", action="store_true", help="leave out the QLoRA training run (its memory probe stays)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "llmkit-lqzo-bench"))
    args = ap.parse_args()
    steps = args.steps or (2 if args.quick else 40)
    n_eval, n_acc, n_train = (4, 24, 32) if args.quick else (32, 100, 400)

    import torch

    torch.manual_seed(0)
    from llmkit.train.lqzo import benchlib as B
    from llmkit.train.lqzo.config import LQZOArguments
    from llmkit.train.lqzo.recipe import load_data

    data = ROOT.parent / "shared" / "data" / "gsm8k"
    zargs = LQZOArguments(dataset_name=str(data / "train.jsonl"), max_train_samples=n_train // 2,
                          task_train_samples=n_train // 2, eval_data=str(data / "test.jsonl"),
                          max_eval_samples=n_eval, accuracy_samples=n_acc)
    train_ds, _, eval_rows, acc_rows = load_data(zargs, seed=0)
    fwd = steps * 2  # q = 1
    res: dict = {"model": B.MODEL, "quick": args.quick, "zo_steps": steps, "forward_passes_per_method": fwd,
                 "batch": args.batch, "max_length": args.max_length, "group_size": args.group_size,
                 "lr_scales": args.lr, "lr_mezo": args.mezo_lr, "lr_qlora": args.qlora_lr,
                 "eval_rows": n_eval, "accuracy_rows": n_acc, "accuracy_task": "sentiment", "runs": {}}
    tmp = Path(tempfile.mkdtemp(prefix="lqzo-bench-"))
    curves = {}

    def record(name, before, after, hist, wall):
        res["runs"][name] = {"before": before, "after": after, "wall_s": wall,
                             "train_loss": [r["loss"] for r in hist]}
        curves[name] = [r["loss"] for r in hist]
        print(f"{name}: eval_loss {before.get('eval_loss', float('nan')):.4f} -> {after['eval_loss']:.4f}, "
              f"accuracy {before.get('accuracy', float('nan')):.3f} -> {after['accuracy']:.3f} "
              f"({fwd} forward passes, {wall:.0f} s)", flush=True)

    def measure(model, tok):
        return B.measure(model, tok, eval_rows, acc_rows, max_length=256, batch_size=8)

    # full precision: reference loss, then MeZO
    model, tok = B.load_model(0, args.group_size)
    fp = measure(model, tok)
    res["full_precision"] = fp
    print(f"full precision: eval_loss {fp['eval_loss']:.4f}, accuracy {fp['accuracy']:.3f}", flush=True)
    t0 = time.perf_counter()
    hist = B.train_zo(model, tok, train_ds, LQZOArguments(zo_method="mezo").resolved(), steps, args.mezo_lr,
                      args.batch, args.max_length, tmp / "mezo")
    record("mezo", fp, measure(model, tok), hist, time.perf_counter() - t0)
    del model

    for bits in (4, 2):
        base, tok = B.load_model(bits, args.group_size, args.cache)
        before = measure(base, tok)
        res[f"int{bits}_before"] = before
        print(f"INT{bits} quantized: eval_loss {before['eval_loss']:.4f}, accuracy {before['accuracy']:.3f}",
              flush=True)
        for method in ("qzo", "lqzo"):
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            settings = LQZOArguments(zo_method=method, quant_bits=bits, quant_group_size=args.group_size).resolved()
            hist = B.train_zo(model, tok, train_ds, settings, steps, args.lr, args.batch, args.max_length,
                              tmp / f"{method}{bits}")
            record(f"{method}_int{bits}", before, measure(model, tok), hist, time.perf_counter() - t0)
            del model
        del base

    # first-order QLoRA (bitsandbytes NF4 + LoRA), same forward passes
    if args.skip_qlora:
        res["runs"]["qlora_nf4"] = {"skipped": "--skip-qlora"}
    try:
        if args.skip_qlora:
            raise _Skip
        model, tok = B.qlora_model()
        before = measure(model, tok)
        t0 = time.perf_counter()
        hist = B.train_qlora(model, tok, train_ds, fwd, args.qlora_lr, args.batch, args.max_length, tmp / "qlora")
        record("qlora_nf4", before, measure(model, tok), hist, time.perf_counter() - t0)
        del model
    except _Skip:
        pass
    except Exception as e:  # noqa: BLE001 -- bitsandbytes CPU support varies; report instead of losing the run
        res["runs"]["qlora_nf4"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"qlora_nf4: failed ({type(e).__name__}: {e})", flush=True)

    # memory and step time, one fresh process per probe
    kw = {"bits": 4, "group_size": args.group_size, "batch_size": args.batch, "max_length": args.max_length,
          "cache_dir": args.cache}
    inf = B.run_probe("inference", **kw)
    lq = B.run_probe("lqzo", **kw)
    res["memory"] = {"inference_int4": inf, "lqzo_step_int4": lq}
    try:
        ql = B.run_probe("qlora", batch_size=args.batch, max_length=args.max_length)
        res["memory"]["qlora_step_nf4"] = ql
    except RuntimeError as e:
        ql = None
        res["memory"]["qlora_step_nf4"] = {"error": str(e)[-500:]}
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

    # INT2 recovery: the fraction of the quantization loss gap each method closes
    for bits in (4, 2):
        gap = res[f"int{bits}_before"]["eval_loss"] - fp["eval_loss"]
        for method in ("qzo", "lqzo"):
            after = res["runs"][f"{method}_int{bits}"]["after"]["eval_loss"]
            rec = (res[f"int{bits}_before"]["eval_loss"] - after) / gap if gap > 0 else float("nan")
            res["runs"][f"{method}_int{bits}"]["recovered_fraction_of_quantization_loss"] = rec
            print(f"INT{bits} {method}: recovered {100 * rec:.1f}% of the quantization loss gap", flush=True)

    summary = {
        "loss_full_precision": fp["eval_loss"],
        "loss_before_int4": res["int4_before"]["eval_loss"],
        "loss_after_lqzo_int4": res["runs"]["lqzo_int4"]["after"]["eval_loss"],
        "loss_after_qzo_int4": res["runs"]["qzo_int4"]["after"]["eval_loss"],
        "loss_after_mezo": res["runs"]["mezo"]["after"]["eval_loss"],
        "loss_before_int2": res["int2_before"]["eval_loss"],
        "loss_after_lqzo_int2": res["runs"]["lqzo_int2"]["after"]["eval_loss"],
        "loss_after_qzo_int2": res["runs"]["qzo_int2"]["after"]["eval_loss"],
        "acc_before_int4": res["int4_before"]["accuracy"],
        "acc_after_lqzo_int4": res["runs"]["lqzo_int4"]["after"]["accuracy"],
        "acc_after_qzo_int4": res["runs"]["qzo_int4"]["after"]["accuracy"],
        "acc_before_int2": res["int2_before"]["accuracy"],
        "acc_after_lqzo_int2": res["runs"]["lqzo_int2"]["after"]["accuracy"],
        "acc_after_qzo_int2": res["runs"]["qzo_int2"]["after"]["accuracy"],
        "acc_after_mezo": res["runs"]["mezo"]["after"]["accuracy"],
        "mem_ratio_vs_inference": mem_ratio,
        "mem_ratio_vs_qlora": lq["peak_bytes"] / ql["peak_bytes"] if ql else None,
        "step_time_ratio_vs_2fwd": time_ratio,
        "step_time_ratio_from_zo_overhead": machinery_ratio,
        "forward_passes_per_method": fwd,
    }
    res["summary"] = summary
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "lqzo_quick" if args.quick else "lqzo"
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    _plot(res, curves, out_dir / f"{stem}.png")
    print(json.dumps(summary), flush=True)
    return 0


def _plot(res, curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, ys in curves.items():
        a.plot(range(1, len(ys) + 1), ys, marker=".", label=name)
    a.set_xlabel("step")
    a.set_ylabel("train loss (mean of the two perturbed forwards)")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    names = [n for n in res["runs"] if "after" in res["runs"][n]]
    before = [res["runs"][n]["before"]["eval_loss"] for n in names]
    after = [res["runs"][n]["after"]["eval_loss"] for n in names]
    x = range(len(names))
    b.bar([i - 0.2 for i in x], before, 0.4, label="before")
    b.bar([i + 0.2 for i in x], after, 0.4, label="after")
    b.axhline(res["full_precision"]["eval_loss"], color="gray", linestyle="--", linewidth=1, label="full precision")
    b.set_xticks(list(x), names, rotation=30, fontsize=8)
    b.set_ylabel("held-out GSM8K completion loss")
    b.legend(fontsize=7)
    fig.suptitle(f"LQZO bench ({res['forward_passes_per_method']} forward passes per method)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
