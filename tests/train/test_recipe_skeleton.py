"""The recipe skeleton (``llmkit.train.skeleton``) as every recipe uses it: each of the five recipes, run on its
``tiny_cpu.yaml`` with a tiny in-process model, saves its resolved config (YAML and JSON) and, run again with the
same output_dir, continues from the last checkpoint instead of starting over; a named checkpoint that does not
exist is one clear error. The resume rules themselves are checked on bare folders."""

from __future__ import annotations

import json

import pytest
import yaml

from llmkit.cli import UserError
from llmkit.train.skeleton import RecipeRun, parse_args, plot_reward_curves, resolve_resume

RESULTS = {"vspo": ("eval.json", "steps"), "smith": ("eval.json", "steps"), "halo": ("halo_results.json", "global_step"),
           "lqzo": ("lqzo_results.json", "global_step"), "hgms": ("hgms_results.json", "global_step")}


def _argv(method: str, repo_root, data, out) -> list[str]:
    base = ["--config", str(repo_root / f"recipes/configs/{method}/tiny_cpu.yaml"), "--output_dir", str(out),
            "--save_steps", "1"]
    extra = {
        "vspo": ["--dataset_name", str(data), "--eval_path", ""],
        "smith": ["--seed_pool", "none"],  # the pool is not under test; seeding it runs 9 sandboxed builds
        "halo": ["--dataset_name", str(data), "--forget_data", ""],
        "lqzo": ["--dataset_name", str(data), "--eval_data", str(data), "--max_eval_samples", "2",
                 "--accuracy_task", "none"],
        "hgms": ["--sources", f"gsm8k={data}", f"copy={data}", "--target_data", str(data), "--hgms_trust", "false"],
    }[method]
    return base + extra


def _sandbox_or_skip(method: str) -> None:
    if method == "smith":
        from llmkit.tools import sandbox

        if not sandbox.check_available()[0]:
            pytest.skip("bubblewrap cannot run here (SMITH runs model-written code only in the sandbox)")


def _run(method: str, argv: list[str]) -> int:
    from llmkit.commands.train import parse_method_args

    module, configs = parse_method_args(method, argv)
    return module.main(*configs)


def _train_steps(out) -> list[int]:
    """The steps of the training log lines (a loss or per-reward mean) in metrics.jsonl, in order."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["step"] for r in recs if "loss" in r and "train_runtime" not in r]


@pytest.mark.parametrize("method", ["vspo", "smith", "halo", "lqzo", "hgms"])
def test_recipe_saves_resolved_config_and_a_rerun_resumes(method, repo_root, tmp_path, gsm8k_slice, monkeypatch,
                                                          one_torch_thread):
    _sandbox_or_skip(method)
    monkeypatch.chdir(repo_root)  # the tiny configs name packaged files relative to the repository
    out = tmp_path / "run"
    argv = _argv(method, repo_root, gsm8k_slice, out)
    results_file, steps_key = RESULTS[method]

    assert _run(method, argv + ["--max_steps", "1"]) == 0
    assert (out / "checkpoint-1").is_dir()
    as_yaml = yaml.safe_load((out / "resolved_config.yaml").read_text())
    as_json = json.loads((out / "resolved_config.json").read_text())
    assert as_json == as_yaml
    assert as_json["output_dir"] == str(out) and as_json["max_steps"] == 1 and as_json["save_steps"] == 1
    assert as_json["model_name_or_path"] == "tiny-llama"  # the model config is merged in too
    assert _train_steps(out) == [1]

    # the same command with a longer budget continues at step 2 instead of redoing step 1
    assert _run(method, argv + ["--max_steps", "2"]) == 0
    assert json.loads((out / results_file).read_text())[steps_key] == 2
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert _train_steps(out) == [1, 2]

    # the identical command again: nothing left to train, nothing redone
    assert _run(method, argv + ["--max_steps", "2"]) == 0
    assert _train_steps(out) == [1, 2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

    with pytest.raises(UserError, match="checkpoint not found: .*checkpoint-99"):
        _run(method, argv + ["--resume_from_checkpoint", str(out / "checkpoint-99")])


def _fake_checkpoint(out, step: int):
    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    return ckpt


def test_resolve_resume_rules(tmp_path, capsys):
    out = tmp_path / "run"
    assert resolve_resume(None, out) is None                       # nothing there yet: a fresh start
    with pytest.raises(UserError, match="no checkpoint"):
        resolve_resume("true", out)
    _fake_checkpoint(out, 1)
    last = _fake_checkpoint(out, 10)
    assert resolve_resume(None, out) == str(last)                   # rerun: the last one, by step not by name
    assert f"resuming from {last}" in capsys.readouterr().out
    assert resolve_resume("", out) == resolve_resume("latest", out) == str(last)
    assert resolve_resume("false", out) is None and resolve_resume("none", out) is None
    assert resolve_resume(str(out / "checkpoint-1"), out) == str(out / "checkpoint-1")
    with pytest.raises(UserError, match=r"checkpoint not found: .*checkpoint-5"):
        resolve_resume(str(out / "checkpoint-5"), out)


def test_recipe_run_saves_config_on_the_main_process_only(tmp_path):
    from llmkit.train.halo.config import HaloArguments, HaloConfig

    args = HaloConfig(output_dir=str(tmp_path / "a"), use_cpu=True, report_to="none", max_steps=3)
    run = RecipeRun("halo", args, HaloArguments(halo_method="full"), args)
    assert run.resume is None and run.is_main
    resolved = json.loads((tmp_path / "a" / "resolved_config.json").read_text())
    assert resolved["halo_method"] == "full" and resolved["max_steps"] == 3
    assert run.write_results("r.json", {"x": 1}).read_text() == '{\n  "x": 1\n}\n'
    assert run.plot_loss("t") is None                               # nothing logged yet

    class Rank1:
        output_dir = str(tmp_path / "b")
        process_index = 1
        resume_from_checkpoint = None

    assert not RecipeRun("halo", Rank1()).is_main and not (tmp_path / "b").exists()


def test_parse_args_reads_yaml_and_overrides_and_names_a_missing_config(repo_root, tmp_path):
    from trl import ModelConfig

    from llmkit.train.halo.config import HaloArguments, HaloConfig

    cfg = str(repo_root / "recipes/configs/halo/tiny_cpu.yaml")
    halo_args, targs, margs = parse_args((HaloArguments, HaloConfig, ModelConfig), ["--config", cfg, "--max_steps",
                                                                                    "7"], prog="t")
    assert targs.max_steps == 7 and margs.model_name_or_path == "tiny-llama" and halo_args.halo_method == "halo"
    with pytest.raises(UserError, match="config file not found: .*nope.yaml"):
        parse_args((HaloArguments, HaloConfig, ModelConfig), ["--config", str(tmp_path / "nope.yaml")], prog="t")


def test_plot_reward_curves_draws_the_keys_and_every_per_reward_mean(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "rewards/a/mean": 0.1 * s, "rewards/b/std": 1.0, "smith/pool_size": s} for s in (1, 2)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    png = plot_reward_curves(metrics, tmp_path / "r.png", "t", keys=("smith/pool_size", "absent"))
    assert png is not None and png.stat().st_size > 0
    assert plot_reward_curves(tmp_path / "missing.jsonl", tmp_path / "x.png", "t") is None
    metrics.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert plot_reward_curves(metrics, tmp_path / "y.png", "t") is None


def test_halo_and_hgms_trainers_are_module_level_classes_that_can_be_subclassed():
    from trl import SFTTrainer
    from trl.experimental.gkd import GKDTrainer

    from llmkit.train.halo import trainer as halo
    from llmkit.train.hgms import trainer as hgms

    class MyHgms(hgms.HgmsSFTTrainer):
        pass

    class MyHalo(halo.HaloSFTTrainer):
        pass

    assert issubclass(MyHgms, SFTTrainer) and MyHgms.update_weights is hgms.HgmsSFTTrainer.update_weights
    assert issubclass(MyHalo, halo.HaloTrainerMixin) and issubclass(halo.HaloGKDTrainer, GKDTrainer)
    assert halo.trainer_class(distill=False) is halo.HaloSFTTrainer  # the older factories still answer
    assert halo.trainer_class(distill=True) is halo.HaloGKDTrainer and hgms.trainer_class() is hgms.HgmsSFTTrainer
    assert hgms.HgmsSFTTrainer.__qualname__ == "HgmsSFTTrainer"  # defined at module level, not in a factory


def test_hgms_doremi_rerun_reuses_the_reference_it_trained(repo_root, tmp_path, gsm8k_slice, monkeypatch, capsys,
                                                           one_torch_thread):
    monkeypatch.chdir(repo_root)
    out = tmp_path / "run"
    argv = _argv("hgms", repo_root, gsm8k_slice, out) + ["--weighting", "doremi", "--doremi_reference_steps", "1"]
    assert _run("hgms", argv + ["--max_steps", "1"]) == 0
    assert "training the reference model" in capsys.readouterr().out
    weights = (out / "doremi_reference" / "model.safetensors").read_bytes()
    assert _run("hgms", argv + ["--max_steps", "2"]) == 0
    said = capsys.readouterr().out
    assert "training the reference model" not in said and "reference model saved in" in said
    assert (out / "doremi_reference" / "model.safetensors").read_bytes() == weights
    assert json.loads((out / "hgms_results.json").read_text())["global_step"] == 2
