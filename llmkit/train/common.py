"""Helpers every training recipe needs: data, held-out loss, resolved config, metrics log, loss plots.

* ``load_records(path_or_id, split, name, limit)``: rows from a local JSONL/JSON
  file (bad lines are reported as ``file:line``) or a Hugging Face dataset id.
* ``chat_dataset(records, fmt)``: question/answer-like rows -> TRL's
  conversational ``prompt``/``completion`` (SFT, completion-only loss) or
  ``messages`` (GKD's ChatML collator). Field names are detected
  (question/answer as in GSM8K, problem/solution as in MATH-500,
  prompt/completion, instruction/output) or given explicitly.
* ``completion_loss(model, tok, records, ...)``: mean per-token NLL of the
  completions given their chat prompts -- a held-out / forgetting measure
  that does not depend on the trainer's own loss.
* ``resolved_config(*configs)`` / ``save_resolved_config(output_dir, *configs)``: the parsed dataclasses
  merged into one dict / written as YAML (``llmkit.train.skeleton`` also writes it as JSON).
* ``wait_for_everyone()``: a barrier across the processes of an ``accelerate launch`` run (a no-op in
  one process); recipes do side work (evaluations, plots, results files) on the main process
  (``training_args.process_index == 0``) and let the others wait for what it writes.
* ``MetricsJsonlCallback``: every Trainer log line appended to ``metrics.jsonl``.
* ``plot_curves`` / ``plot_metrics_file``: matplotlib PNGs of curves / of a ``metrics.jsonl``'s losses.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

FIELD_PAIRS = (("question", "answer"), ("problem", "solution"), ("prompt", "completion"),
               ("instruction", "output"), ("input", "output"))


@dataclass
class TrainDataArguments:
    """The training-data fields the SFT-style recipes share (TRL's ScriptArguments names, and the older llmkit
    names that ``apply_deprecated_fields`` maps onto them)."""

    dataset_name: str = field(default="openai/gsm8k", metadata={
        "help": "training data (TRL's ScriptArguments name): a local JSONL/JSON file or a Hugging Face dataset "
                "id (question/answer, problem/solution, prompt/completion or messages rows)"})
    dataset_config: str | None = field(default=None, metadata={
        "help": "dataset config name for hub ids (unset: 'main' for openai/gsm8k, else none)"})
    dataset_train_split: str = field(default="train", metadata={"help": "split for hub datasets"})
    train_data: str | None = field(default=None, metadata={"help": "deprecated: use dataset_name"})
    train_data_config: str | None = field(default=None, metadata={"help": "deprecated: use dataset_config"})
    train_split: str | None = field(default=None, metadata={"help": "deprecated: use dataset_train_split"})
    max_train_samples: int | None = field(default=None, metadata={"help": "use only the first N training rows"})


def apply_deprecated_fields(cfg, renames: dict[str, str]) -> None:
    """Move values given under an old config field name to its new name, with a deprecation message.

    The old fields stay in the dataclass (default ``None``) so old YAML files still parse; a value set
    under both names is an error rather than a silent choice.
    """
    import warnings

    for old, new in renames.items():
        value = getattr(cfg, old, None)
        if value is None:
            continue
        default = next((f.default for f in dataclasses.fields(cfg) if f.name == new), None)
        if getattr(cfg, new) not in (default, value):
            raise ValueError(f"both '{old}' (deprecated) and '{new}' are set; keep only '{new}'")
        warnings.warn(f"config field '{old}' is deprecated: use '{new}' (TRL's ScriptArguments name)",
                      FutureWarning, stacklevel=3)
        print(f"[llmkit] config field '{old}' is deprecated; use '{new}'", flush=True)
        setattr(cfg, new, value)
        setattr(cfg, old, None)


class DataError(ValueError):
    """Unreadable or unusable training data; the message names the file (and line)."""


def load_records(path_or_id: str, split: str = "train", name: str | None = None,
                 limit: int | None = None) -> list[dict]:
    p = Path(path_or_id).expanduser()
    if p.suffix in (".jsonl", ".json") or p.exists():
        if not p.is_file():
            raise DataError(f"data file not found: {p}")
        rows: list[dict] = []
        if p.suffix == ".json":
            try:
                data = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
            rows = data if isinstance(data, list) else data.get(split, data.get("data", []))
        else:
            with p.open() as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{p}:{i}: not valid JSON ({e.msg})") from None
                    if not isinstance(row, dict):
                        raise DataError(f"{p}:{i}: expected a JSON object per line")
                    rows.append(row)
                    if limit is not None and len(rows) >= limit:
                        break
        return rows[:limit] if limit is not None else rows
    from datasets import load_dataset

    try:
        ds = load_dataset(path_or_id, name, split=split)
    except Exception as e:  # noqa: BLE001 -- hub errors come in many types; the user needs id and reason
        raise DataError(f"could not load dataset {path_or_id!r} (split {split!r}): {e}") from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [dict(r) for r in ds]


def detect_fields(row: dict, where: str = "data") -> tuple[str, str]:
    for a, b in FIELD_PAIRS:
        if a in row and b in row:
            return a, b
    raise DataError(f"{where}: rows need one of the field pairs "
                    + ", ".join(f"{a}/{b}" for a, b in FIELD_PAIRS) + f" (or 'messages'); got {sorted(row)}")


def chat_dataset(records: list[dict], fmt: str = "prompt_completion", fields: tuple[str, str] | None = None,
                 where: str = "data"):
    """``fmt``: 'prompt_completion' (SFTTrainer, loss on the answer only) or 'messages' (GKD collator)."""
    from datasets import Dataset

    if not records:
        raise DataError(f"{where}: no rows")
    out = []
    for i, r in enumerate(records):
        if "messages" in r and fields is None:
            msgs = r["messages"]
            if fmt == "messages":
                out.append({"messages": msgs})
            else:
                out.append({"prompt": msgs[:-1], "completion": msgs[-1:]})
            continue
        q, a = fields or detect_fields(r, where)
        if q not in r or a not in r:
            raise DataError(f"{where}: row {i + 1} lacks '{q}' or '{a}'")
        user = [{"role": "user", "content": str(r[q])}]
        assistant = [{"role": "assistant", "content": str(r[a])}]
        out.append({"messages": user + assistant} if fmt == "messages" else {"prompt": user, "completion": assistant})
    return Dataset.from_list(out)


def _prompt_and_completion(tok, row: dict) -> tuple[str, str]:
    if "messages" in row:
        msgs = row["messages"]
        return (tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True),
                msgs[-1]["content"])
    q, a = detect_fields(row)
    return tok.apply_chat_template([{"role": "user", "content": str(row[q])}], tokenize=False,
                                   add_generation_prompt=True), str(row[a])


@torch.no_grad()
def completion_loss(model, tok, records: Iterable[dict], max_length: int = 512, batch_size: int = 8) -> float:
    """Mean NLL per completion token (prompt tokens are context only); right-truncated to max_length."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    seqs = []
    for r in records:
        prompt, completion = _prompt_and_completion(tok, r)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tok(completion, add_special_tokens=False)["input_ids"]
        if tok.eos_token_id is not None:
            c_ids = c_ids + [tok.eos_token_id]
        ids = (p_ids + c_ids)[:max_length]
        labels = ([-100] * len(p_ids) + c_ids)[:max_length]
        if any(x != -100 for x in labels[1:]):
            seqs.append((ids, labels))
    total, count = 0.0, 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for i in range(0, len(seqs), batch_size):
        batch = seqs[i:i + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch], device=device)
        attn = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch], device=device)
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch], device=device)
        logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1].float()
        target = labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                ignore_index=-100, reduction="sum")
        total += nll.item()
        count += int((target != -100).sum())
    if was_training:
        model.train()
    return total / count if count else math.nan


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(getattr(v, "value", v))  # enums, paths, dtypes


def resolved_config(*configs) -> dict[str, Any]:
    """Every parsed config dataclass merged into one plain dict (field -> value), secrets left out."""
    merged: dict[str, Any] = {}
    for cfg in configs:
        # TrainingArguments.to_dict() also turns enums into strings and hides the hub token
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else _plain(cfg)
        merged.update({k: _plain(v) for k, v in d.items() if not k.startswith("_")})
    merged.pop("push_to_hub_token", None)
    merged.pop("hub_token", None)
    return merged


def save_resolved_config(output_dir: str | Path, *configs, filename: str = "resolved_config.yaml") -> Path:
    """Write every parsed config dataclass (field -> value, merged) as YAML that ``--config`` accepts back."""
    import yaml

    path = Path(output_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved_config(*configs), sort_keys=True))
    return path


def wait_for_everyone() -> None:
    """Block until every process of the run gets here (``accelerate launch`` / torchrun); no-op in one process."""
    from accelerate import PartialState

    PartialState().wait_for_everyone()


class MetricsJsonlCallback(TrainerCallback):
    """Append each Trainer log record (with its step) to a JSONL file, on the main process only."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kw):
        if not state.is_world_process_zero or not logs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rec = {"step": state.global_step, **{k: _plain(v) for k, v in logs.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def plot_curves(series: dict[str, tuple[list[float], list[float]]], path: str | Path, title: str = "",
                xlabel: str = "step", ylabel: str = "loss", hline: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=name)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay out, write (creating the folder) and close ``fig``; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_metrics_file(jsonl: str | Path, png: str | Path, keys: tuple[str, ...] = ("loss", "eval_loss"),
                      title: str = "") -> Path | None:
    """Plot the given keys of a ``metrics.jsonl`` against step; None when nothing was logged."""
    jsonl = Path(jsonl)
    if not jsonl.is_file():
        return None
    series: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in keys}
    for line in jsonl.read_text().splitlines():
        rec = json.loads(line)
        for k in keys:
            if isinstance(rec.get(k), (int, float)):
                series[k][0].append(rec["step"])
                series[k][1].append(rec[k])
    if not any(xs for xs, _ in series.values()):
        return None
    return plot_curves(series, png, title=title)
