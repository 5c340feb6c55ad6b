"""SMITH's task suite: 13 procedural families with seeded generators, exact verifiers and reference tools.

Nine training families and four held-out families (never shown in training, neither as build nor as use tasks).
Ten families come from ``reasoning-gym`` (its generators and its questions; its ``score_answer`` gives partial
credit, so every family here has its own exact verifier: the answer is canonicalized, e.g. integers parsed,
comma lists split, and compared for equality). Two training families (``caesar_shift``, ``digit_sum``) use our
own generators; reasoning-gym's Caesar task does not state the shift, so no tool could solve it exactly.

Each instance carries the question text, the tool arguments (the structured input a tool gets) and the answer
string. A tool for a family maps the arguments to a value; :meth:`Family.to_answer` turns the value into an answer
string (lists of factors joined by " × ", lists of words by ", ", everything else ``str``) and
:meth:`Family.verify` checks an answer string exactly. Each family's reference tool (a :class:`ToolSpec`) is used
only by the tests and the ground-truth-tool baseline, never to seed the training pool.

    from llmkit.tools import tasks
    fam = tasks.get("gcd"); inst = fam.generate(n=4, seed=0)
    fam.verify("12", inst[0])
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from llmkit.tools.spec import ToolSpec

__all__ = [
    "EVAL_SEED_OFFSET",
    "FAMILIES",
    "HELDOUT_FAMILIES",
    "TRAIN_FAMILIES",
    "Family",
    "Instance",
    "get",
    "names",
]

# instances for evaluation and for verifying built tools come from seeds >= this; training prompts from below
EVAL_SEED_OFFSET = 1_000_000


@dataclass
class Instance:
    family: str
    question: str
    args: dict
    answer: str
    seed: int = 0


@dataclass
class Family:
    name: str
    split: str  # "train" | "heldout"
    source: str  # "reasoning_gym" | "own"
    make: Callable[[int, int], list[tuple[str, dict, str]]]  # (seed, n) -> [(question, args, answer)]
    canonical: Callable[[str], object]
    reference: ToolSpec
    hint: str = ""  # one line shown in build prompts: what the examples compute
    join: str | None = None  # how a list value becomes an answer string
    meta: dict = field(default_factory=dict)

    def generate(self, n: int, seed: int = 0) -> list[Instance]:
        return [Instance(self.name, q, a, ans, seed) for q, a, ans in _cached(self.name, seed, n)]

    def to_answer(self, value) -> str:
        if isinstance(value, (list, tuple)) and self.join is not None:
            return self.join.join(str(v) for v in value)
        return str(value)

    def verify(self, answer: str | None, instance: Instance) -> bool:
        """Exact: the canonical form of ``answer`` equals the canonical form of the true answer."""
        if answer is None:
            return False
        try:
            return self.canonical(str(answer)) == self.canonical(instance.answer)
        except (ValueError, TypeError):
            return False


# ---------------------------------------------------------------------------------------------- canonical forms
def _int(s: str) -> int:
    s = s.strip().rstrip(".")
    if not re.fullmatch(r"[+-]?\d+", s):
        raise ValueError(s)
    return int(s)


def _text(s: str) -> str:
    return " ".join(s.strip().split())


def _lower(s: str) -> str:
    return s.strip().lower()


def _bool(s: str) -> bool:
    t = s.strip().lower()
    if t not in ("true", "false"):
        raise ValueError(s)
    return t == "true"


def _factors(s: str) -> tuple[int, ...]:
    parts = [p for p in re.split(r"\s*[×x*,]\s*|\s+", s.strip()) if p]
    return tuple(sorted(_int(p) for p in parts))


def _comma_list(s: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in s.strip().split(","))


# ---------------------------------------------------------------------------------------------- generators
def _rg(name: str, extract: Callable[[dict], tuple[dict, str]]):
    def make(seed: int, n: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import reasoning_gym as rg

            ds = rg.create_dataset(name, seed=seed, size=n)
        out = []
        for i in range(n):
            e = ds[i]
            args, ans = extract(e)
            out.append((e["question"], args, ans))
        return out
    return make


_WORDS = ["apple", "river", "stone", "cloud", "light", "music", "paper", "green", "quiet", "sugar", "window",
          "bridge", "forest", "candle", "silver", "garden", "little", "orange", "planet", "winter", "summer",
          "yellow", "castle", "number", "simple", "rocket", "mirror", "dragon"]


def _caesar(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(_WORDS).upper() for _ in range(rng.randint(2, 4)))
        shift = rng.randint(1, 25)
        enc = "".join(chr((ord(c) - 65 + shift) % 26 + 65) if c.isalpha() else c for c in text)
        q = f"Encrypt the text \"{text}\" with a Caesar cipher that shifts every letter {shift} places forward " \
            f"(wrapping Z to A). Give only the encrypted text."
        out.append((q, {"text": text, "shift": shift}, enc))
    return out


def _digit_sum(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x = rng.randint(10, 10**rng.randint(3, 12))
        out.append((f"What is the sum of the decimal digits of {x}? Give only the number.", {"n": x},
                    str(sum(int(d) for d in str(x)))))
    return out


@lru_cache(maxsize=512)
def _cached(name: str, seed: int, n: int):
    return tuple(FAMILIES[name].make(seed, n))


# ---------------------------------------------------------------------------------------------- reference tools
def _tool(name, props, required, returns, code, description) -> ToolSpec:
    return ToolSpec(name=name, parameters={"type": "object", "properties": props, "required": required},
                    code=code.strip() + "\n", description=description, returns=returns)


_INT_LIST = {"type": "array", "items": {"type": "integer"}}
_REF = {
    "gcd": _tool("gcd_of", {"numbers": _INT_LIST}, ["numbers"], "integer", """
import math
def gcd_of(numbers: list) -> int:
    g = 0
    for x in numbers:
        g = math.gcd(g, x)
    return g
""", "Greatest common divisor of a list of integers."),
    "lcm": _tool("lcm_of", {"numbers": _INT_LIST}, ["numbers"], "integer", """
import math
def lcm_of(numbers: list) -> int:
    out = 1
    for x in numbers:
        out = out * x // math.gcd(out, x)
    return out
""", "Least common multiple of a list of positive integers."),
    "count_bits": _tool("count_one_bits", {"n": {"type": "integer"}}, ["n"], "integer", """
def count_one_bits(n: int) -> int:
    return bin(n).count("1")
""", "Number of 1 bits in the binary representation of n."),
    "base_conversion": _tool("convert_base", {"number": {"type": "string"}, "source_base": {"type": "integer"},
                                              "target_base": {"type": "integer"}},
                             ["number", "source_base", "target_base"], "string", """
def convert_base(number: str, source_base: int, target_base: int) -> str:
    value = int(number, source_base)
    if value == 0:
        return "0"
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while value:
        value, r = divmod(value, target_base)
        out = digits[r] + out
    return out
""", "Convert a number written in source_base to target_base (lowercase digits above 9)."),
    "letter_counting": _tool("count_letter", {"text": {"type": "string"}, "letter": {"type": "string"}},
                             ["text", "letter"], "integer", """
def count_letter(text: str, letter: str) -> int:
    return text.lower().count(letter.lower())
""", "How many times a letter occurs in a text, ignoring case."),
    "spell_backward": _tool("reverse_word", {"word": {"type": "string"}}, ["word"], "string", """
def reverse_word(word: str) -> str:
    return word[::-1]
""", "The word spelled backward."),
    "prime_factorization": _tool("prime_factors", {"n": {"type": "integer"}}, ["n"], "array", """
def prime_factors(n: int) -> list:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out
""", "Prime factors of n in increasing order, with multiplicity."),
    "caesar_shift": _tool("caesar_encrypt", {"text": {"type": "string"}, "shift": {"type": "integer"}},
                          ["text", "shift"], "string", """
def caesar_encrypt(text: str, shift: int) -> str:
    return "".join(chr((ord(c) - 65 + shift) % 26 + 65) if "A" <= c <= "Z" else c for c in text)
""", "Shift every uppercase letter forward by shift places, wrapping around."),
    "digit_sum": _tool("sum_digits", {"n": {"type": "integer"}}, ["n"], "integer", """
def sum_digits(n: int) -> int:
    return sum(int(d) for d in str(abs(n)))
""", "Sum of the decimal digits of n."),
    "count_primes": _tool("count_primes_between", {"start": {"type": "integer"}, "end": {"type": "integer"}},
                          ["start", "end"], "integer", """
def count_primes_between(start: int, end: int) -> int:
    if end < 2:
        return 0
    sieve = bytearray([1]) * (end + 1)
    sieve[0:2] = b"\\x00\\x00"
    for p in range(2, int(end ** 0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = bytearray(len(range(p * p, end + 1, p)))
    return sum(sieve[max(start, 0):end + 1])
""", "Number of primes p with start <= p <= end."),
    "word_sequence_reversal": _tool("reverse_words", {"words": {"type": "array", "items": {"type": "string"}}},
                                    ["words"], "array", """
def reverse_words(words: list) -> list:
    return list(reversed(words))
""", "The list of words in reverse order."),
    "isomorphic_strings": _tool("are_isomorphic", {"s": {"type": "string"}, "t": {"type": "string"}}, ["s", "t"],
                                "boolean", """
def are_isomorphic(s: str, t: str) -> bool:
    if len(s) != len(t):
        return False
    a, b = {}, {}
    for x, y in zip(s, t):
        if a.setdefault(x, y) != y or b.setdefault(y, x) != x:
            return False
    return True
""", "Whether s can be turned into t by a one-to-one character mapping."),
    "ransom_note": _tool("can_construct", {"ransom_note": {"type": "string"}, "magazine": {"type": "string"}},
                         ["ransom_note", "magazine"], "boolean", """
from collections import Counter
def can_construct(ransom_note: str, magazine: str) -> bool:
    need, have = Counter(ransom_note), Counter(magazine)
    return all(have[c] >= k for c, k in need.items())
""", "Whether the note can be written with the magazine's letters, each used once."),
}


def _fam(name, split, source, make, canonical, hint, join=None) -> Family:
    return Family(name, split, source, make, canonical, _REF[name], hint, join)


FAMILIES: dict[str, Family] = {f.name: f for f in [
    _fam("gcd", "train", "reasoning_gym",
         _rg("gcd", lambda e: ({"numbers": list(e["metadata"]["numbers"])}, e["answer"])), _int,
         "greatest common divisor of the numbers"),
    _fam("lcm", "train", "reasoning_gym",
         _rg("lcm", lambda e: ({"numbers": list(e["metadata"]["numbers"])}, e["answer"])), _int,
         "least common multiple of the numbers"),
    _fam("count_bits", "train", "reasoning_gym",
         _rg("count_bits", lambda e: ({"n": e["metadata"]["number"]}, e["answer"])), _int,
         "number of 1 bits of n in binary"),
    _fam("base_conversion", "train", "reasoning_gym",
         _rg("base_conversion", lambda e: ({"number": e["metadata"]["source_repr"],
                                            "source_base": e["metadata"]["source_base"],
                                            "target_base": e["metadata"]["target_base"]}, e["answer"])), _lower,
         "the number rewritten from source_base to target_base"),
    _fam("letter_counting", "train", "reasoning_gym",
         _rg("letter_counting", lambda e: ({"text": " ".join(e["metadata"]["span"]),
                                            "letter": e["metadata"]["target_letter"]}, e["answer"])), _int,
         "how often the letter occurs in the text"),
    _fam("spell_backward", "train", "reasoning_gym",
         _rg("spell_backward", lambda e: ({"word": e["metadata"]["word"]}, e["answer"])), _text,
         "the word spelled backward"),
    _fam("prime_factorization", "train", "reasoning_gym",
         _rg("prime_factorization", lambda e: ({"n": e["metadata"]["number"]}, e["answer"])), _factors,
         "the prime factors of n", join=" × "),
    _fam("caesar_shift", "train", "own", _caesar, _text, "the text with each letter shifted forward"),
    _fam("digit_sum", "train", "own", _digit_sum, _int, "sum of the decimal digits"),
    _fam("count_primes", "heldout", "reasoning_gym",
         _rg("count_primes", lambda e: ({"start": e["metadata"]["start"], "end": e["metadata"]["end"]},
                                        e["answer"])), _int, "how many primes lie in the range"),
    _fam("word_sequence_reversal", "heldout", "reasoning_gym",
         _rg("word_sequence_reversal", lambda e: ({"words": list(e["metadata"]["words"])}, e["answer"])),
         _comma_list, "the words in reverse order", join=", "),
    _fam("isomorphic_strings", "heldout", "reasoning_gym",
         _rg("isomorphic_strings", lambda e: ({"s": e["metadata"]["words"][0], "t": e["metadata"]["words"][1]},
                                              e["answer"])), _bool, "whether the two strings are isomorphic"),
    _fam("ransom_note", "heldout", "reasoning_gym",
         _rg("ransom_note", lambda e: ({"ransom_note": e["metadata"]["ransom_note"],
                                        "magazine": e["metadata"]["magazine"]}, e["answer"])), _bool,
         "whether the note can be built from the magazine"),
]}
TRAIN_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.split == "train")
HELDOUT_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.split == "heldout")


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown task family '{name}'; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def names(which: str = "all") -> tuple[str, ...]:
    """Family names: ``all``, ``train``, ``heldout``, or a comma-separated list of names (checked)."""
    if which == "all":
        return tuple(FAMILIES)
    if which == "train":
        return TRAIN_FAMILIES
    if which == "heldout":
        return HELDOUT_FAMILIES
    out = tuple(x.strip() for x in which.split(",") if x.strip())
    for x in out:
        get(x)
    return out


