"""Answer equivalence with math-verify, plus last-``\\boxed{}`` extraction.

math-verify times its sympy parsing out with ``signal.alarm``, which only
works in the main thread; elsewhere (a server worker, a dataloader thread) we
turn its timeouts off rather than crash.
"""

from __future__ import annotations

import threading


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; None if absent."""
    best = None
    for tag in ("\\boxed", "\\fbox"):
        i = text.rfind(tag)
        if i > (best[0] if best else -1):
            best = (i, tag)
    if best is None:
        return None
    i = best[0] + len(best[1])
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5" form: up to the next space or $
        j = i
        while j < len(text) and text[j] not in " $\n":
            j += 1
        return text[i:j] or None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: an answer cut off by the token limit


def parse(text: str):
    from math_verify import parse as mv_parse

    t = _timeout()
    return mv_parse(text, parsing_timeout=t) if t else mv_parse(text, parsing_timeout=None)


def verify_answer(gold: str, prediction: str | None, prediction_is_answer: bool = False) -> bool:
    """Does ``prediction`` (a whole output, or an extracted answer when ``prediction_is_answer``) equal ``gold``?"""
    from math_verify import verify

    if prediction is None or not prediction.strip():
        return False
    g = parse(f"$\\boxed{{{gold}}}$")
    p = parse(f"$\\boxed{{{prediction}}}$") if prediction_is_answer else parse(prediction)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=_timeout()))
