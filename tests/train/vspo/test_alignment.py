"""The alignment check: steered behaviour rates against the unsteered model, and the choice of vector/intensity."""

from __future__ import annotations

import pytest
import torch

from llmkit.train.vspo.alignment import answer_rate, format_table, intensity_range, measure, pick


def _row(vector, alpha, rate, acc=0.1, ans=1.0):
    return {"vector": vector, "alpha": alpha, "behavior_rate": rate, "accuracy": acc, "answer_rate": ans,
            "mean_words": 10.0, "n": 16, "layers": []}


def test_answer_rate_counts_extractable_final_numbers():
    assert answer_rate(["so 3 + 4 = 7\n#### 7", "no idea", "it is 12.", ""]) == 0.5
    assert answer_rate([]) == 0.0


def test_pick_takes_the_highest_rate_that_still_answers():
    table = [_row(None, 0.0, 0.0, acc=0.1, ans=1.0),
             _row("a", 1.0, 0.2), _row("a", 2.0, 0.5), _row("a", 3.0, 0.9, ans=0.5),  # loses the answer
             _row("b", 1.0, 0.6, acc=0.0)]  # loses accuracy (tolerance 0.05)
    p = pick(table)
    assert (p["vector"], p["alpha"], p["aligned"]) == ("a", 2.0, True)
    assert p["gain"] == pytest.approx(0.5)
    assert p["range"] == [1.0, 2.0]  # alpha 3 clears the rate threshold but loses the answer: outside the range


def test_intensity_range_is_the_contiguous_run_above_threshold():
    table = [_row("a", 0.5, 0.05), _row("a", 1.0, 0.3), _row("a", 2.0, 0.4), _row("a", 3.0, 0.05),
             _row("a", 4.0, 0.5)]
    assert intensity_range(table, "a", 2.0, 0.2) == [1.0, 2.0]
    assert intensity_range(table, "a", 0.5, 0.2) is None
    with pytest.raises(ValueError, match="not measured"):
        intensity_range(table, "a", 9.0, 0.2)


def test_pick_reports_a_misaligned_vector():
    p = pick([_row(None, 0.0, 0.1), _row("a", 1.0, 0.12), _row("a", 2.0, 0.0)])
    assert p["aligned"] is False and p["vector"] == "a" and p["range"] is None
    p = pick([_row(None, 0.0, 0.1), _row("a", 1.0, 0.9, ans=0.0)])
    assert p["aligned"] is False and p["vector"] is None
    with pytest.raises(ValueError, match="unsteered"):
        pick([_row("a", 1.0, 0.5)])


def test_measure_on_a_tiny_model_has_an_unsteered_row_and_one_per_vector_and_alpha(tiny_model, tiny_tokenizer):
    from llmkit.steering import SteeringVector

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "question": f"What is {i} + 2?",
             "answer": f"#### {i + 2}"} for i in range(3)]
    torch.manual_seed(0)
    vec = SteeringVector({1: torch.randn(tiny_model.config.hidden_size) * 4.0})
    table = measure(tiny_model, tiny_tokenizer, rows, {"v": vec, "w": (vec, "all", [2.0])}, [0.0, 1.0, 3.0],
                    "concise_answer", behavior_kwargs={"max_words": 30}, max_new_tokens=4, batch_size=4,
                    positions="answer")
    assert [(r["vector"], r["positions"], r["alpha"]) for r in table] == [
        (None, "all", 0.0), ("v", "answer", 1.0), ("v", "answer", 3.0), ("w", "all", 2.0)]
    assert all(r["n"] == 3 and 0 <= r["answer_rate"] <= 1 for r in table)
    assert len(format_table(table)) == 4 and format_table(table)[0].startswith("alignment unsteered alpha 0:")
    with pytest.raises(ValueError, match=">= 0"):
        measure(tiny_model, tiny_tokenizer, rows, {"v": vec}, [-1.0], "concise_answer")
    with pytest.raises(ValueError, match="candidate"):
        measure(tiny_model, tiny_tokenizer, rows, {}, [1.0], "concise_answer")
