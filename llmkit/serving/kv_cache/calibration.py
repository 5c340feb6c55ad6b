"""InQuant calibration: channel saliency and attention-score weights from a short pass over text.

Paper: "InQuant: in-place mixed-precision KV-cache quantization" (NeurIPS 2026) estimates channel saliency by
sampling. The first pass sampled one chunk of each prompt; this module adds the calibrated
variant: run the model once over a few calibration texts and keep, per layer and kv-head,

- ``sal_k``/``sal_v`` ``[H, D]``: each channel's range (max - min) per text, averaged over texts,
  the first ``skip`` tokens left out (the attention-sink token's keys are extreme in channels that
  are ordinary everywhere else);
- ``mag_k``/``mag_v`` ``[H, D]``: the per-token-layout saliency (largest deviation from the
  token's median channel, ``inquant.token_saliency``) per text, averaged over texts;
- ``mean_k``/``mean_v`` ``[H, D]``: channel means (the per-token layout reads donors back as these);
- ``w_k`` ``[H, D, D]``: ``E[q q^T]`` of the (rotated) queries that read kv-head ``h`` (all query
  heads of its group), so ``e^T w_k e`` is the expected squared error of an attention logit
  ``q.k`` caused by a key error ``e``: the score gate's criterion for keys;
- ``w_v`` ``[H, D, D]``: ``sum_j W_j^T W_j`` over the output projection's column blocks of the
  query heads in the group, so ``e^T w_v e`` is the squared error a value error ``e`` adds to the
  attention output after ``o_proj`` (per unit attention weight);
- ``sample_k``/``sample_v`` ``[H, S, D]`` (fp16): ``S`` calibration tokens the gate measures on.

Descriptors for any (gate, layout, n_outliers) are derived from these on demand and cached; the
file is a safetensors file, by default beside the model's own files
(``<model folder>/kv_cache/inquant_calibration.safetensors``) or under ``$LLMKIT_HOME/kv_calibration/``
for hub ids. Deviation: queries are captured through a registered attention function that
records them and runs SDPA, so the model must use transformers' attention interface (all
current decoder families do).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from llmkit.serving.kv_cache.inquant import Descriptor, gated_descriptor, token_saliency

FILENAME = "inquant_calibration.safetensors"
# The cache settings a calibration is saved with when none are given, and so what serve builds:
# per-token key/value groups (tokens stored on arrival, no full-precision window; with shared calibrated
# descriptors the rows of a running batch can merge), the per-head attention-score gate, 4 outlier slots
# per kv-head. Serving reads them back from the file. How they compare with the other layouts and gates:
# bench/results/kv_cache.md.
SERVE_DEFAULTS = {"layout": "per-token", "gate": "score", "n_outliers": 4, "group_size": 128}
_FIELDS = ("sal_k", "sal_v", "mag_k", "mag_v", "mean_k", "mean_v", "w_k", "w_v", "sample_k", "sample_v")


def default_calibration_path(model) -> Path:
    """Where a model's calibration lives: beside its files when it was loaded from a folder."""
    from llmkit.models import llmkit_home

    name = getattr(model.config, "_name_or_path", "") or "model"
    if Path(name).is_dir():  # a subfolder: the model folder's own *.safetensors glob must not see it
        return Path(name) / "kv_cache" / FILENAME
    return llmkit_home() / "kv_calibration" / (re.sub(r"[^A-Za-z0-9_.-]+", "--", name) + ".safetensors")


class InQuantCalibration:
    """Per-layer calibration statistics (see the module docstring) and the descriptors they give."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], meta: dict | None = None):
        for i, layer in enumerate(layers):
            missing = [f for f in _FIELDS if f not in layer]
            if missing:
                raise ValueError(f"calibration layer {i} lacks {', '.join(missing)}")
        self.layers = layers
        self.meta = dict(meta or {})
        self._desc: dict = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def cache_settings(self) -> dict:
        """The ``InQuantCache`` settings saved with this calibration (``SERVE_DEFAULTS`` where the file
        names none, e.g. one written by ``bench/kv_cache.py``)."""
        return SERVE_DEFAULTS | dict(self.meta.get("cache") or {})

    def descriptor(self, layer: int, which: str, n_outliers: int = 4, max_stride: int = 8, gate: str = "score",
                   layout: str = "per-channel", group_size: int = 128, min_ratio: float = 15.0) -> Descriptor:
        """The descriptor of ``layer``'s keys (``which="k"``) or values (``"v"``), cached."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"calibration has {self.num_layers} layers, asked for layer {layer}")
        if which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")
        key = (layer, which, n_outliers, max_stride, gate, layout, group_size, min_ratio)
        if key not in self._desc:
            st = self.layers[layer]
            sal = st[f"mag_{which}"] if layout == "per-token" else st[f"sal_{which}"]
            self._desc[key] = gated_descriptor(
                sal, n_outliers, max_stride, gate, min_ratio,
                x=st[f"sample_{which}"].float()[None], weight=st[f"w_{which}"], layout=layout,
                group_size=group_size, mean=st[f"mean_{which}"])
        return self._desc[key]

    # -- files ----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"{i}.{f}": t.contiguous() for i, layer in enumerate(self.layers) for f, t in layer.items()}
        save_file(tensors, str(path), metadata={"inquant_calibration": json.dumps(self.meta | {"layers": self.num_layers})})
        return path

    @classmethod
    def load(cls, path: str | Path) -> InQuantCalibration:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"InQuant calibration file not found: {path} (make one with "
                                    "llmkit.serving.kv_cache.calibrate(model, texts, tokenizer).save(path))")
        with safe_open(str(path), framework="pt") as f:
            meta_s = (f.metadata() or {}).get("inquant_calibration")
            if meta_s is None:
                raise ValueError(f"{path} is not an InQuant calibration file (no 'inquant_calibration' metadata)")
            meta = json.loads(meta_s)
            layers = [{fld: f.get_tensor(f"{i}.{fld}") for fld in _FIELDS} for i in range(meta["layers"])]
        return cls(layers, meta)


_TEXT_FIELDS = (("text",), ("question", "answer"), ("problem", "solution"), ("prompt", "completion"))


def read_calibration_texts(path: str | Path, tokenizer, n_texts: int = 16, max_len: int = 512,
                           start: int = 0) -> list[str]:
    """``n_texts`` calibration texts of up to about ``max_len`` tokens from a user file.

    ``.jsonl``: one record per line, read from record ``start`` on; a record's text is its ``text``
    field, or ``question``+``answer`` (GSM8K), ``problem``+``solution`` (MATH-500) or
    ``prompt``+``completion``, written ``"Question: ...\nAnswer: ...\n\n"``-style. Consecutive
    records are packed into one text until it reaches ``max_len`` tokens. Any other file is plain
    text, cut into consecutive pieces of ``max_len`` tokens. Fewer texts than asked is not an
    error (short files give what they have); no text at all is.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration data file not found: {path}")
    if n_texts < 1 or max_len < 2:
        raise ValueError(f"need n_texts >= 1 and max_len >= 2, got {n_texts} and {max_len}")
    texts: list[str] = []
    if path.suffix == ".jsonl":
        cur, cur_len = "", 0
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip() or lineno <= start:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
            fields = next((f for f in _TEXT_FIELDS if isinstance(rec, dict) and all(
                isinstance(rec.get(k), str) for k in f)), None)
            if fields is None:
                raise ValueError(f"{path}:{lineno}: a record needs a 'text' field or question/answer, "
                                 "problem/solution or prompt/completion fields")
            part = rec["text"] + "\n\n" if fields == ("text",) else \
                f"{fields[0].capitalize()}: {rec[fields[0]]}\n{fields[1].capitalize()}: {rec[fields[1]]}\n\n"
            cur += part
            cur_len += len(tokenizer(part, add_special_tokens=False).input_ids)
            if cur_len >= max_len:
                texts.append(cur)
                cur, cur_len = "", 0
                if len(texts) == n_texts:
                    break
        if cur and len(texts) < n_texts:
            texts.append(cur)
    else:
        ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        texts = [tokenizer.decode(ids[i:i + max_len]) for i in range(0, len(ids), max_len)][:n_texts]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"{path}: no calibration text in it")
    return texts


class _QueryCapture:
    """Registers an attention function that accumulates ``sum q q^T`` per (layer, kv-head) and
    runs SDPA; switched on by pointing ``config._attn_implementation`` at it."""

    NAME = "llmkit_inquant_calibration"

    def __init__(self, skip: int):
        self.skip = skip
        self.qq: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}
        self.modules: dict[int, torch.nn.Module] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        i = module.layer_idx
        B, Hq, _, D = query.shape
        Hk = key.shape[1]
        q = query[:, :, self.skip:].float().reshape(B, Hk, Hq // Hk, -1, D)
        acc = torch.einsum("bhgtd,bhgte->hde", q, q)
        self.qq[i] = self.qq.get(i, 0) + acc
        self.count[i] = self.count.get(i, 0) + B * (Hq // Hk) * q.shape[3]
        self.modules[i] = module
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


@torch.inference_mode()
def calibrate(model, texts, tokenizer=None, max_len: int = 512, sample_tokens: int = 512,
              skip: int = 1) -> InQuantCalibration:
    """One pass of ``model`` over ``texts`` (strings, with ``tokenizer``, or token-id sequences),
    each cut to ``max_len`` tokens; see the module docstring for what is kept."""
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seqs = []
    for t in texts:
        if isinstance(t, str):
            if tokenizer is None:
                raise ValueError("calibrate: texts are strings, so a tokenizer is needed")
            ids = tokenizer(t, return_tensors="pt").input_ids
        else:
            ids = torch.as_tensor(t).view(1, -1)
        if ids.shape[1] > skip + 1:
            seqs.append(ids[:, :max_len])
    if not seqs:
        raise ValueError(f"calibrate: no text has more than {skip + 1} tokens")
    cap = _QueryCapture(skip)
    ALL_ATTENTION_FUNCTIONS.register(_QueryCapture.NAME, cap)
    config = model.config
    old_impl = config._attn_implementation
    device = next(model.parameters()).device
    per_layer: dict[int, dict[str, list]] = {}
    try:
        config._attn_implementation = _QueryCapture.NAME
        for ids in seqs:
            cache = DynamicCache(config=config)
            model(ids.to(device), past_key_values=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                st = per_layer.setdefault(i, {"k": [], "v": []})
                for which, x in (("k", layer.keys), ("v", layer.values)):
                    st[which].append(x[0, :, skip:].float().cpu())  # [H, T, D]
    finally:
        config._attn_implementation = old_impl
    layers = []
    for i in sorted(per_layer):
        st = per_layer[i]
        out: dict[str, torch.Tensor] = {}
        for which in ("k", "v"):
            xs = st[which]
            out[f"sal_{which}"] = torch.stack([x.amax(1) - x.amin(1) for x in xs]).mean(0)
            out[f"mag_{which}"] = torch.stack([token_saliency(x[None], n_samples=x.shape[1]) for x in xs]).mean(0)
            allx = torch.cat(xs, dim=1)
            out[f"mean_{which}"] = allx.mean(1)
            out[f"sample_{which}"] = allx[:, :sample_tokens].to(torch.float16).contiguous()
        if i not in cap.qq:
            raise RuntimeError(f"layer {i}: no queries were captured (does the model use transformers' "
                               "attention interface?)")
        out["w_k"] = (cap.qq[i] / cap.count[i]).cpu()
        H, D = out["sal_k"].shape
        W = cap.modules[i].o_proj.weight.detach().float().cpu()  # [hidden, Hq * D]
        Hq = W.shape[1] // D
        blocks = W.view(W.shape[0], Hq, D).permute(1, 0, 2)  # [Hq, hidden, D]
        wv = torch.einsum("jod,joe->jde", blocks, blocks)
        out["w_v"] = wv.view(H, Hq // H, D, D).sum(1)
        layers.append(out)
    meta = {"model": getattr(config, "_name_or_path", ""), "texts": len(seqs),
            "tokens": int(sum(s.shape[1] for s in seqs)), "max_len": max_len, "skip": skip}
    return InQuantCalibration(layers, meta)
