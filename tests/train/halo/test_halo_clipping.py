"""HALO clips the gradient norm over the units that update, not over frozen units' gradients.

With ``skip_frozen_backward=False`` frozen units run backward in one process exactly as they do under DDP
(where HALO cannot stop them), so the in-process test exercises the same path the two-process test does.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("halo_clip_worker", Path(__file__).with_name("clip_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def test_clipped_update_of_active_units_ignores_frozen_gradients(tmp_path):
    with_frozen = worker.run(tmp_path / "a", skip_frozen_backward=False)
    without = worker.run(tmp_path / "b", skip_frozen_backward=True)
    bound = worker.LR * worker.MAX_GRAD_NORM
    # clipping binds, and the whole clipped norm goes to the units that update
    assert with_frozen["active_update_norm"] == pytest.approx(bound, rel=1e-4)
    assert without["active_update_norm"] == pytest.approx(bound, rel=1e-4)
    assert with_frozen["frozen_max_change"] == 0.0 and without["frozen_max_change"] == 0.0
    # the logged (pre-clip) norm is the active units' norm either way
    assert with_frozen["logged_grad_norm"] == pytest.approx(without["logged_grad_norm"], rel=1e-4)
    assert with_frozen["logged_grad_norm"] > worker.MAX_GRAD_NORM


def test_bare_callback_warns_when_frozen_gradients_would_be_clipped(tiny_model):
    from types import SimpleNamespace

    from llmkit.train.halo.trainer import HaloCallback

    cb = HaloCallback(skip_frozen_backward=False)
    args = SimpleNamespace(max_grad_norm=1.0, world_size=2, gradient_checkpointing=False, deepspeed=None, fsdp=None)
    with pytest.warns(UserWarning, match="max_grad_norm"):
        cb.on_train_begin(args, SimpleNamespace(max_steps=4), None, model=tiny_model)


@pytest.mark.slow
@pytest.mark.accelerate_job("halo_clip")  # clip_worker.py as a script
def test_two_processes_clip_over_active_units(accelerate_batch):
    r = accelerate_batch["halo_clip"]
    out = r.out
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "clip.json").read_text())
    assert res["world_size"] == 2
    assert res["active_update_norm"] == pytest.approx(worker.LR * worker.MAX_GRAD_NORM, rel=1e-4)
    assert res["frozen_max_change"] == 0.0
