"""The :class:`Guard`: fit on compliant responses, save/load, check and correct responses."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from llmkit.serving.guard import score as S
from llmkit.serving.guard.capture import Capture, capture, default_layers
from llmkit.serving.guard.manifold import Manifold
from llmkit.serving.guard.probe import LinearProbe

FORMAT_VERSION = 1
META_FILE = "guard.json"
TENSORS_FILE = "guard.safetensors"

# one transformers copy per model name for engines that do not expose their weights (vLLM)
_TF_MODELS: dict[str, tuple] = {}


def same_model(a: str, b: str) -> bool:
    """Whether two model names denote the same weights (an alias and its cached folder match)."""
    if a == b:
        return True
    from llmkit.models import resolve

    try:
        ra, rb = Path(resolve(a)), Path(resolve(b))
    except (ValueError, OSError):
        return False
    if ra.exists() and rb.exists():
        return ra.resolve() == rb.resolve()
    return str(ra) == str(rb)


def engine_model(engine):
    """(model, tokenizer) of transformers weights equal to the engine's, for the teacher-forced pass."""
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        return model, engine.tokenizer
    name = engine.model_name
    if name not in _TF_MODELS:
        from llmkit.models import load

        _TF_MODELS[name] = load(name)
    return _TF_MODELS[name]


class Guard:
    """A fitted AEO guard. See the package docstring for the contract and the score."""

    def __init__(self, manifolds: dict[int, Manifold], center: torch.Tensor, scale: torch.Tensor,
                 threshold: float, meta: dict, probe: LinearProbe | None = None,
                 stacker: LinearProbe | None = None):
        kind = meta.get("score", "energy")  # guards saved before the entropic score existed: energy
        if kind not in S.SCORES:
            raise ValueError(f"unknown chaos score '{kind}' in the guard's metadata: choose from "
                             f"{', '.join(S.SCORES)}")
        if kind in ("probe", "combined") and probe is None:
            raise ValueError(f"a '{kind}' guard needs its probe weights (probe.* tensors)")
        if kind == "combined" and stacker is None:
            raise ValueError("a 'combined' guard needs its combination weights (combined.* tensors)")
        self.score_kind = kind
        self.manifolds = manifolds
        self.center = center.double()
        self.scale = scale.double()
        self.threshold = float(threshold)
        self.meta = meta
        self.probe, self.stacker = probe, stacker

    # ---- properties -------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return list(self.manifolds)

    @property
    def model_name(self) -> str:
        return self.meta["model_name"]

    @property
    def chaos_kind(self) -> str:
        """The manifold score behind the per-layer z-scores (the score itself for energy/entropic)."""
        return self.score_kind if self.score_kind in S.CHAOS_SCORES else "energy"

    @property
    def window(self) -> int:
        """Tokens per scoring window (guards saved before windows were scored whole, up to 256 tokens)."""
        return int(self.meta.get("window", self.meta.get("max_response_tokens", 256)))

    @property
    def max_length(self) -> int:
        return int(self.meta.get("max_length", 1024))

    # ---- fitting ----------------------------------------------------------------------------
    @classmethod
    def fit(cls, model, tokenizer, conversations: list[list[dict]], *, model_name: str,
            layers: list[int] | None = None, n_components: int = 32, target_fpr: float = 0.05,
            holdout: float = 0.3, seed: int = 0, batch_size: int = 8, window: int = 64,
            max_length: int = 1024, progress: bool = False, score: str = "energy",
            labels: list[bool] | None = None) -> Guard:
        """Fit on conversations (each ending with the assistant's response).

        ``labels`` (one per conversation, True = the response violates its instructions;
        default: all compliant). ``energy`` and ``entropic`` fit on the compliant ones only;
        ``probe`` and ``combined`` need both kinds. A random ``holdout`` fraction (of each
        kind) is kept out of the fit and used for calibration and the threshold at ``target_fpr``.
        """
        if score not in S.SCORES:
            raise ValueError(f"unknown chaos score '{score}': choose from {', '.join(S.SCORES)}")
        labels = [False] * len(conversations) if labels is None else [bool(y) for y in labels]
        if len(labels) != len(conversations):
            raise ValueError(f"{len(labels)} labels for {len(conversations)} conversations")
        supervised = score not in S.CHAOS_SCORES
        ok = [i for i, y in enumerate(labels) if not y]
        bad = [i for i, y in enumerate(labels) if y] if supervised else []
        if supervised and (len(bad) < 2 or len(ok) < 4):
            raise ValueError(f"the '{score}' score learns from both kinds of response: it needs at least 2 "
                             f"violating and 4 compliant examples ('violation': true / false), got "
                             f"{len(bad)} violating and {len(ok)} compliant")
        if layers is None:
            layers = default_layers(model.config.num_hidden_layers)
        keep = ok + bad
        caps = capture(model, tokenizer, [conversations[i] for i in keep], layers, batch_size=batch_size,
                       max_length=max_length, progress=progress)
        by_row = dict(zip(keep, caps))
        rng = random.Random(seed)
        parts = {}
        for name, rows in (("ok", ok), ("bad", bad)):
            rows = list(rows)
            rng.shuffle(rows)
            n_hold = round(holdout * len(rows))
            if name == "bad" and rows:
                n_hold = min(max(1, n_hold), len(rows) - 1)
            parts[name] = ([by_row[i] for i in rows[n_hold:]], [by_row[i] for i in rows[:n_hold]])
        (fit, held), (fit_bad, held_bad) = parts["ok"], parts["bad"]
        if len(held) < 2 or len(fit) < 2:
            raise ValueError(f"need at least 2 fit and 2 held-out compliant examples; got {len(ok)} compliant "
                             f"examples with holdout={holdout}")
        return cls.fit_captures(fit, held, model_name=model_name, hidden_size=model.config.hidden_size,
                                num_layers=model.config.num_hidden_layers, n_components=n_components,
                                target_fpr=target_fpr, window=window, max_length=max_length, score=score,
                                fit_violations=fit_bad, held_violations=held_bad)

    @classmethod
    def fit_captures(cls, fit: list[Capture], held: list[Capture], *, model_name: str, hidden_size: int,
                     num_layers: int, n_components: int = 32, target_fpr: float = 0.05, window: int = 64,
                     max_length: int = 1024, score: str = "energy", fit_violations: list[Capture] = (),
                     held_violations: list[Capture] = ()) -> Guard:
        """Fit from captures already taken (the benchmark reuses one capture for every method).

        ``fit``/``held``: compliant captures for the manifold and for calibration and the threshold.
        ``score``: ``"energy"`` (Mahalanobis energy) or ``"entropic"`` (asymmetric entropic
        divergence), see :mod:`llmkit.serving.guard.score`, fitted on the compliant captures only;
        ``"probe"`` or ``"combined"`` (:mod:`llmkit.serving.guard.probe`), which also need violating
        captures: ``fit_violations`` train the probe, ``held_violations`` calibrate the combination.
        Every score is taken per ``window`` of response tokens and maximised over the windows.
        """
        from llmkit.serving.guard.probe import LinearProbe, pooled_windows, window_rows

        if not fit or not held:
            raise ValueError("need compliant captures both to fit and to hold out")
        if score not in S.SCORES:
            raise ValueError(f"unknown chaos score '{score}': choose from {', '.join(S.SCORES)}")
        supervised = score not in S.CHAOS_SCORES
        if supervised and not fit_violations:
            raise ValueError(f"the '{score}' score needs violating examples to fit (none given)")
        if score == "combined" and not held_violations:
            raise ValueError("the 'combined' score is calibrated on held-out violating and compliant examples: "
                             "none of the held-out examples is a violation")
        chaos_kind = score if not supervised else "energy"
        layers = list(fit[0].states)
        manifolds = {l: Manifold.fit(torch.cat([c.states[l] for c in fit]), n_components) for l in layers}
        raw = torch.cat([S.window_layer_scores(c, manifolds, chaos_kind, window) for c in held])
        center, scale = S.robust_scale(raw)
        meta = {
            "format_version": FORMAT_VERSION, "score": score,
            "method": {"energy": "AEO chaos score (PPCA cross-entropy)",
                       "entropic": "AEO chaos score (asymmetric entropic divergence)",
                       "probe": "linear probe on pooled guard-layer states",
                       "combined": "energy chaos score + linear probe, combined on held-out responses"}[score],
            "model_name": model_name, "hidden_size": int(hidden_size), "num_layers": int(num_layers),
            "layers": layers, "n_components": int(n_components), "target_fpr": float(target_fpr),
            "window": int(window), "max_length": int(max_length),
            "n_fit": len(fit), "n_holdout": len(held),
            "n_fit_violations": len(fit_violations), "n_holdout_violations": len(held_violations),
            "n_fit_tokens": int(sum(c.states[layers[0]].shape[0] for c in fit)),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        guard = cls(manifolds, center, scale, 0.0, {**meta, "score": chaos_kind})
        probe = stacker = None
        if supervised:
            x, y, w = window_rows(list(fit) + list(fit_violations), [0] * len(fit) + [1] * len(fit_violations),
                                  lambda c: pooled_windows(c, layers, window))
            probe = LinearProbe.fit(x.numpy(), y, sample_weight=w)
            guard.probe = probe
        if score == "combined":
            x, y, w = window_rows(list(held) + list(held_violations), [0] * len(held) + [1] * len(held_violations),
                                  lambda c: guard._features(c))
            stacker = LinearProbe.fit(x.numpy(), y, C=1.0, sample_weight=w)
        guard = cls(manifolds, center, scale, 0.0, meta, probe=probe, stacker=stacker)
        held_scores = guard.score_captures(held)
        threshold = S.threshold_at_fpr(held_scores, target_fpr)
        guard.threshold = threshold
        guard.meta.update(threshold=threshold, holdout_fpr=float((held_scores > threshold).double().mean()))
        if held_violations:
            from sklearn.metrics import roc_auc_score

            bad_scores = guard.score_captures(list(held_violations))
            guard.meta["holdout_auroc"] = float(roc_auc_score([0] * len(held) + [1] * len(held_violations),
                                                              held_scores.tolist() + bad_scores.tolist()))
        return guard

    # ---- persistence ------------------------------------------------------------------------
    def save(self, directory) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {"calibration.center": self.center.float(), "calibration.scale": self.scale.float()}
        for l, m in self.manifolds.items():
            tensors.update(m.tensors(f"layer{l}"))
        if self.probe is not None:
            tensors.update(self.probe.tensors("probe"))
        if self.stacker is not None:
            tensors.update(self.stacker.tensors("combined"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / TENSORS_FILE))
        meta = {**self.meta, "threshold": self.threshold}
        (d / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return d

    @classmethod
    def load(cls, directory, model_name: str | None = None) -> Guard:
        """Load a saved guard; with ``model_name``, refuse one fitted on other weights."""
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / META_FILE).is_file() or not (d / TENSORS_FILE).is_file():
            raise FileNotFoundError(f"{d} is not a guard folder (expected {META_FILE} and {TENSORS_FILE}; "
                                    "make one with `llmkit guard fit`)")
        try:
            meta = json.loads((d / META_FILE).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{d / META_FILE}: not valid JSON ({e})") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{d / META_FILE}: guard format {meta.get('format_version')} is not "
                             f"supported (expected {FORMAT_VERSION})")
        if model_name is not None and not same_model(meta["model_name"], model_name):
            raise ValueError(f"the guard in {d} was fitted on model '{meta['model_name']}', not on "
                             f"'{model_name}'; fit one for this model with "
                             f"`llmkit guard fit --model {model_name} ...`")
        t = load_file(str(d / TENSORS_FILE))
        manifolds = {int(l): Manifold.from_tensors(t, f"layer{int(l)}") for l in meta["layers"]}
        try:
            probe = LinearProbe.from_tensors(t, "probe") if "probe.coef" in t else None
            stacker = LinearProbe.from_tensors(t, "combined") if "combined.coef" in t else None
            return cls(manifolds, t["calibration.center"], t["calibration.scale"], meta["threshold"], meta,
                       probe=probe, stacker=stacker)
        except ValueError as e:
            raise ValueError(f"{d / TENSORS_FILE}: {e}") from None

    # ---- scoring ----------------------------------------------------------------------------
    def _check_model(self, model) -> None:
        cfg = model.config
        if cfg.hidden_size != self.meta["hidden_size"] or cfg.num_hidden_layers != self.meta["num_layers"]:
            raise ValueError(
                f"the guard was fitted on '{self.model_name}' ({self.meta['num_layers']} layers, hidden size "
                f"{self.meta['hidden_size']}); this model has {cfg.num_hidden_layers} layers, hidden size "
                f"{cfg.hidden_size}")

    def capture(self, model, tokenizer, conversations, **kw) -> list[Capture]:
        self._check_model(model)
        kw.setdefault("max_length", self.max_length)
        return capture(model, tokenizer, conversations, self.layers, **kw)

    def _window_z(self, cap: Capture) -> torch.Tensor:
        """Standardised per-layer chaos scores of each window (n_windows, L)."""
        return (S.window_layer_scores(cap, self.manifolds, self.chaos_kind, self.window) - self.center) / self.scale

    def _features(self, cap: Capture) -> torch.Tensor:
        """Per window, the combined score's inputs: (energy chaos, probe decision)."""
        from llmkit.serving.guard.probe import pooled_windows

        chaos = self._window_z(cap).mean(1)
        return torch.stack([chaos, self.probe.decision(pooled_windows(cap, self.layers, self.window))], 1)

    def window_scores(self, cap: Capture) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores (n_windows,), layer z-scores (n_windows, L))`` of one response."""
        from llmkit.serving.guard.probe import pooled_windows

        z = self._window_z(cap)
        if self.score_kind in S.CHAOS_SCORES:
            return z.mean(1), z
        if self.score_kind == "probe":
            return self.probe.decision(pooled_windows(cap, self.layers, self.window)), z
        return self.stacker.decision(self._features(cap)), z

    def score_details(self, caps: list[Capture]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores (n,), layer z-scores (n, L))``: each response's highest-scoring window."""
        scores, zs = [], []
        for cap in caps:
            s, z = self.window_scores(cap)
            k = int(torch.argmax(s))
            scores.append(s[k])
            zs.append(z[k])
        if not caps:
            return torch.zeros(0, dtype=torch.float64), torch.zeros(0, len(self.layers), dtype=torch.float64)
        return torch.stack(scores).double(), torch.stack(zs).double()

    def layer_z(self, caps: list[Capture]) -> torch.Tensor:
        """Standardised per-layer chaos scores (n, L) of each response's highest-scoring window."""
        return self.score_details(caps)[1]

    def score_captures(self, caps: list[Capture]) -> torch.Tensor:
        return self.score_details(caps)[0]

    def score(self, model, tokenizer, conversations, **kw) -> list[float]:
        return self.score_captures(self.capture(model, tokenizer, conversations, **kw)).tolist()

    def _result(self, score: float, z_row: torch.Tensor, n_tokens: int) -> dict:
        s = float(score)
        return {"score": s, "flagged": s > self.threshold, "threshold": self.threshold,
                "layer_scores": {str(l): float(v) for l, v in zip(self.layers, z_row)}, "n_tokens": n_tokens}

    def _results(self, caps: list[Capture]) -> list[dict]:
        scores, z = self.score_details(caps)
        return [self._result(scores[i], z[i], caps[i].n_tokens) for i in range(len(caps))]

    def check_batch(self, engine, prompts_messages: list[list[dict]], responses: list[str],
                    batch_size: int = 8) -> list[dict]:
        model, tok = engine_model(engine)
        convs = [[*m, {"role": "assistant", "content": r}] for m, r in zip(prompts_messages, responses)]
        caps = self.capture(model, tok, convs, batch_size=batch_size)
        return self._results(caps)

    def prefill(self, engine, messages: list[dict]):
        """Run the prompt's share of :meth:`check`'s pass ahead of time (while the engine generates).

        Returns a :class:`~llmkit.serving.guard.capture.Prefill` to hand to :meth:`check`
        (``None`` when the prompt is too long to keep whole; check then runs the whole pass).
        """
        from llmkit.serving.guard.capture import prefill

        model, tok = engine_model(engine)
        self._check_model(model)
        return prefill(model, tok, messages, self.layers, max_length=self.max_length)

    def check(self, engine, messages: list[dict], response_text: str, prefill=None) -> dict:
        """Score one response to ``messages`` (the prompt, without the response).

        With ``prefill`` (from :meth:`prefill` on the same ``messages``) only the response
        tokens are run; the states, so the score, equal those of the whole pass up to float
        rounding (tests/test_guard.py checks it).
        """
        if prefill is not None:
            from llmkit.serving.guard.capture import capture_after_prefill

            model, tok = engine_model(engine)
            cap = capture_after_prefill(model, tok, prefill, response_text, self.layers,
                                        max_length=self.max_length)
            if cap is not None:
                return self._results([cap])[0]
        return self.check_batch(engine, [messages], [response_text])[0]

    def generate(self, engine, prompts_messages: list[list[dict]], params) -> list[tuple[str, dict]]:
        """Generate responses and check them: ``[(text, check result), ...]``.

        On an engine with in-process transformers weights the states are recorded
        during generation (:class:`GenerationRecorder`: no second forward pass), one
        engine call per ``engine.batch_size`` prompts. Recorded rows are matched to
        responses by the prefill's prompt ids and, where llmkit's greedy loop drops
        finished rows mid-batch, by each row's number of fed tokens (EOS: all of
        them; length limit: all but the last). Where that mapping cannot be
        guaranteed (prompts reordered or batched differently by the engine; rows
        cut by stop strings at different steps) those responses get the
        teacher-forced pass of :meth:`check_batch` instead. Scores equal the
        teacher-forced ones except that a length-cut response has no state for its
        last token (tests/test_guard.py checks both). Other engines:
        ``generate`` followed by :meth:`check_batch`.
        """
        from llmkit.serving.guard.capture import GenerationRecorder

        prompts = [engine.chat_prompt(m) for m in prompts_messages]
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            texts = [c[0].text for c in engine.generate(prompts, params)]
            return list(zip(texts, self.check_batch(engine, prompts_messages, texts)))
        self._check_model(model)
        tok = engine.tokenizer
        step = max(1, int(getattr(engine, "batch_size", len(prompts)) or len(prompts)))
        comps, prompt_ids = [], []
        with GenerationRecorder(model, self.layers) as rec:
            for start in range(0, len(prompts), step):  # one engine call per batch: rows map to batches
                chunk = prompts[start : start + step]
                comps += [c[0] for c in engine.generate(chunk, params)]
                prompt_ids.append(tok(chunk, add_special_tokens=False)["input_ids"])
        caps = rec.captures(comps, prompt_ids, stop=any(params.stop))
        missing = [i for i, c in enumerate(caps) if c is None]
        if missing:  # rows whose recorded states cannot be attributed: teacher-forced pass
            convs = [[*prompts_messages[i], {"role": "assistant", "content": comps[i].text}] for i in missing]
            for i, c in zip(missing, self.capture(model, tok, convs)):
                caps[i] = c
        return [(comps[i].text, r) for i, r in enumerate(self._results(caps))]

    # ---- correction -------------------------------------------------------------------------
    def correct(self, engine, messages: list[dict], params, steer_alpha: float = 0.0,
                original: str | None = None) -> str:
        """A new response to ``messages`` with the system instruction re-asserted (see :mod:`correct`).

        With ``original`` (the flagged response), the correction is itself checked and the
        original is kept when the correction does not lower the chaos score.
        """
        return self.correct_batch(engine, [messages], params, steer_alpha=steer_alpha,
                                  originals=None if original is None else [original])[0]

    def correct_batch(self, engine, prompts_messages: list[list[dict]], params, steer_alpha: float = 0.0,
                      originals: list[str] | None = None) -> list[str]:
        from llmkit.serving.guard.correct import reasserted, steering

        prompts = [engine.chat_prompt(reasserted(m, engine.tokenizer)) for m in prompts_messages]
        model = getattr(engine, "model", None)
        if isinstance(model, torch.nn.Module):
            with steering(model, self.manifolds, steer_alpha):
                texts = [c[0].text for c in engine.generate(prompts, params)]
        else:
            texts = [c[0].text for c in engine.generate(prompts, params)]
        if originals is None:
            return texts
        new = self.check_batch(engine, prompts_messages, texts)
        old = self.check_batch(engine, prompts_messages, originals)
        return [t if n["score"] < o["score"] else orig for t, orig, n, o in zip(texts, originals, new, old)]
