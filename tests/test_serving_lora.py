"""`llmkit serve --lora-modules name=path`: each PEFT adapter is a model in /v1/models and answers as that
adapter would offline; requests for different adapters and the base share one batch (PEFT's per-row
``adapter_names``). The adapters are random (non-zero) LoRAs on the tiny model, so each one changes
the answers.
"""

from __future__ import annotations

import json
import threading

import openai
import pytest
import torch

from llmkit.cli import UserError, build_parser, main
from llmkit.engines.hf import HFEngine
from llmkit.generation import GenerationParams
from llmkit.serving.server import BackgroundServer, ServerConfig, build_app

PROMPTS = ["hello", "a longer prompt here", "xyz"]


def _adapter(base_dir, out, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # large enough that greedy answers change
    peft.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from llmkit.testing import tiny_llama, tiny_tokenizer

    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    tiny_llama().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    return str(base), {"alpha": _adapter(base, root / "alpha", 1), "beta": _adapter(base, root / "beta", 2)}


def _offline(base, adapter, prompt, n):
    """Greedy text of one adapter (or the base) with PEFT alone, no server."""
    from peft import PeftModel

    eng = HFEngine(base)
    if adapter is not None:
        eng.model = PeftModel.from_pretrained(eng.model, adapter).eval()
    return eng.generate([prompt], GenerationParams(max_new_tokens=n))[0][0].text


@pytest.mark.slow  # nine offline references beside the server
def test_adapters_are_models_and_answer_like_peft_offline(folders):
    base, adapters = folders
    engine = HFEngine(base)
    engine.load_adapters(adapters)
    app = build_app(engine, ServerConfig(model_name="base", max_model_len=256))
    with BackgroundServer(app) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"base", "alpha", "beta"}
        assert listed["alpha"].model_extra["parent"] == "base" and listed["alpha"].model_extra["root"] == adapters["alpha"]
        got: dict = {}

        def ask(model, prompt):  # all at once: one batch holds rows of every adapter
            got[model, prompt] = client.completions.create(model=model, prompt=prompt, max_tokens=10,
                                                           temperature=0).choices[0].text

        jobs = [threading.Thread(target=ask, args=(m, p)) for m in ("base", "alpha", "beta") for p in PROMPTS]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join()
        streamer = app.state.server.streamer
        assert streamer.max_batch_seen >= 3
        with pytest.raises(openai.NotFoundError, match="alpha"):
            client.completions.create(model="gamma", prompt="x", max_tokens=2)
    for p in PROMPTS:
        ref = {"base": _offline(base, None, p, 10), "alpha": _offline(base, adapters["alpha"], p, 10),
               "beta": _offline(base, adapters["beta"], p, 10)}
        assert len(set(ref.values())) == 3, p  # the adapters really change the answer
        for m, text in ref.items():
            assert got[m, p] == text, (m, p)


def test_lora_modules_flag(folders, capsys):
    from llmkit.commands.serve import build_engine, parse_lora_modules

    base, adapters = folders
    args = build_parser().parse_args(["serve", "--model", base, "--lora-modules", f"alpha={adapters['alpha']}",
                                      json.dumps({"name": "beta", "path": adapters["beta"]})])
    engine = build_engine(args)
    assert engine.adapters == {"alpha": adapters["alpha"], "beta": adapters["beta"]}
    # without --model the base comes from the adapter's config
    args = build_parser().parse_args(["serve", "--lora-modules", f"alpha={adapters['alpha']}"])
    assert build_engine(args).model_name == base
    with pytest.raises(UserError, match="NAME=PATH"):
        parse_lora_modules(["just-a-path"])
    with pytest.raises(UserError, match="adapter_config.json"):
        parse_lora_modules([f"x={base}"])
    with pytest.raises(UserError, match="twice"):
        parse_lora_modules([f"a={adapters['alpha']}", f"a={adapters['beta']}"])
    assert main(["serve", "--model", base, "--lora-modules", f"a={adapters['alpha']}", "--guard", "nowhere"]) == 2
    assert "--guard and --lora-modules" in capsys.readouterr().err


def test_gpu_flags_go_to_the_right_engine(folders, capsys):
    base, _ = folders
    assert main(["serve", "--model", base, "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size works only with --engine vllm" in capsys.readouterr().err
    assert main(["serve", "--engine", "vllm", "--device", "cuda"]) == 2
    assert "--device works only with --engine hf" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["serve", "--model", base, "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_vllm_flags_reach_the_engine(monkeypatch, folders):
    import llmkit.engines.vllm as v
    from llmkit.commands.serve import build_engine

    seen = {}

    class FakeVLLM:
        def __init__(self, model, **kw):
            seen.update(kw, model=model)
            self.tokenizer = type("T", (), {"chat_template": None})()

    monkeypatch.setattr(v, "VLLMEngine", FakeVLLM)
    base, adapters = folders
    args = build_parser().parse_args(["serve", "--engine", "vllm", "--model", base, "--tensor-parallel-size", "4",
                                      "--gpu-memory-utilization", "0.85", "--trust-remote-code", "--chat-template",
                                      "{{ messages[0]['content'] }}", "--lora-modules", f"a={adapters['alpha']}"])
    eng = build_engine(args)
    assert seen["tensor_parallel_size"] == 4 and seen["gpu_memory_utilization"] == 0.85
    assert seen["trust_remote_code"] is True and seen["lora_modules"] == {"a": adapters["alpha"]}
    assert eng.tokenizer.chat_template == "{{ messages[0]['content'] }}"


def test_chat_template_flag_and_device_on_hf(folders, tmp_path):
    from llmkit.commands.serve import build_engine

    base, _ = folders
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    eng = build_engine(build_parser().parse_args(["serve", "--model", base, "--chat-template", str(tpl),
                                                  "--device", "cpu"]))
    assert eng.chat_prompt([{"role": "user", "content": "q"}]) == "<<q>>"
    assert eng.model.device.type == "cpu"
