"""Matrix completion through nullspace perturbation (the paper's setting: a random low-rank matrix, each entry
observed independently): recovery within the stated error, O(eps) closeness, and the surrogate's pieces."""

from __future__ import annotations

import pytest
import torch

from llmkit.optim.matrix import complete, low_rank_problem, relative_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("seed", [0, 1])
def test_recovers_low_rank_matrix_from_a_quarter_of_its_entries_within_eps(seed):
    truth, mask = low_rank_problem(60, 60, 3, 0.25, seed=seed)
    assert 0.2 < mask.float().mean() < 0.3
    observed = torch.where(mask, truth, torch.full_like(truth, 1e6))    # unobserved values must not matter
    errs = {}
    for eps in (1e-1, 1e-2, 1e-3):
        est = complete(observed, mask, 3, eps)
        assert est.shape == truth.shape and torch.isfinite(est).all()
        errs[eps] = relative_error(est, truth)
        assert errs[eps] <= 2 * eps, errs                                  # stated error: <= 2 eps (relative)
    # O(eps)-closeness: the error shrinks at least linearly with eps
    assert errs[1e-2] <= 0.2 * errs[1e-1] and errs[1e-3] <= 0.2 * errs[1e-2], errs
    # the completed matrix has the requested rank
    s = torch.linalg.svdvals(complete(observed, mask, 3, 1e-3))
    assert s[3] < 1e-8 * s[0]


def test_too_few_entries_is_not_recovered_and_bad_inputs_are_named():
    truth, mask = low_rank_problem(60, 60, 3, 0.08, seed=0)                 # below the ~2 x degrees of freedom
    assert relative_error(complete(truth, mask, 3, 1e-3), truth) > 0.1
    with pytest.raises(ValueError, match="same shape|one shape"):
        complete(truth, mask[:10], 3, 1e-3)
    with pytest.raises(ValueError, match="rank"):
        complete(truth, mask, 0, 1e-3)


def test_large_perturbation_first_rescues_als_from_random_and_bad_starts():
    truth, mask = low_rank_problem(60, 60, 3, 0.25, seed=2)
    direct_random = complete(truth, mask, 3, 1e-3, init="random", anneal_from=None)
    direct_spectral = complete(truth, mask, 3, 1e-3, anneal_from=None)
    laddered = complete(truth, mask, 3, 1e-3, init="random")
    assert relative_error(direct_random, truth) > 0.5
    assert relative_error(direct_spectral, truth) > 0.5       # this mask traps plain ALS at small eps
    assert relative_error(laddered, truth) < 2e-3
