"""SMITH recipe: row mix, pool-driven use prompts, passing builds join the pool, 2 steps through `llmkit train smith`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmkit.tools import ToolPool, sandbox, tasks
from llmkit.tools.rollouts import reference_build_trace

needs_sandbox = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")


def test_rows_cycle_training_families_and_keep_heldout_out():
    from llmkit.train.smith.trainer import make_rows

    rows = make_rows(tasks.TRAIN_FAMILIES, 40, examples=2)
    assert {r["family"] for r in rows} == set(tasks.TRAIN_FAMILIES)
    assert not {r["family"] for r in rows} & set(tasks.HELDOUT_FAMILIES)
    assert all(json.loads(r["instance"])["question"] for r in rows)
    assert len({r["seed"] for r in rows}) == 40


def test_use_share_is_honoured_in_every_step_and_the_same_on_every_rank():
    from llmkit.train.smith.trainer import SmithTrainer, use_count

    assert [use_count(n, 0.5) for n in (2, 3, 4, 8)] == [1, 2, 2, 4]
    assert [use_count(1, 0.5, b) for b in range(4)] == [1, 0, 1, 0]  # one prompt a step: the kinds alternate
    assert sum(use_count(1, 0.25, b) for b in range(8)) == 2 and sum(use_count(5, 0.3, b) for b in range(4)) == 6
    assert use_count(8, 0.05) == 1 and use_count(8, 0.95) == 7  # both kinds in every step
    assert use_count(8, 0.0) == 0 and use_count(8, 1.0) == 8
    picks = []
    for step in range(6):
        fake = SimpleNamespace(use_share=0.25, args=SimpleNamespace(seed=0, steps_per_generation=1,
                                                                    gradient_accumulation_steps=1),
                               state=SimpleNamespace(global_step=step))
        seeds = [10, 11, 12, 13, 14, 15, 16, 17] * 2  # 8 prompts, each generated twice
        use = SmithTrainer.use_seeds(fake, seeds)
        assert len(use) == 2 and use <= set(seeds)
        assert SmithTrainer.use_seeds(fake, list(reversed(seeds))) == use  # order-free: every rank agrees
        picks.append(frozenset(use))
    assert len(set(picks)) > 1  # not the same prompts every step


def _cfg(tmp_path, **kw):
    from llmkit.train.smith.config import SmithConfig

    return SmithConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                       per_device_train_batch_size=2, num_generations=2, **kw)


def test_config_aggregations(tmp_path):
    c = _cfg(tmp_path, schema_weight=0.5, outcome_weight=2.0)
    assert c.multi_objective_aggregation == "normalize_then_sum" and c.reward_weights == [0.5, 1.0, 2.0]
    assert _cfg(tmp_path, reward_aggregation="combined").multi_objective_aggregation == "sum_then_normalize"
    with pytest.raises(ValueError, match="reward_aggregation"):
        _cfg(tmp_path, reward_aggregation="mean")


@needs_sandbox
def test_passing_build_joins_pool_and_use_rows_follow_it(tmp_path):
    from llmkit.train.smith.recipe import reward_functions
    from llmkit.train.smith.trainer import SmithTrainer, make_rows

    pool = ToolPool(tmp_path / "pool")
    funcs, _ = reward_functions(_cfg(tmp_path, build_checks=3), pool)
    fake = SimpleNamespace(pool=pool, build_examples=2, families=["gcd", "digit_sum"],
                           state=SimpleNamespace(global_step=3))
    row = make_rows(["gcd"], 4, examples=2)[0]
    resolved = SmithTrainer.resolve_row(fake, dict(row), use=True)
    assert resolved["kind"] == "build" and resolved["tool"] == ""  # empty pool: the use row builds instead
    good = reference_build_trace(tasks.get("gcd"))
    bad = good.replace("return g", "return g + 1")
    kw = {"kind": ["build", "build"], "family": ["gcd", "gcd"], "seed": [1, 1],
          "trainer_state": SimpleNamespace(global_step=3)}
    for f in funcs:
        f(completions=[bad, good], **kw)
    assert len(pool) == 1
    entry = pool.best("gcd")
    assert entry.step == 3 and entry.source == "policy" and entry.score == 1.0
    # built during step 3: not shown before step 4 (another rank may still be resolving step 3's prompts)
    assert SmithTrainer.resolve_row(fake, dict(row), use=True)["kind"] == "build"
    fake.state.global_step = 4
    resolved = SmithTrainer.resolve_row(fake, dict(row), use=True)
    assert resolved["kind"] == "use" and json.loads(resolved["tool"])["name"] == "gcd_of"
    text = resolved["prompt"][-1]["content"]
    assert "gcd_of" in text and "def gcd_of" not in text  # the schema, never the code
    assert SmithTrainer.resolve_row(fake, dict(row), use=False)["kind"] == "build"
    # a use row of a family without a pooled tool is asked a question of a pooled training family
    other = make_rows(["digit_sum"], 1, examples=2)[0]
    stand_in = SmithTrainer.resolve_row(fake, dict(other), use=True)
    assert stand_in["kind"] == "use" and stand_in["family"] == "gcd"
    inst = json.loads(stand_in["instance"])
    assert tasks.get("gcd").verify(str(inst["answer"]), tasks.Instance("gcd", inst["question"], inst["args"],
                                                                        inst["answer"]))


@needs_sandbox
def test_seed_pool_adds_verified_training_tools_only_when_empty(tmp_path, tiny_model, tiny_tokenizer):
    from llmkit.train.smith.recipe import seed_pool

    pool = ToolPool(tmp_path / "pool")
    cfg = _cfg(tmp_path, build_checks=2)
    assert seed_pool(cfg, pool, ["gcd", "digit_sum"]) == {"gcd": True, "digit_sum": True}
    assert pool.families() == ["digit_sum", "gcd"]
    assert {e.source for e in pool.entries()} == {"warm_start"} and all(e.step == -1 for e in pool.entries())
    assert seed_pool(cfg, pool, ["lcm"]) == {}  # not empty any more: left alone
    assert seed_pool(_cfg(tmp_path, seed_pool="none"), ToolPool(tmp_path / "p2"), ["gcd"]) == {}
    # policy: the starting policy writes them; a random model verifies nothing, and held-out families are skipped
    p3 = ToolPool(tmp_path / "p3")
    got = seed_pool(_cfg(tmp_path, seed_pool="policy", eval_build_max_new_tokens=8), p3,
                    ["gcd", tasks.HELDOUT_FAMILIES[0]], tiny_model, tiny_tokenizer)
    assert got == {"gcd": False} and len(p3) == 0
    with pytest.raises(ValueError, match="seed_pool"):
        _cfg(tmp_path, seed_pool="everything")
    with pytest.raises(ValueError, match="use_share"):
        _cfg(tmp_path, use_share=1.5)


@pytest.mark.slow
@needs_sandbox
def test_tiny_recipe_two_steps_through_cli(tmp_path, repo_root, monkeypatch):
    from llmkit.cli import main

    monkeypatch.chdir(repo_root)
    out = tmp_path / "run"
    rc = main(["train", "smith", "--config", "recipes/configs/smith/tiny_cpu.yaml", "--output_dir", str(out)])
    assert rc == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rewards/schema_reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        for axis in ("schema_reward", "code_reward", "outcome_reward"):
            assert f"rewards/{axis}/mean" in m
        assert "smith/pool_size" in m
        assert m["smith/use_fraction"] == 0.5  # both kinds in every step, from the seeded pool
    res = json.loads((out / "eval.json").read_text())
    assert res["steps"] == 2 and (out / "pool").is_dir() and (out / "resolved_config.yaml").is_file()
    assert res["use_fraction"] == [0.5, 0.5] and res["seeded_pool"]["from"] == "reference"
    assert sum(res["seeded_pool"]["families"].values()) == len(tasks.TRAIN_FAMILIES)
    assert (out / "checkpoint-2").is_dir() and (out / "reward_curves.png").is_file()


def test_warm_start_rows_cover_both_kinds_per_training_family_and_refuse_heldout(tmp_path):
    from llmkit.tools.rollouts import parse_build, parse_use
    from llmkit.train.smith.recipe import warm_start_rows

    cfg = _cfg(tmp_path, warm_start_use_share=0.67)
    rows = warm_start_rows(cfg, list(tasks.TRAIN_FAMILIES), 54)
    use = [r for r in rows if "You can call this tool" in r["prompt"][-1]["content"]]
    assert len(use) == 36
    for kind in (use, [r for r in rows if r not in use]):
        names = {f.name for f in tasks.FAMILIES.values() for r in kind if f.reference.name in r["completion"][0]["content"]}
        assert names == set(tasks.TRAIN_FAMILIES)  # every training family as use AND as build traces
    for r in use:  # the targets are exactly what the parser reads
        call, ans = parse_use(r["completion"][0]["content"])
        assert isinstance(call["arguments"], dict) and ans
    for r in rows:
        if r not in use:
            spec, code = parse_build(r["completion"][0]["content"])
            assert spec["parameters"]["type"] == "object" and "def " in code
    with pytest.raises(ValueError, match="held-out"):
        warm_start_rows(cfg, [tasks.HELDOUT_FAMILIES[0]], 2)


def test_warm_start_top_layers_trains_only_the_top_and_unfreezes_after(tmp_path, tiny_model, tiny_tokenizer):
    import torch

    from llmkit.train.smith.recipe import freeze_below_top_layers, warm_start

    with pytest.raises(ValueError, match="model.layers"):
        freeze_below_top_layers(torch.nn.Linear(2, 2), 1)
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    cfg = _cfg(tmp_path, warm_start_steps=2, warm_start_top_layers=1, warm_start_lr=1e-3)
    warm_start(cfg, tiny_model, tiny_tokenizer, ["gcd", "digit_sum"], tmp_path)
    changed = {n for n, p in tiny_model.named_parameters() if not torch.equal(p.detach(), before[n])}
    top = len(tiny_model.model.layers) - 1
    assert any(f"layers.{top}." in n for n in changed)
    assert not any("layers.0." in n for n in changed)  # below the top layer: frozen during the warm start
    assert all(p.requires_grad for p in tiny_model.parameters())  # and trainable again for RL


def test_policy_is_made_ready_for_generation_after_training(tiny_model, tiny_tokenizer):
    from llmkit.tools.evaluate import local_generator
    from llmkit.train.smith.recipe import ready_for_generation

    conv = [[{"role": "user", "content": "write a tool"}], [{"role": "user", "content": "call it"}]]
    expected = local_generator(tiny_model.eval(), tiny_tokenizer, max_new_tokens=6)(conv)
    tiny_model.gradient_checkpointing_enable()
    tiny_model.train()  # the state a trainer leaves behind
    ready_for_generation(tiny_model)
    assert not tiny_model.training and not tiny_model.is_gradient_checkpointing
    assert local_generator(tiny_model, tiny_tokenizer, max_new_tokens=6)(conv) == expected
