"""lm-eval interop: lm-eval's own prompts in ``llmkit eval``, its results layout, and llmkit as an lm-eval model."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_prompt_style_lm_eval_builds_lm_evals_own_5_shot_contexts(shared_data):
    from llmkit.evals.lmeval import LmEvalGSM8K

    task = LmEvalGSM8K()
    rows = task.load(shared_data / "gsm8k" / "test.jsonl", limit=3)
    ctx = task.render(None, rows[1])
    assert ctx.endswith(f"Question: {rows[1]['question']}\nAnswer:")
    assert ctx.count("Question: ") == 6 and ctx.count("\n#### ") == 5  # 5 solved train examples, then the test
    assert "<|im_start|>" not in ctx  # plain text completion, no chat template
    assert task.stop[0] == "Question:" and task.max_new_tokens == 256
    # the shots differ between documents: lm-eval's seeded sampler, not a fixed prefix
    assert task.render(None, rows[0]).split("Question: ")[1] != ctx.split("Question: ")[1]


def test_prompt_style_lm_eval_sends_the_contexts_simple_evaluate_sends(shared_data):
    """The contexts `llmkit eval --prompt-style lm-eval` generates from are the ones lm-eval's own
    simple_evaluate hands a model (same shots from the same seeded sampler), caught by a recording model."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    from llmkit.evals.lmeval import LmEvalGSM8K, lmeval_task, lmeval_task_manager

    seen = []

    @register_model("llmkit-test-recorder")
    class Recorder(LM):
        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            seen.extend(r.args[0] for r in requests)
            return ["" for _ in requests]

    data = shared_data / "gsm8k" / "test.jsonl"
    lm_eval.simple_evaluate(model="llmkit-test-recorder", tasks=[lmeval_task("gsm8k", data)], limit=4,
                            task_manager=lmeval_task_manager())
    task = LmEvalGSM8K()
    rows = task.load(data, limit=4)
    assert sorted(seen) == sorted(task.render(None, r) for r in rows)


def test_results_json_has_lm_eval_layout_and_standard_errors(tmp_path):
    from llmkit.evals.lmeval import write_results_json

    samples = tmp_path / "gsm8k.jsonl"
    scores = [1.0, 0.0, 1.0, 1.0]
    samples.write_text("".join(json.dumps({"score": {"strict_match": s, "flexible_extract": 1.0}}) + "\n"
                               for s in scores))
    summary = {"gsm8k": {"metrics": {"strict_match": 0.75, "flexible_extract": 1.0}, "n": 4, "num_fewshot": 5,
                         "samples_file": str(samples), "max_new_tokens": 256, "temperature": 0.0}}
    doc = json.loads(write_results_json(summary, tmp_path).read_text())
    res = doc["results"]["gsm8k"]
    assert res["exact_match,strict-match"] == 0.75 and res["exact_match,flexible-extract"] == 1.0
    # lm-eval's mean_stderr: sample std / sqrt(n) = sqrt(0.25) / 2
    assert res["exact_match_stderr,strict-match"] == pytest.approx(0.25)
    assert res["exact_match_stderr,flexible-extract"] == 0.0
    assert doc["n-shot"]["gsm8k"] == 5 and doc["n-samples"]["gsm8k"]["effective"] == 4


def test_llmkit_is_an_lm_eval_model(tmp_path):
    """`--model llmkit` resolves in lm-eval's registry once llmkit.evals.lmeval is imported, and its
    loglikelihood agrees with a direct forward pass."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import llmkit.evals.lmeval  # noqa: F401  (registers the model)
    from llmkit.testing import tiny_llama, tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    lm = get_model("llmkit")(pretrained=str(folder), engine="hf", batch_size=2)
    req = Instance("loglikelihood", doc={}, arguments=("Question: 2+2\nAnswer:", " 4"), idx=0)
    (ll, greedy), = lm.loglikelihood([req])
    tok = tiny_tokenizer()
    ctx, cont = tok("Question: 2+2\nAnswer:")["input_ids"], tok(" 4")["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(lm.engine.model(torch.tensor([ctx + cont])).logits[0], -1)
    expected = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert ll == pytest.approx(expected, abs=1e-4) and isinstance(greedy, bool)
    gen = Instance("generate_until", doc={}, arguments=("Hello", {"until": ["\n"], "max_gen_toks": 5}), idx=0)
    out, = lm.generate_until([gen])
    assert isinstance(out, str) and "\n" not in out
    # a misspelt or unsupported argument is refused by name instead of dropped
    with pytest.raises(ValueError, match="devcie"):
        get_model("llmkit")(pretrained=str(folder), engine="hf", devcie="cuda")
    # InQuant through lm-eval: the engine gets the quantized cache and still generates
    lm_q = get_model("llmkit")(pretrained=str(folder), engine="hf", kv_cache="inquant", device="cpu")
    assert lm_q.engine.cache_factory is not None
    out_q, = lm_q.generate_until([gen])
    assert isinstance(out_q, str)


@pytest.mark.bundled
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lm_eval_through_llmkit_serve_equals_llmkit_eval_prompt_style_lm_eval(shared_data, tmp_path):
    """lm-eval's gsm8k task (its local-completions model talking to `llmkit serve`) and
    `llmkit eval --prompt-style lm-eval` give the same answers and scores on the same problems, each with
    lm-eval's full 5-shot context. Two problems show path equality as well as twenty (each costs a ~900-token
    prefill on one thread per path): each answer and its per-problem scores are compared, not only the means."""
    import lm_eval

    from llmkit.cli import main
    from llmkit.evals.lmeval import lmeval_task, lmeval_task_manager
    from llmkit.experiments.harness import ServeProcess

    limit, toks = 2, 32
    out = tmp_path / "llmkit"
    assert main(["eval", "gsm8k", "--prompt-style", "lm-eval", "--data", str(shared_data / "gsm8k" / "test.jsonl"),
                 "--limit", str(limit), "--max-new-tokens", str(toks), "--batch-size", "1", "--output",
                 str(out)]) == 0
    ours = json.loads((out / "summary.json").read_text())["gsm8k"]
    our_rows = [json.loads(x) for x in (out / "gsm8k.jsonl").read_text().splitlines()]
    assert list(out.glob("results_*.json"))

    task = lmeval_task("gsm8k", shared_data / "gsm8k" / "test.jsonl")
    with ServeProcess([], timeout=300) as server:
        res = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{server.url}/v1/completions", "model": "smollm2-135m-instruct",
                        "tokenizer_backend": None, "tokenized_requests": False, "num_concurrent": 1},
            tasks=[task], limit=limit, gen_kwargs=f"max_gen_toks={toks}", log_samples=True,
            task_manager=lmeval_task_manager())
    name = next(iter(res["results"]))
    theirs = res["results"][name]
    samples = sorted(res["samples"][name], key=lambda s: s["doc_id"])
    strict = [s for s in samples if s["filter"] == "strict-match"]
    flexible = [s for s in samples if s["filter"] == "flexible-extract"]
    assert [s["resps"][0][0] for s in strict] == [r["output"] for r in our_rows]
    # with few problems a mean can agree by chance; each problem's grade under both filters must agree
    assert [s["exact_match"] for s in strict] == [r["score"]["strict_match"] for r in our_rows]
    assert [s["exact_match"] for s in flexible] == [r["score"]["flexible_extract"] for r in our_rows]
    assert theirs["exact_match,strict-match"] == pytest.approx(ours["metrics"]["strict_match"])
    assert theirs["exact_match,flexible-extract"] == pytest.approx(ours["metrics"]["flexible_extract"])
