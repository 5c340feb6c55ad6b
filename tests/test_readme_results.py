"""The README's results table and bench/results/<name>.md are generated from the committed JSON (bench/report.py)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pages_and_readme_block_match_the_json(report):
    stale = report.stale(REPO)
    assert not stale, ("generated results differ from bench/results/*.json; run `python bench/report.py`: "
                       + ", ".join(str(p.relative_to(REPO)) for p in stale))


def test_every_committed_json_has_a_page_listed_in_the_index(report):
    index = (REPO / "bench" / "results" / "README.md").read_text()
    committed = report.committed_json(REPO)
    assert len(committed) > 10
    for p in committed:
        assert (p.with_suffix(".md")).is_file(), p.name
        assert f"]({p.stem}.md)" in index, p.stem


@pytest.fixture()
def small_repo(tmp_path):
    """A copy of the README and two results JSON files, enough to regenerate and tamper with."""
    (tmp_path / "bench" / "results").mkdir(parents=True)
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    for name in ("kv_cache", "ldp_cache_fixed_budget"):
        shutil.copy(REPO / "bench" / "results" / f"{name}.json", tmp_path / "bench" / "results")
    return tmp_path


def test_a_changed_figure_makes_its_page_and_the_readme_stale(report, small_repo):
    for path, text in report.render_all(small_repo).items():
        path.write_text(text)
    assert report.stale(small_repo) == []
    f = small_repo / "bench" / "results" / "kv_cache.json"
    data = json.loads(f.read_text())
    data["arms"]["ppl"]["inquant/per-token/score"] *= 1.05
    f.write_text(json.dumps(data))
    stale = {p.name for p in report.stale(small_repo)}
    assert stale == {"kv_cache.md", "README.md"}


def test_a_hand_edit_of_a_generated_page_is_caught(report, small_repo):
    for path, text in report.render_all(small_repo).items():
        path.write_text(text)
    page = small_repo / "bench" / "results" / "ldp_cache_fixed_budget.md"
    page.write_text(page.read_text().replace("B/Q 8", "B/Q 8 both reach the model's plain accuracy", 1))
    assert [p.name for p in report.stale(small_repo)] == ["ldp_cache_fixed_budget.md"]


def test_findings_are_stated_from_the_full_runs(report):
    """The sentences issue 34 found contradicting the JSON now come from it (full runs, not quick ones)."""
    res = REPO / "bench" / "results"
    kv = json.loads((res / "kv_cache.json").read_text())
    ppl = kv["arms"]["ppl"]
    page = (res / "kv_cache.md").read_text()
    assert f"{(ppl['inquant/per-token/score'] / ppl['bf16'] - 1) * 100:+.1f}%" in page
    assert f"{(ppl['inquant/per-token/none'] / ppl['bf16'] - 1) * 100:+.1f}%" in page
    guard = json.loads((res / "guard.json").read_text())
    above = [k for k, v in guard["dispersion_per_layer"]["gsm8k_inject"].items() if v["logdet"]["ratio"] > 1]
    assert f"scatter more (log-det ratio > 1) at layers {above[0]}-" in (res / "guard.md").read_text()
    assert "halo_full_lr3e-5_n32" in (res / "halo.md").read_text()


def test_readme_opens_with_the_two_commands_and_links_the_results(report):
    text = (REPO / "README.md").read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert first_block.splitlines()[:2] == [
        "make demo   # set up .venv (once) and run the main job on the bundled model",
        "make test   # set up the same .venv (once) and run the whole test suite",
    ]
    assert text.index("make demo") < text.index("## ")
    assert "bench/results/README.md" in text
    assert "shared/seeds" not in text


def test_rows_merge_intervals_and_spreads(report):
    rows = dict(report.rows({"acc": 0.5, "acc_ci95": [0.25, 0.75], "loss": 1.0, "loss_std": 0.125, "w": 0.5, "w_ci": [0, 1],
                             "auroc": {"auroc": 0.7, "low": 0.6, "high": 0.8}, "steps": {"mean": 3.0, "std": 1.0, "n": 3},
                             "curve": list(range(20)), "note": "x" * 500}))
    assert rows == {"acc": "0.5 [0.25, 0.75]", "loss": "1 ± 0.125", "w": "0.5 [0, 1]", "auroc": "0.7 [0.6, 0.8]", "steps": "3 ± 1 (n=3)"}


def test_splice_needs_one_marker_pair(report):
    assert report.splice(f"a\n{report.START}\nold\n{report.END}\nb", "new") == f"a\n{report.START}\nnew\n{report.END}\nb"
    with pytest.raises(ValueError, match="results:start"):
        report.splice("no markers here", "new")


def test_a_finding_whose_figures_are_missing_is_left_out(report):
    import report_findings as rf  # bench/ is on sys.path once report.py is loaded

    assert rf.said(rf._kv_ppl, lambda d, _: "kept")({}, None) == ["kept"]
    assert rf.spans([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"


def test_no_module_docstring_over_40_lines():
    """Docstrings hold the paper, the algorithm and the deviations; what was measured lives on the results pages."""
    import ast

    long = {}
    for p in sorted((REPO / "llmkit").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if doc and len(doc.splitlines()) > 40:
            long[str(p.relative_to(REPO))] = len(doc.splitlines())
    assert not long, f"module docstrings over 40 lines: {long}"


def test_guard_quick_page_states_the_default_scores_cross_source_figures():
    """Issue 37: the default score (best worst-case cross-source AUROC) with that AUROC, its realized FPR, its
    AUROC per pair and why any pair is left out are stated on the page, from the JSON."""
    res = REPO / "bench" / "results"
    d = json.loads((res / "guard_quick.json").read_text())
    f, page = d["figures"], (res / "guard_quick.md").read_text()
    worst = {k: f[f"worst_cross_auroc_{k}"] for k in ("energy", "entropic", "probe", "combined")}
    k = f["default_score"]
    assert worst[k] == max(worst.values())
    assert f"the default score is {k} (best worst case, {worst[k]:.3f})" in page
    assert f"realized FPR of {f['realized_fpr_' + k]:.3f}" in page
    for name in d["cross_source_comparable_pairs"]:
        assert f"{name} AUROC {f[f'auroc_cross_{name}_{k}']:.3f}" in page
    for name, why in d["cross_source_left_out"].items():
        assert f"{name}: {why}" in page
