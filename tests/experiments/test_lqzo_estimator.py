"""The estimator-quality measurement: its true gradient is the one the ZO variants estimate, and more
directions give a better estimate."""

from __future__ import annotations

import pytest
import torch

from llmkit.experiments.lqzo_estimator import (
    VARIANTS,
    estimator_quality,
    flat_keys,
    scale_tensors,
    true_log_gradient,
)
from llmkit.experiments.stats import mean_ci
from llmkit.optim.zo import SeedZO


@pytest.fixture(scope="module")
def quantized_loss():
    from llmkit.testing import tiny_llama
    from llmkit.train.lqzo import quantize_model

    torch.manual_seed(0)
    model = tiny_llama()
    quantize_model(model, 4, 32)
    # float64: a random tiny model's scale gradient is small enough that float32 loss differences at mu 1e-3
    # would be rounding noise (the bundled model's is not)
    model.double().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    def loss():
        return model(input_ids=ids, labels=ids).loss

    return model, loss


def test_true_gradient_is_in_the_coordinates_the_zo_step_estimates(quantized_loss):
    model, loss = quantized_loss
    scales = scale_tensors(model)
    g = true_log_gradient(loss, scales)
    assert all(not s.requires_grad and s.grad is None for s in scales)
    zo = SeedZO(scales, modes=["mul"] * len(scales), mu=1e-3, seed=3)
    for k in range(3):
        d, _, _ = zo.projected(loss, 0, k)
        z = torch.cat([zo.z(0, k, i).flatten() for i in range(len(scales))])
        assert d == pytest.approx(float(z @ g), rel=0.02, abs=1e-7)


def test_more_directions_give_a_better_estimate_and_keys_are_named_per_variant(quantized_loss):
    model, loss = quantized_loss
    scales = scale_tensors(model)
    before = [s.detach().clone() for s in scales]
    res = estimator_quality(loss, scales, variants={k: VARIANTS[k] for k in ("gaussian_full", "lowrank_regrouped")},
                            qs=(1, 8), seeds=range(3))
    assert all(torch.equal(a, b) for a, b in zip(before, scales)), "the measurement changed the scales"
    for name in ("gaussian_full", "lowrank_regrouped"):
        one, many = res["variants"][name][1], res["variants"][name][8]
        assert many["cos"]["mean"] > one["cos"]["mean"]
        # an unbiased estimate from q unit-variance directions in D dims: ||g_hat - g|| / ||g|| ~ sqrt(D / q)
        expected = (res["num_scales"] / 8) ** 0.5
        assert expected / 2 < many["nerr"]["mean"] < expected * 2
    keys = flat_keys(res, 4)
    assert set(keys) >= {"cos_true_grad_gaussian_full_int4_q1", "cos_true_grad_lowrank_regrouped_int4_q8"}
    assert keys["cos_true_grad_gaussian_full_int4_q8"]["n"] == 3


def test_mean_ci_is_the_t_interval():
    r = mean_ci([1.0, 2.0, 3.0])
    assert r["mean"] == 2.0 and r["lo"] == pytest.approx(2.0 - 4.302653 / 3 ** 0.5 * 1.0, rel=1e-5)
    assert mean_ci([5.0])["lo"] == 5.0
    with pytest.raises(ValueError):
        mean_ci([])
