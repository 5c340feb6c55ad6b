"""The frame every training recipe shares: parse, resume, resolved config, plots, results JSON.

A recipe (``llmkit/train/<method>/recipe.py``) is its method between these steps:

* ``parse_args(config_classes, argv, prog)``: TRL's ``TrlParser`` over the recipe's config dataclasses, so
  ``--config x.yaml`` and ``--key value`` both work; parse errors are one line.
* ``RecipeRun(name, training_args, *configs)``: the output folder and whether this process is the main one
  (under ``accelerate launch`` side work runs on process 0); it decides where training resumes
  (``resolve_resume``) and, on the main process, writes the resolved config (``resolved_config.yaml``, which
  ``--config`` accepts back, and the same values as ``resolved_config.json``).
* ``run.callbacks()`` logs every Trainer record to ``metrics.jsonl``; ``run.train(trainer)`` trains from the
  resume point (a checkpoint that already reached ``max_steps`` is loaded, not trained further) and times it;
  ``run.write_results(name, dict)`` writes the results JSON; ``run.plot_loss`` / ``run.plot_rewards`` draw the
  curves from ``metrics.jsonl``.

Resuming: rerunning the same command with the same ``output_dir`` continues from its last ``checkpoint-*``
(TRL's scripts make the user pass ``--resume_from_checkpoint``; a rerun that silently starts over and overwrites
the checkpoints loses work). ``--resume_from_checkpoint PATH`` picks a checkpoint, ``true`` / ``last`` demand the
last one, ``false`` starts over; a named checkpoint that does not exist is an error naming it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from llmkit.train.common import (
    MetricsJsonlCallback,
    plot_curves,
    plot_metrics_file,
    resolved_config,
    save_resolved_config,
)

METRICS_FILE = "metrics.jsonl"
LAST = ("true", "last", "latest")
FRESH = ("false", "no", "none", "never")


def _user_error(message: str) -> Exception:
    from llmkit.cli import UserError

    return UserError(message)


def parse_args(config_classes: Sequence[type], argv: list[str], prog: str) -> tuple:
    """The config dataclasses filled from ``--config FILE`` (YAML) and ``--key value`` overrides."""
    from trl import TrlParser

    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv) and not Path(argv[i + 1]).is_file():
            raise _user_error(f"config file not found: {argv[i + 1]}")
    parser = TrlParser(tuple(config_classes), prog=prog)

    def one_line_error(message):  # the CLI's contract: one line, exit code 2
        parser.exit(2, f"{prog}: error: {message}\n")

    parser.error = one_line_error
    try:
        return tuple(parser.parse_args_and_config(args=argv))
    except ValueError as e:  # unknown YAML keys and bad values surface as ValueError
        raise _user_error(str(e)) from None


def last_checkpoint(output_dir: str | Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    out = Path(output_dir)
    return get_last_checkpoint(str(out)) if out.is_dir() else None


def resolve_resume(value, output_dir: str | Path, announce: bool = True) -> str | None:
    """The checkpoint folder to resume from, or None to start fresh.

    ``value`` is ``resume_from_checkpoint`` as configured: unset -> the last ``checkpoint-*`` in ``output_dir``
    if any; ``true``/``last``/``latest`` -> that one, which must exist; ``false``/``no``/``none`` -> fresh;
    anything else -> a checkpoint folder, which must exist."""
    text = "" if value is None else str(value).strip()
    if text.lower() in FRESH:
        return None
    if not text or text.lower() in LAST:
        chosen = last_checkpoint(output_dir)
        if chosen is None and text:
            raise _user_error(f"resume_from_checkpoint {text}: no checkpoint-* folder in {output_dir}")
    else:
        path = Path(text).expanduser()
        if not path.is_dir():
            raise _user_error(f"resume_from_checkpoint: checkpoint not found: {path}")
        chosen = str(path)
    if chosen and announce:
        print(f"resuming from {chosen}", flush=True)
    return chosen


def plot_reward_curves(metrics: str | Path, png: str | Path, title: str, keys: Sequence[str] = (),
                       ylabel: str = "reward") -> Path | None:
    """``keys`` and every per-reward mean (``rewards/<f>/mean``) of a ``metrics.jsonl`` against step, one curve
    each (labelled without the ``rewards/`` and ``/mean`` wrapping); None when nothing was logged."""
    metrics = Path(metrics)
    if not metrics.is_file():
        return None
    series: dict[str, tuple[list, list]] = {k: ([], []) for k in keys}
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        per_reward = [k for k in rec if k.startswith("rewards/") and k.endswith("/mean")]
        for k in list(keys) + per_reward:
            if isinstance(rec.get(k), (int, float)) and "step" in rec:
                xs, ys = series.setdefault(k, ([], []))
                xs.append(rec["step"])
                ys.append(rec[k])
    series = {k.removeprefix("rewards/").removesuffix("/mean"): v for k, v in series.items() if v[0]}
    return plot_curves(series, png, title=title, ylabel=ylabel) if series else None


class RecipeRun:
    """One invocation of a recipe. Creating it picks the resume point (an error for a missing checkpoint comes
    before any model is loaded) and, on the main process, creates ``output_dir`` and saves the resolved config.

    ``configs``: every parsed config dataclass of the recipe (``training_args`` among them or not: it is saved
    either way), merged into one resolved config."""

    def __init__(self, name: str, training_args, *configs, save_config: bool = True):
        self.name = name
        self.args = training_args
        self.configs = configs if any(c is training_args for c in configs) else (training_args, *configs)
        self.out = Path(training_args.output_dir)
        self.is_main = getattr(training_args, "process_index", 0) == 0
        self.metrics = self.out / METRICS_FILE
        self.resume = resolve_resume(getattr(training_args, "resume_from_checkpoint", None), self.out,
                                     announce=self.is_main)
        self.train_seconds = 0.0
        self.config_path: Path | None = None
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if save_config:
                self.config_path = self.save_config()

    def save_config(self) -> Path:
        """``resolved_config.yaml`` (accepted back by ``--config``) and ``resolved_config.json`` (same values)."""
        path = save_resolved_config(self.out, *self.configs)
        resolved = resolved_config(*self.configs)
        path.with_suffix(".json").write_text(json.dumps(resolved, indent=2, sort_keys=True) + "\n")
        return path

    def log(self, message: str) -> None:
        if self.is_main:
            print(f"[{self.name}] {message}", flush=True)

    def callbacks(self) -> list:
        return [MetricsJsonlCallback(self.metrics)]

    def train(self, trainer):
        """``trainer.train`` from the resume point; the seconds it took are in ``train_seconds``."""
        start = time.perf_counter()
        result = self._load_finished(trainer)
        if result is None:
            result = trainer.train(resume_from_checkpoint=self.resume)
        self.train_seconds = time.perf_counter() - start
        return result

    def _load_finished(self, trainer):
        """A resume checkpoint that already reached ``max_steps``: its weights and state loaded, no step taken.

        The Trainer checks the step budget only after a step, so resuming a finished run would train one step past
        it whenever the checkpoint falls inside an epoch. None when there is something left to train (or under
        DeepSpeed/FSDP, which load checkpoints inside the training loop)."""
        from transformers.trainer_callback import TrainerState
        from transformers.trainer_utils import TrainOutput

        max_steps = trainer.args.max_steps
        state_file = Path(self.resume or "") / "trainer_state.json"
        if not self.resume or max_steps <= 0 or not state_file.is_file() or trainer.is_deepspeed_enabled \
                or trainer.is_fsdp_enabled:
            return None
        state = TrainerState.load_from_json(str(state_file))
        if state.global_step < max_steps:
            return None
        trainer._load_from_checkpoint(self.resume)
        trainer.state = state
        self.log(f"{self.resume} already reached max_steps {max_steps}: nothing left to train")
        losses = [r["loss"] for r in state.log_history if isinstance(r.get("loss"), (int, float))]
        return TrainOutput(state.global_step, sum(losses) / len(losses) if losses else float("nan"), {})

    def write_results(self, filename: str, results: dict) -> Path:
        path = self.out / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        return path

    def plot_loss(self, title: str, filename: str = "loss_curve.png",
                  keys: tuple[str, ...] = ("loss", "eval_loss")) -> Path | None:
        return plot_metrics_file(self.metrics, self.out / filename, keys=keys, title=title)

    def plot_rewards(self, title: str, keys: Sequence[str] = (), ylabel: str = "reward",
                     filename: str = "reward_curves.png") -> Path | None:
        return plot_reward_curves(self.metrics, self.out / filename, title, keys, ylabel=ylabel)
