"""The accuracy tasks of the LQZO recipe and bench: two-choice problems scored by log-likelihood.

Why ``sentiment`` (the default): the bundled 135M model is at a few percent on GSM8K (generation-
graded), where a few hundred zeroth-order steps on quantization scales cannot move anything
measurable, and generation on 2 shared CPU cores costs more than the training. Procedural
two-sentence reviews with a clear polarity (SST-2-like, the kind of prompted two-way choice on which
MeZO reports its results) are a task the full-precision model does above chance but not well
(bench/results/lqzo_quick.md), so there is room both to lose (quantization) and to gain (finetuning); it
is graded exactly without generation (the answer is the choice with the higher completion
log-likelihood), and the generator gives fresh held-out problems with no data file. ``compare``
(which of two numbers is larger) is kept as a harder option: the bundled model is at chance on it
(it echoes the first number).
"""

from __future__ import annotations

import random

import torch

PROMPT = "Which number is larger, {a} or {b}? Answer with the number only."


def compare_rows(n: int, seed: int = 0, lo: int = 10, hi: int = 99) -> list[dict]:
    """``n`` problems ``{question, answer, choices, label}``; train and test use different seeds."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.sample(range(lo, hi + 1), 2)
        big = max(a, b)
        rows.append({"question": PROMPT.format(a=a, b=b), "answer": str(big), "choices": [str(a), str(b)],
                     "label": 0 if a == big else 1})
    return rows


POSITIVE = ("wonderful", "excellent", "delightful", "fantastic", "great", "superb", "lovely", "brilliant",
            "charming", "pleasant", "outstanding", "enjoyable", "impressive", "friendly", "perfect", "amazing")
NEGATIVE = ("terrible", "awful", "dreadful", "horrible", "poor", "disappointing", "boring", "rude", "bland",
            "unpleasant", "mediocre", "annoying", "dirty", "broken", "miserable", "useless")
SUBJECTS = ("The food", "The movie", "The hotel room", "The service", "The concert", "The book", "The staff",
            "The new phone", "The game", "The trip", "The coffee", "The lecture")
SENTIMENT_PROMPT = ('Review: "{s1} was {a1}, and {s2} was {a2}."\nIs the sentiment of this review positive or '
                    'negative? Answer with one word.')


def sentiment_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` two-sentence reviews with a consistent polarity; choices ``positive``/``negative`` (SST-2-like)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randrange(2)
        words = POSITIVE if label == 0 else NEGATIVE
        s1, s2 = rng.sample(SUBJECTS, 2)
        a1, a2 = rng.sample(words, 2)
        rows.append({"question": SENTIMENT_PROMPT.format(s1=s1, a1=a1, s2=s2.lower(), a2=a2),
                     "answer": ["positive", "negative"][label], "choices": ["positive", "negative"],
                     "label": label})
    return rows


@torch.no_grad()
def choice_accuracy(model, tok, rows: list[dict], batch_size: int = 16) -> float:
    """Fraction of rows whose gold choice has the highest summed log-likelihood as the assistant reply."""
    pred = choice_scores(model, tok, rows, batch_size).argmax(-1)
    gold = torch.tensor([r["label"] for r in rows])
    return float((pred == gold).float().mean())


def accepts_logits_to_keep(model) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (the LM head on chosen positions only)."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def choice_scores(model, tok, rows: list[dict], batch_size: int = 16) -> torch.Tensor:
    """``(rows, choices)`` summed log-likelihoods of each choice as the assistant reply. The LM head projects
    only the positions that predict a choice token (``logits_to_keep``, where the model takes it)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    compact = accepts_logits_to_keep(model)
    seqs = []  # (row index, choice index, ids, first completion position)
    for i, r in enumerate(rows):
        prompt = tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False,
                                         add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for j, c in enumerate(r["choices"]):
            c_ids = tok(c, add_special_tokens=False)["input_ids"]
            if tok.eos_token_id is not None:
                c_ids = c_ids + [tok.eos_token_id]
            seqs.append((i, j, p_ids + c_ids, len(p_ids)))
    scores = torch.full((len(rows), max(len(r["choices"]) for r in rows)), -float("inf"))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for s in range(0, len(seqs), batch_size):
        batch = seqs[s:s + batch_size]
        width = max(len(x[2]) for x in batch)
        ids = torch.tensor([x[2] + [pad] * (width - len(x[2])) for x in batch], device=device)
        attn = torch.tensor([[1] * len(x[2]) + [0] * (width - len(x[2])) for x in batch], device=device)
        keep = sorted({p for _, _, x, start in batch for p in range(start - 1, len(x) - 1)})  # p predicts p + 1
        at = {p: k for k, p in enumerate(keep)}
        keep_t = torch.tensor(keep, device=device)
        if compact:
            logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep_t).logits
        else:
            logits = model(input_ids=ids, attention_mask=attn).logits[:, keep_t]
        logp = torch.log_softmax(logits.float(), -1)
        for b, (i, j, x, start) in enumerate(batch):
            cols = torch.tensor([at[p] for p in range(start - 1, len(x) - 1)], device=device)
            scores[i, j] = logp[b, cols, torch.tensor(x[start:], device=device)].sum().item()
    if was_training:
        model.train()
    return scores


TASK_ROWS = {"sentiment": sentiment_rows, "compare": compare_rows}
