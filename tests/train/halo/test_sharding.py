"""HALO refuses parameter-sharding engines however they were switched on (TrainingArguments or accelerate config)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmkit.train.halo.trainer import sharded_engine


def test_sharded_engine_detection(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plain = SimpleNamespace(deepspeed=None, deepspeed_plugin=None, fsdp="")
    assert sharded_engine(plain) is None
    assert sharded_engine(SimpleNamespace(deepspeed="ds.json", fsdp="")) == "deepspeed"
    # accelerate launch --config_file zero2.yaml: only the plugin (and accelerate's env flag) is set
    assert sharded_engine(SimpleNamespace(deepspeed=None, deepspeed_plugin=object(), fsdp="")) == "deepspeed"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert sharded_engine(plain) == "deepspeed"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert sharded_engine(plain) == "fsdp"


def test_halo_callback_refuses_deepspeed_from_an_accelerate_config(monkeypatch, tiny_model):
    from llmkit.train.halo.trainer import HaloCallback

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    cb = HaloCallback.__new__(HaloCallback)
    with pytest.raises(ValueError, match="DeepSpeed"):
        cb.on_train_begin(SimpleNamespace(deepspeed=None, fsdp=""), None, None, model=tiny_model)
