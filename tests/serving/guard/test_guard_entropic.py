"""The entropic chaos score: exact Gaussian KL on whitened states, its asymmetric form, and the guard using it."""

from __future__ import annotations

import json
import random

import pytest
import torch

from llmkit.experiments.stats import auroc
from llmkit.serving.guard import Guard, Manifold
from llmkit.serving.guard import score as S


def known_manifold(d=6):
    comps = torch.eye(d)[:2]
    return Manifold(mean=torch.zeros(d), components=comps, variances=torch.tensor([4.0, 2.0]),
                    noise=torch.tensor(0.5))


def test_whiten_gives_identity_coordinates_and_energy():
    m = known_manifold()
    x = torch.randn(7, 6, dtype=torch.float64)
    z, r = m.whiten(x)
    assert torch.allclose(z, x[:, :2] / torch.tensor([2.0, 2.0**0.5], dtype=torch.float64))
    assert torch.allclose(r[:, 2:], x[:, 2:] / 0.5**0.5) and torch.allclose(r[:, :2], torch.zeros(7, 2, dtype=torch.float64))
    assert torch.allclose(((z * z).sum(1) + (r * r).sum(1)) / 6, m.energy(x).double(), rtol=1e-5)


def test_symmetric_entropic_score_is_the_gaussian_kl():
    from sklearn.covariance import ledoit_wolf
    from torch.distributions import MultivariateNormal, kl_divergence

    torch.manual_seed(0)
    m = known_manifold()
    x = torch.randn(40, 6, dtype=torch.float64) * torch.tensor([3.0, 0.5, 1.0, 2.0, 0.3, 1.0], dtype=torch.float64) + 0.7
    z, r = m.whiten(x)
    cov = torch.from_numpy(ledoit_wolf(z.numpy())[0])
    kl_sub = kl_divergence(MultivariateNormal(z.mean(0), cov), MultivariateNormal(torch.zeros(2, dtype=torch.float64),
                                                                                  torch.eye(2, dtype=torch.float64)))
    rr = r[:, 2:]
    v = ((rr - rr.mean(0)) ** 2).sum(1).mean() / 4
    kl_res = 0.5 * (rr.mean(0) @ rr.mean(0)) + 0.5 * 4 * (v - 1 - torch.log(v))
    want = float(kl_sub + kl_res) / 6
    assert S.entropic_layer_score(x, m, asymmetric=False) == pytest.approx(want, rel=1e-6)


def test_asymmetric_score_counts_scatter_and_drift_not_concentration():
    torch.manual_seed(1)
    m = known_manifold()
    sd = torch.tensor([2.0, 2.0**0.5] + [0.5**0.5] * 4, dtype=torch.float64)

    def traj(scale, shift=0.0):
        return torch.randn(60, 6, dtype=torch.float64) * sd * scale + shift

    typical, tight, wide = traj(1.0), traj(0.1), traj(3.0)
    e = {k: S.entropic_layer_score(v, m) for k, v in {"typical": typical, "tight": tight, "wide": wide}.items()}
    assert e["tight"] < 0.01 and e["typical"] < 0.1  # drift ~ 0, no excess scatter
    assert e["wide"] > 1.0  # f(9) = 9 - 1 - log 9 ~ 5.8 per direction, halved
    assert S.entropic_layer_score(traj(0.1, shift=3.0), m) > 1.0  # drift alone counts
    # the symmetric KL would call the tight trajectory chaotic; the asymmetric one does not
    assert S.entropic_layer_score(tight, m, asymmetric=False) > 1.0
    # one token: no spread, only its drift
    assert S.entropic_layer_score(torch.zeros(1, 6), m) == pytest.approx(0.0, abs=1e-12)
    scores = [S.entropic_layer_score(traj(s), m) for s in (1.5, 2.0, 3.0, 4.0)]
    assert scores == sorted(scores)


def conv(user, response):
    return [{"role": "system", "content": "Always answer in French."}, {"role": "user", "content": user},
            {"role": "assistant", "content": response}]


def french(n, seed):
    rng = random.Random(seed)
    words = ["bonjour", "merci", "oui", "le chat", "la maison", "tres bien", "au revoir"]
    return [conv(f"question {i}", " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))) for i in range(n)]


def scattered(n, seed=1):
    rng = random.Random(seed)
    return [conv(f"say {i}", "".join(chr(rng.randint(0x4E00, 0x4E80)) for _ in range(rng.randint(3, 8))))
            for i in range(n)]


def test_guard_with_entropic_score_separates_and_round_trips(tiny_model, tiny_tokenizer, tmp_path):
    torch.set_num_threads(1)  # conftest restores it after the test
    g = Guard.fit(tiny_model, tiny_tokenizer, french(30, 0), model_name="tiny", layers=[1, 2], n_components=8,
                  target_fpr=0.1, score="entropic")
    assert g.score_kind == "entropic" and g.meta["score"] == "entropic"
    ok = g.score(tiny_model, tiny_tokenizer, french(20, 5))
    bad = g.score(tiny_model, tiny_tokenizer, scattered(20))
    assert auroc(ok + bad, [0] * 20 + [1] * 20) > 0.9
    energy = Guard.fit(tiny_model, tiny_tokenizer, french(30, 0), model_name="tiny", layers=[1, 2], n_components=8)
    assert energy.score(tiny_model, tiny_tokenizer, scattered(3)) != pytest.approx(
        g.score(tiny_model, tiny_tokenizer, scattered(3)))
    g.save(tmp_path / "g")
    loaded = Guard.load(tmp_path / "g")
    assert loaded.score_kind == "entropic"
    assert loaded.score(tiny_model, tiny_tokenizer, scattered(3)) == pytest.approx(
        g.score(tiny_model, tiny_tokenizer, scattered(3)), rel=1e-5)
    # a guard saved before the entropic score existed has no "score" key: it is an energy guard
    meta = json.loads((tmp_path / "g" / "guard.json").read_text())
    del meta["score"]
    (tmp_path / "g" / "guard.json").write_text(json.dumps(meta))
    assert Guard.load(tmp_path / "g").score_kind == "energy"
    with pytest.raises(ValueError, match="unknown chaos score 'kl'"):
        Guard.fit(tiny_model, tiny_tokenizer, french(10, 0), model_name="tiny", layers=[1], score="kl")
