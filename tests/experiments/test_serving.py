"""bench/serving.py's and bench/serving_robustness.py's workloads and tallies (llmkit.experiments.serving,
.serving_robustness), on the tiny in-process model and synthetic answers."""

from __future__ import annotations

import json
import sys

import pytest

from llmkit.experiments import serving as S
from llmkit.experiments import serving_robustness as R


@pytest.fixture(scope="module")
def tiny_server():
    from llmkit.engines.hf import HFEngine
    from llmkit.serving.server import BackgroundServer, ServerConfig, build_app
    from llmkit.testing import tiny_llama, tiny_tokenizer

    # the slow valid body trickles in over ~2 s: the body timeout must outlast it (the bench gives 15 s)
    cfg = ServerConfig(model_name="tiny", api_key=R.KEY, max_model_len=512, max_concurrency=512, body_timeout_s=5.0)
    with BackgroundServer(build_app(HFEngine(tiny_llama(), tiny_tokenizer()), cfg)) as server:
        yield server


def test_pct_is_nearest_rank_and_nan_when_empty():
    xs = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert S.pct(xs, 0.5) == 0.3 and S.pct(xs, 0.99) == 0.5 and S.pct(xs, 0.0) == 0.1
    assert S.pct([], 0.5) != S.pct([], 0.5)


def test_questions_reads_the_first_n(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(5)))
    assert S.questions(f, 3) == ["q0", "q1", "q2"]
    assert S.questions(f, 10) == [f"q{i}" for i in range(5)]


def test_combine_runs_sums_tokens_and_time():
    out = S.combine_runs({"wall_s": 2.0, "tokens": 10}, {"wall_s": 3.0, "tokens": 40})
    assert out == {"wall_s": 5.0, "tokens": 50, "tok_per_s": 10.0}


def test_client_figures_and_ratios_from_vllm_bench_json():
    out = {}
    for name, tput in (("vllm_server", 100.0), ("vllm_engine", 95.0), ("hf_engine", 40.0)):
        out.update(S.client_figures(name, {"completed": 4, "failed": 0, "output_throughput": tput,
                                           "median_ttft_ms": 12.0, "median_tpot_ms": 3.0, "errors": ["x"]}))
    assert set(out["client_hf_engine"]) == set(S.CLIENT_FIELDS)  # per-request errors are not copied
    assert out["ttft_ms_vllm_engine"] == 12.0 and out["client_failed_hf_engine"] == 0
    assert S.client_ratios(out) == pytest.approx({"served_vs_vllm_server_vllm_engine": 0.95,
                                                   "served_vs_vllm_server_hf_engine": 0.4})
    out["client_vllm_server"]["output_throughput"] = 0
    assert S.client_ratios(out)["served_vs_vllm_server_hf_engine"] is None


def test_write_results_ends_with_the_flat_summary(tmp_path, capsys):
    res = {"model": "m", "ratio": 1.23456, "nested": {"a": 1}, "none": None}
    assert S.write_results(res, tmp_path / "r.json") == 0
    assert json.loads((tmp_path / "r.json").read_text()) == res
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == {"model": "m", "ratio": 1.235, "none": None}


def test_drive_counts_completion_tokens_and_latencies(tiny_server):
    qs = ["What is 2 + 2?", "Name a colour.", "Count to three.", "Say hi."]
    r = S.drive(tiny_server.url, qs, clients=2, per_client=2, max_tokens=3, label="tiny", model="tiny",
                api_key=R.KEY)
    assert len(r["latencies"]) == 4 and r["latencies"] == sorted(r["latencies"])
    assert 0 < r["tokens"] <= 12 and r["tok_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_command_server_waits_for_health_and_stops():
    import httpx

    with S.command_server(lambda port: [sys.executable, "-c", HEALTH_SERVER, str(port)], timeout=60) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        proc = srv.proc
    assert proc.poll() is not None


def test_command_server_that_dies_names_its_log():
    dies = S.command_server(lambda port: [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], timeout=60)
    with pytest.raises(RuntimeError, match="exited with code 3.*boom"), dies:
        pass


# ----------------------------------------------------------------------------- robustness


def test_error_and_answer_bodies_are_recognised():
    err = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}})
    assert R.is_error_body(err)
    assert not R.is_error_body(json.dumps({"error": {"message": "", "type": "x", "param": None, "code": None}}))
    assert not R.is_error_body("Internal Server Error") and not R.is_error_body(json.dumps({"detail": "x"}))
    assert R.is_valid_answer(json.dumps({"choices": [{"text": "hi"}]}), stream=False)
    assert not R.is_valid_answer(json.dumps({"choices": []}), stream=False)
    assert R.is_valid_answer('data: {"x": 1}\n\ndata: [DONE]\n\n', stream=True)
    assert not R.is_valid_answer('data: {"x": 1}\n\n', stream=True)


def test_traffic_is_seeded_and_cycles_the_pools():
    t = R.traffic(100, 40, seed=0)
    assert t == R.traffic(100, 40, seed=0) and t != R.traffic(100, 40, seed=1)
    assert sum(k == "bad" for k, _ in t) == 100 and sum(k == "good" for k, _ in t) == 40
    assert all(m in ("GET", "POST", "PUT", "DELETE") and p.startswith("/") for _, (m, p, _b, _h) in t)
    assert len(R.raw_cases(3)) == 3 * len(R.RAW_WANT)


def test_results_pass_only_when_every_answer_is_right():
    err = json.dumps({"error": {"message": "no", "type": "t", "param": None, "code": None}})
    ok = json.dumps({"choices": [{"text": "x"}]})
    tagged = [("bad", ("POST", R.CHAT, b"{", {})), ("good", ("POST", R.CHAT, b"{}", {}))]
    raw = [("bad" if n != "slow_body" else "good", n, None) for n in R.RAW_WANT]
    raw_answers = [{"status": s, "text": ok if s == 200 else err, "sent": 10, "seconds": 0.1}
                   for s in R.RAW_WANT.values()]
    run = {"answers": [(400, err), (200, ok)], "raw_answers": raw_answers, "wall_s": 1.234, "rss_before": 10.0,
           "rss_after": 12.0, "alive": True, "health": 200, "after": 200}
    res = R.results(tagged, raw, run, model="m")
    assert res["passed"] and res["malformed_4xx"] == 1 and res["valid_200"] == 1 and res["failures"] == []
    assert res["hostile_raw"] == {k: "1/1" for k in R.RAW_WANT} and res["wall_s"] == 1.23
    assert list(res)[:4] == ["model", "engine", "malformed", "malformed_4xx"] and list(res)[-1] == "passed"
    bad_run = {**run, "answers": [(500, "oops"), (200, ok)]}
    res = R.results(tagged, raw, bad_run)
    assert not res["passed"] and res["malformed_statuses"] == {"500": 1} and res["failures"][0]["status"] == 500
    assert not R.results(tagged, raw, {**run, "alive": False, "health": None, "after": None})["passed"]


def test_every_case_is_answered_as_it_must_be_by_the_tiny_server(tiny_server):
    """The whole malformed pool, a slice of the valid one and one of each raw-socket client, all at once."""
    tagged = R.traffic(len(R.malformed_cases()), 15, seed=0, model="tiny")
    raw = R.raw_cases(1, model="tiny")
    run = R.hammer(tiny_server.url, None, lambda: True, tagged, raw)
    res = R.results(tagged, raw, run, model="tiny")
    assert res["passed"], res["failures"]
