"""Interop with what users already run: QLoRA through TRL's ModelConfig in every recipe, adapter folders
downstream (eval, chat, merge), and TRL's ScriptArguments data-field names with the old names deprecated."""

from __future__ import annotations

import json

import pytest
import torch

# recipe -> (config, extra args that point it at the test slice)
RECIPES = {
    "halo": ("recipes/configs/halo/tiny_cpu.yaml", ["--dataset_name", "{slice}", "--forget_data", ""]),
    "vspo": ("recipes/configs/vspo/tiny_cpu.yaml", ["--dataset_name", "{slice}", "--eval_path", "",
                                                    "--verbosity_min_words", "2", "--verbosity_max_words", "4"]),
    "smith": ("recipes/configs/smith/tiny_cpu.yaml", []),
    "hgms": ("recipes/configs/hgms/tiny_cpu.yaml", ["--sources", "a={slice}", "b={slice}", "--target_data", "{slice}"]),
}


def _train(repo_root, method, out, gsm8k_slice, *extra):
    from llmkit.cli import main

    config, args = RECIPES[method]
    if method == "smith":
        from llmkit.tools import sandbox

        if not sandbox.check_available()[0]:
            pytest.skip("SMITH runs model code only inside the sandbox, unavailable here")
    argv = ["train", method, "--config", str(repo_root / config), "--output_dir", str(out),
            *[a.replace("{slice}", str(gsm8k_slice)) for a in args], *extra]
    assert main(argv) == 0


@pytest.mark.parametrize("method", sorted(RECIPES))
def test_qlora_two_steps_in_every_recipe(method, repo_root, tmp_path, gsm8k_slice, monkeypatch):
    """load_in_4bit + use_peft trains LoRA adapters on bitsandbytes 4-bit base weights (its CPU path)."""
    import bitsandbytes as bnb

    from llmkit import models

    seen = {}
    real = models.load_for_training

    def spy(model_args, **kw):
        model, tok = real(model_args, **kw)
        seen["4bit"] = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        return model, tok

    monkeypatch.setattr(models, "load_for_training", spy)
    out = tmp_path / method
    _train(repo_root, method, out, gsm8k_slice, "--load_in_4bit", "true", "--use_peft", "true",
           "--lora_target_modules", "all-linear", "--max_steps", "2", "--save_steps", "2")
    assert seen["4bit"] >= 14  # 2 layers x 7 projections quantized (the LM head stays full precision)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2


def test_quantized_without_peft_warns(tmp_path):
    from trl import ModelConfig

    from llmkit.models import load_for_training

    with pytest.warns(UserWarning, match="use_peft"):
        load_for_training(ModelConfig(model_name_or_path="tiny-llama", load_in_4bit=True), output_dir=tmp_path)


def test_lora_run_output_is_usable_downstream_and_merges_exactly(repo_root, tmp_path, gsm8k_slice, monkeypatch):
    """A LoRA run's output folder (an adapter) loads in eval/chat, and `llmkit merge` gives a plain checkpoint
    whose logits equal base + adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmkit.cli import main
    from llmkit.models import resolve

    monkeypatch.setenv("LLMKIT_HOME", str(tmp_path / "home"))
    out = tmp_path / "lora"
    # a large learning rate so the adapter moves the logits visibly in 2 steps
    _train(repo_root, "halo", out, gsm8k_slice, "--use_peft", "true", "--lora_target_modules", "all-linear",
           "--learning_rate", "0.05")
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()

    ev = tmp_path / "eval"
    assert main(["eval", "gsm8k", "--model", str(out), "--data", str(gsm8k_slice), "--limit", "2",
                 "--max-new-tokens", "4", "--output", str(ev)]) == 0
    summary = json.loads((ev / "summary.json").read_text())
    assert summary["gsm8k"]["n"] == 2 and summary["gsm8k"]["model"] == str(out)

    merged = tmp_path / "merged"
    assert main(["merge", str(out), "--out", str(merged)]) == 0
    base = AutoModelForCausalLM.from_pretrained(out / "tiny-llama")
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(out))(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
    assert not torch.allclose(base_logits, peft_logits, atol=1e-4)  # the adapter does something
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-4, rtol=1e-4)
    # eval/serve/chat reach the adapter through resolve(): one merged copy, reused while the adapter is unchanged
    first = resolve(str(out))
    assert resolve(str(out)) == first and (tmp_path / "home" / "merged").is_dir()

    # the same adapter served by name beside its base (`llmkit serve --lora-modules trained=OUT`) answers like
    # the merged checkpoint, and the base name still answers like the base
    import openai

    from llmkit.cli import build_parser
    from llmkit.commands.serve import build_engine
    from llmkit.engines.hf import HFEngine
    from llmkit.generation import GenerationParams
    from llmkit.serving.server import BackgroundServer, ServerConfig, build_app

    args = build_parser().parse_args(["serve", "--lora-modules", f"trained={out}"])
    engine = build_engine(args)
    assert set(engine.adapters) == {"trained"}
    app = build_app(engine, ServerConfig(model_name="base", max_model_len=256))
    prompt = "Question: 2+2\nAnswer:"
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"base", "trained"}
        served = {m: client.completions.create(model=m, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
                  for m in ("base", "trained")}
    params = GenerationParams(max_new_tokens=8)
    assert served["trained"] == HFEngine(str(merged)).generate([prompt], params)[0][0].text
    assert served["base"] == HFEngine(str(out / "tiny-llama")).generate([prompt], params)[0][0].text


def test_merge_rejects_a_folder_that_is_not_an_adapter(tmp_path, capsys):
    from llmkit.cli import main

    (tmp_path / "plain").mkdir()
    assert main(["merge", str(tmp_path / "plain"), "--out", str(tmp_path / "o")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_old_data_field_names_still_work_with_a_deprecation(repo_root, tmp_path):
    from llmkit.commands.train import parse_method_args

    base = ["--config", str(repo_root / "recipes/configs/halo/tiny_cpu.yaml"), "--output_dir", str(tmp_path)]
    with pytest.warns(FutureWarning, match="train_data"):
        _, (halo_args, *_rest) = parse_method_args("halo", base + ["--train_data", "x.jsonl", "--train_split", "dev"])
    assert (halo_args.dataset_name, halo_args.dataset_train_split) == ("x.jsonl", "dev")
    with pytest.warns(FutureWarning, match="dataset_path"):
        _, (vspo_cfg, _m) = parse_method_args(
            "vspo", ["--config", str(repo_root / "recipes/configs/vspo/tiny_cpu.yaml"), "--output_dir",
                     str(tmp_path), "--dataset_path", "y.jsonl"])
    assert vspo_cfg.dataset_name == "y.jsonl"
    from llmkit.cli import UserError

    with pytest.raises((UserError, ValueError), match="both"):
        parse_method_args("halo", base + ["--train_data", "x.jsonl", "--dataset_name", "z.jsonl"])


# recipes/<method>.py under `accelerate launch` with 2 CPU processes (HALO's and HG-MS's own tests cover theirs;
# the arguments are the jobs' of the same name in conftest's ACCELERATE_JOBS):
# (result file, a line only the main process prints, side work that must run once)
ACCELERATE = {
    "vspo": ("eval.json", "results: ", ("eval before", "eval after")),
    "lqzo": ("lqzo_results.json", "[lqzo] results:", ("[lqzo] lqzo:",)),
    "smith": ("eval.json", "pool: ", ("eval before", "eval after")),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.accelerate_job(m)) for m in sorted(ACCELERATE)])
def test_two_process_accelerate_launch_on_cpu(method, accelerate_batch):
    result_file, main_only_line, once = ACCELERATE[method]
    r = accelerate_batch[method]
    out = r.out
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.world_size == 2, r.stderr[-3000:]  # really two ranks: each saved its own rng_state_<rank>.pth
    res = json.loads((out / result_file).read_text())
    if method in ("lqzo", "smith"):  # they also record it in their results
        assert res["world_size"] == 2
    # side work (evaluations, plots, the results file) ran once, on the main process
    assert r.stdout.count(main_only_line) == 1, r.stdout[-3000:]
    for line in once:
        assert r.stdout.count(line) == 1, (line, r.stdout[-3000:])


@pytest.mark.parametrize("name", ["multi_gpu", "zero2", "zero3"])
def test_shipped_accelerate_configs_load_in_accelerate(repo_root, name):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(repo_root / "recipes" / "accelerate" / f"{name}.yaml"))
    assert cfg.num_processes == 8 and not cfg.use_cpu
    assert str(cfg.distributed_type).endswith("DEEPSPEED" if name.startswith("zero") else "MULTI_GPU")
    if name.startswith("zero"):
        assert cfg.deepspeed_config["zero_stage"] == int(name[-1])
