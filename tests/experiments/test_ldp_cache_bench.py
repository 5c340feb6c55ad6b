"""The LDPCache bench's main run, ablation and fixed-budget section end to end on a stand-in cloud and tiny
streams; the JSON they write keeps the keys of the committed results; bench/ldp_cache.py stays parsing + calls."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI

from llmkit.experiments.ldp_cache import equal_epsilon as E
from llmkit.experiments.ldp_cache import fixed_budget as F
from llmkit.experiments.ldp_cache import runs as X
from llmkit.experiments.ldp_cache import workload as W
from llmkit.serving.ldp_cache import ExponentialTokenMechanism, LDPScheduler
from llmkit.serving.ldp_cache.embedder import HashEmbedder
from llmkit.serving.server import BackgroundServer

PROBLEMS = [
    {
        "question": f"Tom has {i} red apples and buys {i + 2} green ones. What is {i} plus {i + 2}?",
        "gold": str(2 * i + 2),
    }
    for i in range(10)
]
VOCAB = [
    "<unk>",
    "tom",
    "has",
    "red",
    "apples",
    "and",
    "buys",
    "green",
    "ones",
    ".",
    "what",
    "is",
    "plus",
    "?",
    *map(str, range(14)),
]


def mech(eps: float = 6.0):
    return ExponentialTokenMechanism.word_level(
        VOCAB, np.random.default_rng(0).normal(size=(len(VOCAB), 8)), eps
    )


def answer(text: str) -> str:
    """A cloud that adds the two numbers of "What is a plus b" when they survived the perturbation."""
    m = re.search(r"what is (\d+) plus (\d+)", text.lower())
    return f"The answer is {int(m[1]) + int(m[2])}." if m else "I think 0."


def stand_in_cloud():
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        return {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "stand-in",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer(body["messages"][-1]["content"])},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    return app


def flags(**kw):
    base = {
        "quick": True,
        "workloads": "uniform_arith,zipf_arith",
        "problems": 10,
        "pool": 10,
        "visits": 6,
        "capacity": 3,
        "repeats": 2,
        "sweep_seeds": 1,
        "sweep_repeats": 1,
        "sweep_capacities": "2",
        "upstream": None,
        "server_engine": "hf",
        "model": None,
        "answers": None,
        "seed": 0,
        "max_tokens": 16,
        "concurrency": 4,
        "sim_threshold": 0.8,
        "gain_threshold": 0.1,
        "rr_epsilon": 3.0,
        "epsilon_per_token": 6.0,
    }
    return SimpleNamespace(**(base | kw))


def committed(name: str, repo_root) -> dict:
    return json.loads((repo_root / "bench" / "results" / f"{name}.json").read_text())


def test_importing_the_method_package_loads_no_benchmark_code():
    code = (
        "import sys, llmkit.serving.ldp_cache, llmkit.serving.ldp_cache.budget, llmkit.serving.ldp_cache.proxy; "
        "print([m for m in sys.modules if m.startswith('llmkit.experiments')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_plan_takes_quick_or_full_defaults_and_refuses_unknown_workloads():
    none = {
        k: None
        for k in (
            "problems",
            "pool",
            "visits",
            "capacity",
            "repeats",
            "sweep_seeds",
            "sweep_repeats",
            "sweep_capacities",
        )
    }
    q = E.make_plan(flags(**none))
    assert (q.capacity, q.repeats, q.sweep_seeds, q.sweep_repeats, q.capacities) == (3, 5, 3, 4, [2, 3, 4, 6])
    assert q.sizes == W.QUICK_SIZES and q.kinds == ["uniform_arith", "zipf_arith"]
    full = E.make_plan(flags(quick=False, workloads="uniform, zipf", **none | {"pool": 30}))
    assert full.kinds == ["uniform", "zipf"] and full.sizes["zipf"] == 30 and full.sizes["uniform"] == 20
    assert full.visits == W.FULL_VISITS and full.capacities == [2, 3, 4, 6, 8, 12] and full.repeats == 20
    with pytest.raises(ValueError, match="unknown workload 'fifo'"):
        E.make_plan(flags(workloads="zipf,fifo"))


def test_figure_keys_and_result_stems_follow_the_workloads():
    assert (
        E.figure_suffix("zipf", ["uniform", "zipf"]) == "" and E.figure_suffix("uniform", ["uniform"]) == ""
    )
    assert E.figure_suffix("uniform", ["uniform", "zipf"]) == "_uniform"
    assert E.figure_suffix("zipf_arith", ["zipf_arith"]) == "_zipf_arith"
    assert E.result_stem(["uniform_arith", "zipf_arith"], False) == "ldp_cache_arith"
    assert E.result_stem(["uniform", "zipf_arith"], True) == "ldp_cache_mixed_quick"
    assert E.result_stem(["zipf"], True) == "ldp_cache_quick"


def test_the_main_run_asks_once_per_query_and_problem_and_replays_from_its_answers_file(tmp_path, repo_root):
    plan = E.make_plan(flags())
    problem_sets = {k: PROBLEMS for k in plan.kinds}
    streams = {k: W.build(k, PROBLEMS, plan.visits[k], 0) for k in plan.kinds}
    tools = {
        "mechanism": X.MemoMechanism(mech()),
        "embedder": X.MemoEmbedder(HashEmbedder()),
        "sched": lambda: LDPScheduler(3.0, 0.8, 0.1),
    }
    answers = tmp_path / "answers.jsonl.gz"
    logged = []
    with BackgroundServer(stand_in_cloud()) as cloud:
        run = E.answer_and_evaluate(
            flags(upstream=cloud.url, answers=answers),
            plan,
            problem_sets,
            streams,
            log=logged.append,
            **tools,
        )
    n_problems = sum(len({x["problem"] for x in streams[k]}) for k in plan.kinds)
    assert run["model"] == "stand-in" and run["extra_calls"] == 0
    # one call per distinct text (a perturbed query or a plain question); cache misses replay them
    assert (
        0.8 * (sum(map(len, streams.values())) + n_problems)
        <= run["calls"]
        <= sum(map(len, streams.values())) + n_problems
    )
    assert len(X.MemoUpstream(None, answers).memo) == run["calls"]
    for k in plan.kinds:
        r = run["results"][k]
        assert set(r["arms"]) == {
            "no_cache",
            "ldpcache_multifactor",
            "ldpcache_lru",
            "ldpcache_unbounded",
            "gptcache_threshold",
        }
        assert r["accuracy_plain_problems"] == 1.0 and list(r["sweep"]) == ["2"] and r["pool"] == 10

    figures = E.run_figures(plan, streams, run["results"], log=logged.append)
    arith = committed("ldp_cache_arith", repo_root)
    fixed = set(committed("ldp_cache_fixed_budget", repo_root)["figures"])
    assert list(figures) == [k for k in arith["figures"] if k not in fixed]
    assert any(line.startswith("[pooled: uniform_arith, zipf_arith]") for line in logged)
    result = E.build_result(
        plan,
        run["results"],
        figures,
        model=run["model"],
        max_tokens=16,
        config={},
        mechanism="token",
        fixed_budget={"curves": {}, "pooled": {}},
    )
    assert list(result) == list(arith) and "curves" not in result["fixed_budget"]
    path = E.write_result(result, tmp_path, "ldp_cache_arith_quick")
    assert (
        json.loads(path.read_text())["figures"] == figures
        and (tmp_path / "ldp_cache_arith_quick.png").is_file()
    )

    # the answers file alone replays the run: no server, the same numbers
    again = E.answer_and_evaluate(
        flags(upstream="http://127.0.0.1:9", model="stand-in", answers=answers),
        plan,
        problem_sets,
        {k: W.build(k, PROBLEMS, plan.visits[k], 0) for k in plan.kinds},
        log=logged.append,
        **tools,
    )
    assert (
        again["calls"] == 0 and again["results"]["zipf_arith"]["arms"] == run["results"]["zipf_arith"]["arms"]
    )
    assert "every answer replayed" in E.header_line(
        flags(answers=answers, upstream="http://127.0.0.1:9"), plan, again
    )


def test_ask_all_fails_loudly_when_the_cloud_fails():
    def broken(messages, **params):
        raise RuntimeError("cloud down")

    from llmkit.serving.ldp_cache import PerQueryLDP, PrivacyLedger

    base = PerQueryLDP(broken, PrivacyLedger(":memory:", 1e18), mech())
    streams = {"zipf": W.build("zipf", PROBLEMS, 3, 0)}
    with pytest.raises(RuntimeError, match="cloud down"):
        E.ask_all(base, broken, streams, {"zipf": PROBLEMS}, seed=0, max_tokens=4, concurrency=2)


def test_served_passes_a_url_through_and_otherwise_serves_the_bundled_model(monkeypatch):
    started = []

    @contextmanager
    def fake_serve(args, env=None, cwd=None):
        started.append((args, env, cwd))
        yield SimpleNamespace(url="http://127.0.0.1:1234")

    monkeypatch.setattr(X, "ServeProcess", fake_serve)
    with X.served("http://elsewhere:1") as url:
        assert url == "http://elsewhere:1" and not started
    with X.served(None, "vllm", cwd="/repo") as url:
        assert url == "http://127.0.0.1:1234"
    with X.served(None, "hf"):
        pass
    assert [a for a, _, _ in started] == [["--engine", "vllm", "--enforce-eager"], ["--threads", "1"]]
    assert started[0][1]["HF_HUB_OFFLINE"] == "1" and started[0][2] == "/repo"


def test_spread_matches_numpy_and_the_ablation_pairs_every_policy_with_lru(repo_root):
    xs = [0.25, 0.5, 0.5, 0.75]
    s = X.spread(xs)
    assert s == pytest.approx(
        {"mean": 0.5, "std": float(np.std(xs, ddof=1)), "min": 0.25, "max": 0.75, "n": 4}
    )
    assert X.spread([0.3])["std"] == 0.0
    assert X.paired_spread(xs)["se"] == pytest.approx(np.std(xs, ddof=1) / 2)

    res = X.run_ablation(
        ["zipf"],
        {"zipf": PROBLEMS},
        {"zipf": 8},
        X.MemoMechanism(mech()),
        X.MemoEmbedder(HashEmbedder()),
        lambda: LDPScheduler(3.0, 0.8, 0.1),
        capacities=[2],
        workload_seeds=1,
        scheduler_seeds=2,
        seed=0,
        config={"quick": True},
    )
    assert list(res) == list(committed("ldp_cache_eviction_ablation", repo_root))
    cell = res["ablation"]["zipf"]["2"]
    assert set(cell) == set(X.ABLATION) and cell["lru"]["diff_vs_lru"] == 0 and cell["lru"]["n"] == 2
    assert len(X.ablation_lines(res)) == 1


def gsm8k_file(path):
    rows = [
        {
            "question": f"Tom has {i} red apples. He buys {i + 2} green ones. How many apples now?",
            "answer": f"He has <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2}",
        }
        for i in range(1, 13)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_fixed_budget_section_asks_the_bank_once_then_runs_from_the_answers_file(
    tmp_path, repo_root, monkeypatch
):
    settings = SimpleNamespace(
        quick=True,
        budgets="4",
        budget_repeats=1,
        data=gsm8k_file(tmp_path / "train.jsonl"),
        bank=8,
        budget_visits=6,
        budget_answers=tmp_path / "bank.jsonl",
        seed=0,
        upstream="http://cloud",
        model="stand-in",
        server_engine="hf",
        concurrency=2,
        bit_share=0.25,
        rr_epsilon=3.0,
        sim_threshold=0.8,
        gain_threshold=0.1,
    )
    asked = []

    def cloud(url, model, timeout):
        def call(messages, **params):
            asked.append(messages[-1]["content"])
            m = re.search(r"What is (\d+) plus (\d+)", messages[-1]["content"])
            return f"so {int(m[1]) + int(m[2])}"

        return call

    emb, logged = X.MemoEmbedder(HashEmbedder()), []
    section, figures = F.fixed_budget_section(settings, emb, 3, 16, upstream_cls=cloud, log=logged.append)
    assert len(asked) == 8 and section["bank_plain_correct"] == 8 and figures["accuracy_plain_bank"] == 1.0
    ref = committed("ldp_cache_fixed_budget_quick", repo_root)
    assert list(section) == list(ref) and list(figures) == list(ref["figures"])
    assert set(section["pooled"]["4.0"]) == set(F.ARMS) and section["figures"] is figures
    from matplotlib.figure import Figure

    # the figure is drawn but not rendered: rendering takes seconds, and the main run's test renders one
    monkeypatch.setattr(Figure, "tight_layout", lambda self, **kw: None)
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: open(path, "wb").close())
    path = F.write_fixed_budget(section, tmp_path, "fb")
    assert path.name == "fb.json" and (tmp_path / "fb.png").is_file()

    again, _ = F.fixed_budget_section(settings, emb, 3, 16, upstream_cls=cloud, log=logged.append)
    assert len(asked) == 8 and again["pooled"] == section["pooled"]  # every bank answer came from the file


def load_bench(repo_root):
    spec = importlib.util.spec_from_file_location("_ldp_bench", repo_root / "bench" / "ldp_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_bench_script_is_parsing_plus_calls(repo_root, capsys, tmp_path):
    assert len((repo_root / "bench" / "ldp_cache.py").read_text().splitlines()) <= 150
    bench = load_bench(repo_root)
    assert callable(bench.load_arith_problems)  # bench/select.py reads the problem set through the script
    opts = {o for a in bench.parser()._actions for o in a.option_strings}
    assert {
        "--quick",
        "--workloads",
        "--eviction-ablation",
        "--fixed-budget-only",
        "--answers",
        "--upstream",
        "--budgets",
        "--bit-share",
        "--fixed-budget-out",
        "--budget-answers",
    } <= opts
    assert (
        bench.main(["--workloads", "uniform,fifo"]) == 2
        and "unknown workload 'fifo'" in capsys.readouterr().err
    )
    assert (
        bench.main(["--data", str(tmp_path / "none.jsonl")]) == 2
        and "no such file" in capsys.readouterr().err
    )
