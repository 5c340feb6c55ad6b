"""VSPO bandit simulation: the target starts at p0, aligned steering beats reward shaping, censoring is kept."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.train.vspo.bandit import (
    BanditConfig,
    alpha_top,
    km_median,
    make_problem,
    run,
    softmax,
    speedup,
    summarize,
)


def test_problem_puts_target_at_p0():
    cfg = BanditConfig(p0=0.01)
    theta, reward, _b, target = make_problem(np.random.default_rng(0), cfg)
    assert softmax(theta)[target].sum() == pytest.approx(0.01)
    assert target.sum() == cfg.behavior_arms and (reward[target] == 2).all()


def test_alpha_schedules():
    cfg = BanditConfig(alpha_max=4.0, anneal=10)
    assert alpha_top("vspo_aligned", 5, cfg) == pytest.approx(2.0) and alpha_top("vspo_aligned", 20, cfg) == 0.0
    assert alpha_top("vspo_aligned_fixed", 20, cfg) == 4.0 and alpha_top("reward_shaping", 0, cfg) == 0.0


def test_aligned_steering_reaches_target_where_shaping_is_censored():
    cfg = BanditConfig(p0=0.002, max_iters=150)
    shaping = [run("reward_shaping", s, cfg)[0] for s in range(3)]
    aligned = [run("vspo_aligned", s, cfg)[0] for s in range(3)]
    assert shaping == [None, None, None]  # the cap is not a hitting time
    assert all(t is not None and t < 150 for t in aligned)
    sh, al = summarize(shaping, 150), summarize(aligned, 150)
    assert sh["km_median_iters"] is None and sh["censored"] == 3
    ratio, kind = speedup(sh, al)
    assert kind == "lower_bound" and ratio == pytest.approx(150 / al["km_median_iters"])
    assert speedup(al, sh) == (None, "undefined")


def test_km_median_treats_censored_runs_as_at_least_the_cap():
    # 3 of 5 reach (10, 20, 30), 2 censored at 100: the KM median is 30, not a value pulled to the cap
    assert km_median([10, 20, 30, None, None], 100) == pytest.approx(30.0)
    # 2 of 5 reach: survival never falls to 0.5, so the median is not reached (counting the cap would say 100)
    assert km_median([10, 20, None, None, None], 100) is None
    assert km_median([None, None], 100) is None
    assert km_median([4, 6, 8], 100) == pytest.approx(6.0)


def test_unknown_method_and_bad_config():
    with pytest.raises(ValueError, match="unknown method"):
        run("ppo", 0, BanditConfig(max_iters=2))
    with pytest.raises(ValueError, match="p0"):
        BanditConfig(p0=1.5)
