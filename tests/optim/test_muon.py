"""Muon / MuonLight (heavy-tailed matrix toy, update scale, 2-D only) and the recipe plumbing in llmkit.optim.hf."""

from __future__ import annotations

import pytest
import torch

from llmkit.optim import Muon, MuonLight
from llmkit.optim.hf import (
    LLMKIT_OPTIMIZERS,
    HybridOptimizer,
    build_optimizer,
    parse_optim_args,
    split_matrix_params,
)
from llmkit.optim.muon import newton_schulz


def _matrix_toy(make, lr0, seed, steps=1000, shape=(8, 8), df=1.5):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(shape, generator=g)
    torch.manual_seed(100 + seed)
    noise = torch.distributions.StudentT(df).sample((steps, *shape))
    w = torch.nn.Parameter(torch.zeros(shape))
    opt = make([w], lr0)
    for t in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr0 * (1 - t / steps)
        w.grad = (w.detach() - target) + noise[t]
        opt.step()
    return float((w.detach() - target).norm() / target.norm())


def test_muon_converges_on_a_matrix_problem_with_infinite_variance_noise_where_sgd_wanders():
    seeds = (0, 1, 2, 3)  # SGD's error is dominated by the rare huge noise draws: average over a few runs
    muon = sum(_matrix_toy(lambda p, lr: Muon(p, lr=lr), 0.1, s, steps=400) for s in seeds) / len(seeds)
    sgd = sum(_matrix_toy(lambda p, lr: torch.optim.SGD(p, lr=lr), 0.1, s, steps=400) for s in seeds) / len(seeds)
    assert muon < 0.4, muon
    assert muon < 0.6 * sgd, (muon, sgd)


def test_newton_schulz_orthogonalizes_roughly():
    torch.manual_seed(0)
    g = torch.randn(16, 32)
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.5 and s.max() < 1.5  # Muon's quintic iteration: singular values near 1, not exactly


def test_muonlight_update_rms_matches_adamw_scale_and_muon_does_not():
    torch.manual_seed(0)
    lr = 1e-2
    for cls, lo, hi in ((MuonLight, 0.12, 0.3), (Muon, 0.0, 0.1)):
        w = torch.nn.Parameter(torch.zeros(64, 256))
        w.grad = torch.randn(64, 256)
        cls([w], lr=lr, weight_decay=0.0).step()
        rms = float(w.detach().pow(2).mean().sqrt()) / lr
        assert lo < rms < hi, (cls.__name__, rms)


def test_muon_refuses_non_matrices():
    with pytest.raises(ValueError, match="2D"):
        Muon([torch.nn.Parameter(torch.zeros(3))], lr=0.1)


# ------------------------------------------------------------------ llmkit.optim.hf


class _Args:
    learning_rate = 1e-3
    weight_decay = 0.0
    adam_beta1, adam_beta2, adam_epsilon = 0.9, 0.999, 1e-8
    llmkit_lr = None
    optim_args = None


def test_split_puts_hidden_matrices_to_muon_and_embeddings_head_norms_to_adamw(tiny_model):
    matrices, rest = split_matrix_params(tiny_model)
    mnames = {n for n, _ in matrices}
    rnames = {n for n, _ in rest}
    assert mnames and all(p.ndim == 2 for _, p in matrices)
    assert not any("embed" in n or "lm_head" in n for n in mnames)
    assert any("embed" in n for n in rnames) and any("norm" in n for n in rnames)
    assert any("q_proj" in n for n in mnames) and any("mlp" in n for n in mnames)


@pytest.mark.parametrize("name", LLMKIT_OPTIMIZERS)
def test_every_name_builds_an_optimizer_that_trains_and_round_trips_its_state(name, tiny_model):
    opt = build_optimizer(name, tiny_model, _Args())
    assert isinstance(opt, torch.optim.Optimizer)
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    assert owned == {id(p) for p in tiny_model.parameters() if p.requires_grad}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    ids = torch.randint(0, 200, (2, 12))
    before = tiny_model(input_ids=ids, labels=ids).loss.item()
    for _ in range(3):
        loss = tiny_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert tiny_model(input_ids=ids, labels=ids).loss.item() < before
    if isinstance(opt, HybridOptimizer):
        # the scheduler reaches every inner optimizer's groups
        assert all(g["lr"] == pytest.approx(g["initial_lr"] * 0.125) for o in opt.optimizers for g in o.param_groups)
        assert len(opt.state) == sum(len(o.state) for o in opt.optimizers) > 0
        sd = opt.state_dict()
        again = build_optimizer(name, tiny_model, _Args())
        again.load_state_dict(sd)
        assert again.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        k = next(iter(opt.optimizers[0].state))
        assert torch.equal(next(iter(again.optimizers[0].state[k].values())),
                           next(iter(opt.optimizers[0].state[k].values())))


def test_muon_name_returns_muon_for_matrices_and_adamw_for_the_rest(tiny_model):
    opt = build_optimizer("llmkit_muon", tiny_model, _Args())
    assert isinstance(opt, HybridOptimizer)
    assert [type(o).__name__ for o in opt.optimizers] == ["Muon", "AdamW"]


def test_optim_args_are_parsed_into_keyword_arguments():
    assert parse_optim_args("momentum=0.9, ns_steps=6,betas=0.95 0.98,nesterov=false") == {
        "momentum": 0.9, "ns_steps": 6, "betas": (0.95, 0.98), "nesterov": False}
    with pytest.raises(ValueError, match="key=value"):
        parse_optim_args("momentum")


def test_config_mixin_moves_llmkit_names_out_of_hf_validation():
    from llmkit.train.vspo.config import VSPOConfig

    cfg = VSPOConfig(output_dir="/tmp/x", optim="llmkit_muon", use_cpu=True, report_to="none")
    assert cfg.llmkit_optim == "llmkit_muon" and str(getattr(cfg.optim, "value", cfg.optim)) == "adamw_torch"
    plain = VSPOConfig(output_dir="/tmp/x", optim="adamw_torch", use_cpu=True, report_to="none")
    assert plain.llmkit_optim is None
    with pytest.raises(ValueError, match="unknown llmkit optimizer"):
        VSPOConfig(output_dir="/tmp/x", optim="llmkit_adam", use_cpu=True, report_to="none")


def test_cli_parser_accepts_llmkit_names():
    from trl import TrlParser

    from llmkit.train.halo.config import HaloArguments, HaloConfig

    _halo_args, cfg = TrlParser((HaloArguments, HaloConfig)).parse_args_and_config(
        ["--output_dir", "/tmp/x", "--optim", "llmkit_lion", "--use_cpu", "true", "--report_to", "none"])
    assert cfg.llmkit_optim == "llmkit_lion"
