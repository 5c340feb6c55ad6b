"""HALO with a tied LM head / input embedding (SmolLM2 ties them): the input role joins last."""

from __future__ import annotations

import pytest
import torch

from llmkit.train.halo import HaloController, Schedule, layer_units


def _tied_model(num_layers=2):
    from llmkit.testing import tiny_llama

    model = tiny_llama(num_layers=num_layers)
    model.lm_head.weight = model.model.embed_tokens.weight
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.train()
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _role_gradients(tied):
    """g_head and g_lookup of the shared matrix, from an untied copy (an independent reference)."""
    import copy

    untied = copy.deepcopy(tied)
    w = tied.get_input_embeddings().weight.detach()
    untied.lm_head.weight = torch.nn.Parameter(w.clone())
    untied.model.embed_tokens.weight = torch.nn.Parameter(w.clone())
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    untied(**_batch()).loss.backward()
    return untied.lm_head.weight.grad, untied.model.embed_tokens.weight.grad


def _controller(model, step, total=50, **kw):
    units = layer_units(model)
    sched = Schedule(method=kw.pop("method", "halo"), num_units=len(units), homotopy_fraction=1.0, **kw)
    ctrl = HaloController(units, sched, total, skip_frozen_backward=True)
    ctrl.before_forward(step)
    return units, ctrl


def test_tied_input_role_is_the_last_unit_and_owns_no_parameter():
    model = _tied_model()
    units = layer_units(model)
    assert [u.name for u in units] == ["output", "layer.1", "layer.0", "embeddings"]
    assert any(p is model.model.embed_tokens.weight for p in units[0].params)
    assert units[-1].params == [] and units[-1].tied_input is model.model.embed_tokens
    # every parameter counted once
    assert sum(u.numel() for u in units) == sum(p.numel() for p in model.parameters())


def test_untied_model_has_no_gate():
    from llmkit.testing import tiny_llama

    assert all(u.tied_input is None for u in layer_units(tiny_llama()))


def test_at_t_zero_the_shared_matrix_gets_only_the_heads_gradient():
    model = _tied_model()
    g_head, g_lookup = _role_gradients(model)
    assert g_lookup.abs().sum() > 0  # the lookup's share is real, so the check below can fail
    _units, ctrl = _controller(model, step=0)
    assert ctrl.current[0] == 1.0 and ctrl.current[-1] == 0.0
    model(**_batch()).loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, g_head, rtol=1e-5, atol=1e-7)
    # backprop stopped at the head: the frozen layers got no gradient
    assert all(p.grad is None for p in model.model.layers.parameters())


def test_on_its_ramp_the_lookup_share_is_scaled_by_lambda():
    model = _tied_model()
    g_head, g_lookup = _role_gradients(model)
    # ramp_width=1: every non-initial unit shares lambda = smoothstep(t); t = 0.4 -> 0.352
    _units, ctrl = _controller(model, step=20, ramp_width=1.0)
    lam = ctrl.current[-1]
    assert 0 < lam < 1
    model(**_batch()).loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, g_head + lam * g_lookup, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["full", "lisa"])
def test_full_and_lisa_train_both_roles(method):
    model = _tied_model()
    g_head, g_lookup = _role_gradients(model)
    _controller(model, step=0, method=method)
    model(**_batch()).loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, g_head + g_lookup, rtol=1e-5, atol=1e-7)


def test_end_of_training_removes_the_gate():
    model = _tied_model()
    g_head, g_lookup = _role_gradients(model)
    _units, ctrl = _controller(model, step=0)
    ctrl.restore_requires_grad()
    model(**_batch()).loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, g_head + g_lookup, rtol=1e-5, atol=1e-7)


def test_gate_keeps_reentrant_checkpointing_working():
    model = _tied_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    # halfway: the last layer trains, the input role is still frozen
    units, ctrl = _controller(model, step=25, ramp_width=0.25)
    ctrl.keep_input_requires_grad = True
    assert ctrl.current[1] > 0 and ctrl.current[-1] == 0.0
    model(**_batch()).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in units[1].params)
