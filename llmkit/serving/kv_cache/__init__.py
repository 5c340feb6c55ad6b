"""Quantized KV caches for transformers ``generate``: InQuant and its baselines.

``InQuantCache(model.config)`` (InQuant, in-place mixed-precision KV-cache quantization, NeurIPS 2026), ``KIVICache``
(uniform 4-bit) and ``OutlierBufferCache`` (dense-and-sparse, KVQuant-style) are transformers
``Cache`` objects: pass one as ``past_key_values=`` to ``model.generate``. ``cache_factory(name)``
gives the serving engine a ``(model) -> Cache`` callable per name (``None`` = transformers' default
dynamic cache). ``cache.nbytes()`` reports the bytes each cache actually holds.
"""

from __future__ import annotations

import functools
from pathlib import Path

from transformers.cache_utils import Cache

from llmkit.serving.kv_cache.calibration import (
    SERVE_DEFAULTS,
    InQuantCalibration,
    calibrate,
    default_calibration_path,
    read_calibration_texts,
)
from llmkit.serving.kv_cache.inquant import (
    LAYOUTS,
    Descriptor,
    assign_donors,
    estimate_descriptor,
    gated_descriptor,
    sample_saliency,
    select_outliers,
)
from llmkit.serving.kv_cache.layers import InQuantLayer, InQuantTokenLayer, KIVILayer, OutlierBufferLayer

DEFAULT_NAMES = ("none", "bf16", "dynamic")


def _num_layers(config) -> int:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention"}:
        raise ValueError(f"quantized KV caches support full-attention layers only, got {sorted(kinds)}")
    return text.num_hidden_layers


class QuantizedKVCache(Cache):
    """A ``Cache`` of windowed quantized layers, with memory accounting and ``flush``."""

    def __init__(self, config, layer_fn):
        super().__init__(layers=[layer_fn(i) for i in range(_num_layers(config))])

    def flush(self) -> None:
        """Quantize every layer's full-precision window now."""
        for layer in self.layers:
            layer.flush()

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind (packed, scales, descriptors, outliers, window) plus ``total``."""
        out: dict[str, int] = {}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                out[k] = out.get(k, 0) + v
        out["total"] = sum(out.values())
        return out

    def bf16_nbytes(self) -> int:
        """What a bf16 cache would hold for the same tokens (2 bytes per K and V element)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, _, D = layer.keys.shape
                total += 2 * 2 * B * H * D * layer.get_seq_length()
        return total


class InQuantCache(QuantizedKVCache):
    """InQuant 4-bit packed cache with in-place 8-bit outlier channels (see ``inquant.py``).

    ``layout``: ``"per-channel"`` (keys and values grouped per channel over ``group_size`` tokens,
    a full-precision window of up to ``group_size`` tokens) or ``"per-token"`` (per-token groups,
    no window). ``calibration``: an ``InQuantCalibration`` or the path of a saved one (calibrated
    saliency and the score gate's weights); without it saliency is sampled from the first chunk.
    ``gate``: ``"score"`` (per head, attention-score error; the default with a calibration),
    ``"ratio"`` (the first pass's gate: a pair is kept only where the outlier's range exceeds
    ``min_ratio`` x its donor's, one count for all heads; the default without a calibration) or
    ``"off"`` (every candidate pair kept, the paper's unconditional reuse). ``keep_dequantized``
    (per-token layout only): keep a dequantized copy of the store so decode does not read the whole
    store back every step, at the memory of an unquantized cache (see ``InQuantTokenLayer``).
    """

    def __init__(self, config, group_size: int = 128, n_outliers: int = 4, max_stride: int = 8,
                 n_samples: int = 64, seed: int = 0, backend: str = "auto", min_ratio: float = 15.0,
                 gate: str | None = None, layout: str = "per-channel", calibration=None,
                 keep_dequantized: bool = False):
        if isinstance(calibration, (str, Path)):
            calibration = _load_calibration(str(calibration))
        if gate is None:
            gate = "score" if calibration is not None else "ratio"
        if layout not in LAYOUTS:
            raise ValueError(f"unknown InQuant layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
        n_layers = _num_layers(config)
        if calibration is not None and calibration.num_layers != n_layers:
            raise ValueError(f"the InQuant calibration has {calibration.num_layers} layers, the model {n_layers}")
        if keep_dequantized and layout != "per-token":
            raise ValueError("keep_dequantized needs layout='per-token' (per-channel groups keep a "
                             "full-precision window instead)")
        extra = {"keep_dequantized": True} if keep_dequantized else {}
        cls = InQuantTokenLayer if layout == "per-token" else InQuantLayer
        self.n_outliers, self.layout, self.gate, self.calibration = n_outliers, layout, gate, calibration
        super().__init__(config, lambda i: cls(group_size, n_outliers, max_stride, n_samples, seed, backend,
                                               min_ratio, gate, calibration, i, **extra))

    @property
    def rows_mergeable(self) -> bool:
        """Rows can be cut, padded and merged between caches (continuous batching): per-token groups
        with calibrated descriptors, which are the same in every cache made from the calibration."""
        return self.layout == "per-token" and self.calibration is not None

    def outlier_pairs(self) -> dict[str, int]:
        """(outlier, donor) pairs the descriptors use, summed over layers and kv-heads, per side,
        and how many were possible (``n_outliers`` per kv-head, layer and side)."""
        out = {"k": 0, "v": 0, "possible": 0}
        for layer in self.layers:
            for which, d in layer.descriptors.items():
                out[which] += int(d.pairs_per_head.sum())
                out["possible"] += layer.n_outliers * d.outliers.shape[0]
        return out


def _load_calibration(path: str):
    """Load once per file version (a recalibrated file, newer mtime, is read again)."""
    p = Path(path)
    return _load_calibration_at(path, p.stat().st_mtime_ns if p.is_file() else None)


@functools.lru_cache(maxsize=8)
def _load_calibration_at(path: str, mtime_ns):
    return InQuantCalibration.load(path)


class KIVICache(QuantizedKVCache):
    """KIVI-style uniform 4-bit cache (keys per channel, values per token)."""

    def __init__(self, config, group_size: int = 128):
        super().__init__(config, lambda i: KIVILayer(group_size))


class OutlierBufferCache(QuantizedKVCache):
    """Dense-and-sparse 4-bit cache with a separate fp16 outlier buffer (KVQuant-style)."""

    def __init__(self, config, group_size: int = 128, outlier_frac: float = 0.01):
        super().__init__(config, lambda i: OutlierBufferLayer(group_size, outlier_frac))


CACHES = {"inquant": InQuantCache, "kivi": KIVICache, "outlier-buffer": OutlierBufferCache}


def cache_factory(name: str | None, **kwargs):
    """``(model) -> Cache`` for a quantized cache name, or ``None`` for transformers' default cache."""
    if name is None or name.lower() in DEFAULT_NAMES:
        return None
    key = name.lower()
    if key not in CACHES:
        choices = ", ".join([*CACHES, *DEFAULT_NAMES])
        raise ValueError(f"unknown KV cache {name!r}; choose one of: {choices}")
    cls = CACHES[key]
    if isinstance(kwargs.get("calibration"), (str, Path)):  # load once, not per batch
        kwargs["calibration"] = _load_calibration(str(kwargs["calibration"]))
    return lambda model: cls(model.config, **kwargs)


def inquant_serving_factory(model, calibration: str | Path | None = None):
    """The InQuant cache a server should use for ``model``: ``(factory, message)``.

    With a calibration (an ``InQuantCalibration``, the file ``calibration`` names, else the model's default path,
    ``default_calibration_path(model)``, where ``llmkit kv calibrate`` saves it): the settings saved
    with it (by default per-token groups + the attention-score gate), calibrated saliency and
    descriptors shared by every cache, so requests are batched continuously. Without one: the
    uncalibrated per-channel cache (saliency sampled from each batch's prompt, the ratio gate,
    static batching), and the message says so and how to calibrate. A ``calibration`` path that
    does not exist is an error (``FileNotFoundError``), not a silent fallback.
    """
    if isinstance(calibration, InQuantCalibration):  # already loaded (the bench's own)
        cal, path = calibration, calibration.meta.get("path", "memory")
    else:
        if calibration is not None and not Path(calibration).is_file():
            raise FileNotFoundError(f"InQuant calibration file not found: {calibration}")
        path = Path(calibration) if calibration is not None else default_calibration_path(model)
        cal = _load_calibration(str(path)) if path.is_file() else None
    if cal is None:
        msg = (f"InQuant: no calibration for this model at {path}: using the uncalibrated per-channel cache "
               "(saliency sampled from each batch's prompt, ratio gate, static batching). Run `llmkit kv calibrate "
               "--model <model>` once for the calibrated per-token/score cache with continuous batching.")
        return cache_factory("inquant"), msg
    n_layers = _num_layers(model.config)
    if cal.num_layers != n_layers:
        raise ValueError(f"the InQuant calibration {path} has {cal.num_layers} layers, the model {n_layers} "
                         "(it was made for another model; recalibrate with `llmkit kv calibrate`)")
    settings = cal.cache_settings
    factory = cache_factory("inquant", calibration=cal, **settings)
    mode = "continuous batching" if factory(model).rows_mergeable else "static batching"
    msg = (f"InQuant: calibrated from {path} ({cal.meta.get('texts', '?')} texts, {cal.meta.get('tokens', '?')} "
           f"tokens): {settings['layout']} groups, {settings['gate']} gate, {settings['n_outliers']} outlier slots "
           f"per kv-head, {mode}")
    return factory, msg


__all__ = [
    "CACHES",
    "SERVE_DEFAULTS",
    "Descriptor",
    "InQuantCache",
    "InQuantCalibration",
    "KIVICache",
    "OutlierBufferCache",
    "QuantizedKVCache",
    "assign_donors",
    "cache_factory",
    "calibrate",
    "default_calibration_path",
    "estimate_descriptor",
    "gated_descriptor",
    "inquant_serving_factory",
    "read_calibration_texts",
    "sample_saliency",
    "select_outliers",
]
