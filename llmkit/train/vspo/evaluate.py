"""Behaviour rate and task accuracy of a model on held-out prompts, optionally steered (the guidance baseline)."""

from __future__ import annotations

from statistics import mean


def evaluate(model, tokenizer, rows: list[dict], behavior: str, *, max_new_tokens: int = 256, batch_size: int = 16,
             vector=None, alpha: float = 0.0, behavior_kwargs: dict | None = None, task_name: str = "gsm8k",
             progress: bool = True, keep_texts: bool = False,
             positions: str = "all", temperature: float = 0.0, seed: int = 0) -> dict:
    """Completions for ``rows`` (from ``data.build_rows``), scored by the task's grader and the behaviour.

    Greedy by default; ``temperature`` > 0 samples (seeded per batch from ``seed``), e.g. at the rollout
    temperature, where a steered model's behaviour rate can differ from its greedy one.

    Returns accuracy, behaviour rate, mean behaviour score, mean length in words, and the number of problems
    (and every completion under ``texts`` when ``keep_texts``).
    """
    from llmkit.evals.tasks import get_task
    from llmkit.generation import GenerationParams, chat_prompt, generate
    from llmkit.rewards.behaviors import get_behavior, strip_confidence, word_count
    from llmkit.steering import Steering

    task = get_task(task_name)
    b = get_behavior(behavior)
    bkw = behavior_kwargs or {}
    prompts = [chat_prompt(tokenizer, r["prompt"]) for r in rows]
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc=f"eval {behavior}" + (f" alpha={alpha:g}" if alpha else ""),
                       leave=False)
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            params = GenerationParams(max_new_tokens=max_new_tokens, temperature=float(temperature),
                                      seed=seed + start if temperature > 0 else None)
            if vector is not None and alpha:
                with Steering(model, vector, float(alpha), positions):
                    outs = generate(model, tokenizer, chunk, params, batch_size=batch_size)
            else:
                outs = generate(model, tokenizer, chunk, params, batch_size=batch_size)
            texts += [o.text for o in outs]
            if bar:
                bar.update(len(chunk))
        if bar:
            bar.close()
    finally:
        model.train(was_training)
    answers = [r["answer"] for r in rows]
    graded = [strip_confidence(t) for t in texts] if behavior == "confidence" else texts
    acc = [task.score(t, {"question": r["question"], "answer": r["answer"]})[task.primary]
           for t, r in zip(graded, rows)]
    hints = [r.get("hint") for r in rows]
    questions = [r["question"] for r in rows]
    rates = b.rates(texts, answers=answers, hints=hints, questions=questions, **bkw)
    reward = b.reward(**bkw)
    scores = reward(completions=texts, answer=answers, hint=hints, question=questions)
    out = {
        "n": len(rows),
        "accuracy": mean(acc) if acc else 0.0,
        "behavior_rate": mean(rates) if rates else 0.0,
        "behavior_score": mean(scores) if scores else 0.0,
        "mean_words": mean(word_count(t) for t in texts) if texts else 0.0,
        "alpha": float(alpha),
        "temperature": float(temperature),
        "samples": [{"completion": t, "correct": a, "behavior": r} for t, a, r in list(zip(texts, acc, rates))[:5]],
    }
    if keep_texts:
        out["texts"] = texts
    return out
