"""Batched Thompson sampling (GP) and the randomized neural policy against random search."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.optim.bo import (
    TEST_FUNCTIONS,
    BatchedThompsonSampling,
    RandomizedNeuralBO,
    random_search,
    run_ask_tell,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_ask_tell_interface():
    opt = BatchedThompsonSampling([(0.0, 1.0), (-2.0, 2.0)], batch_size=3, seed=0)
    pts = opt.ask()
    assert len(pts) == 3 and all(len(p) == 2 and 0 <= p[0] <= 1 and -2 <= p[1] <= 2 for p in pts)
    opt.tell(pts, [1.0, 2.0, 0.5])
    assert opt.best == (pts[2], 0.5)
    with pytest.raises(ValueError):
        opt.tell(pts, [1.0])
    with pytest.raises(ValueError):
        BatchedThompsonSampling([(1.0, 0.0)], 2)


def test_no_uncertainty_sampling_phase():
    # after a few points of a 1-D quadratic, the second batch goes near the observed minimum (Thompson),
    # not to the least explored end of the interval (where uncertainty sampling would go)
    f = lambda p: (p[0] - 0.3) ** 2
    opt = BatchedThompsonSampling([(0.0, 1.0)], batch_size=4, seed=0)
    xs = [[0.1], [0.25], [0.3], [0.35], [0.5]]
    opt.tell(xs, [f(x) for x in xs])
    batch = opt.ask()
    assert np.median([abs(p[0] - 0.3) for p in batch]) < 0.2


@pytest.mark.slow
def test_batched_ts_beats_random_search():
    for name in ("branin", "hartmann3"):
        f, bounds, fmin = TEST_FUNCTIONS[name]
        bts = [run_ask_tell(BatchedThompsonSampling(bounds, 4, seed=s), f, 32)[1] - fmin for s in range(4)]
        rs = [random_search(f, bounds, 32, seed=s)[1] - fmin for s in range(4)]
        assert np.median(bts) < np.median(rs), name


def test_randomized_neural_bo_beats_random_search_on_branin():
    f, bounds, fmin = TEST_FUNCTIONS["branin"]
    nn = [run_ask_tell(RandomizedNeuralBO(bounds, 4, seed=s, steps=80), f, 16)[1] - fmin for s in range(2)]
    rs = [random_search(f, bounds, 16, seed=s)[1] - fmin for s in range(2)]
    assert np.mean(nn) < np.mean(rs)
