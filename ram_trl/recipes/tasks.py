"""Small verifiable tasks for the embedded CPU demo: prompt generators and TRL reward functions (docs/recipes.md)."""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "PROGRAMS",
    "TOOLS",
    "arithmetic_prompts",
    "arithmetic_reward",
    "completion_text",
    "mixture",
    "program_prompts",
    "program_reward",
    "recall_prompts",
    "recall_reward",
    "tool_call_prompts",
    "tool_call_reward",
]


def completion_text(completion: Any) -> str:
    """A completion as TRL passes it (string or messages), up to its first newline, stripped."""
    if isinstance(completion, list):
        completion = "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion).split("\n", 1)[0].strip()


def unique_rows(make: Callable[[random.Random], dict[str, str]], n: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows with distinct prompts drawn by ``make`` from one seeded ``random.Random``."""
    rng = random.Random(seed)
    rows: dict[str, dict[str, str]] = {}
    attempts = 0
    while len(rows) < n:
        row = make(rng)
        rows.setdefault(row["prompt"], row)
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct prompts (only {len(rows)} exist); ask for fewer")
    return list(rows.values())


# arithmetic (coding-like)


def arithmetic_prompts(n: int, seed: int = 0, max_operand: int = 49, ops: str = "+-") -> list[dict[str, str]]:
    """Prompts ``"a+b="`` / ``"a-b="`` with operands in ``[0, max_operand]`` (``a >= b`` for subtraction)."""
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"ops={ops!r}: use a non-empty combination of '+', '-', '*'")

    def make(rng: random.Random) -> dict[str, str]:
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and a < b:
            a, b = b, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return {"prompt": f"{a}{op}{b}=", "answer": str(value)}

    return unique_rows(make, n, seed)


def _prefix_share(text: str, answer: str) -> float:
    matched = 0
    for got, want in zip(text, answer, strict=False):
        if got != want:
            break
        matched += 1
    return matched / len(answer) if answer else 0.0


def arithmetic_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 for the exact result, else 0.5 x (share of the result's characters right from the left)."""
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        text = completion_text(completion)
        rewards.append(1.0 if text == want else 0.5 * _prefix_share(text, want))
    return rewards


# program output (coding)

#: Function name -> what it does to a lowercase word: the "programs" whose output :func:`program_prompts` asks for.
PROGRAMS: dict[str, Callable[[str], str]] = {
    "rev": lambda word: word[::-1],
    "sort": lambda word: "".join(sorted(word)),
    "upper": str.upper,
    "next": lambda word: "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in word),
}


def program_prompts(n: int, seed: int = 0, length: int = 5) -> list[dict[str, str]]:
    """Predict a one-line program's output (CRUXEval-style, at toy scale): ``'rev("kqfzb")='`` -> ``"bzfqk"``."""
    if length < 1:
        raise ValueError(f"length={length} must be at least 1")

    def make(rng: random.Random) -> dict[str, str]:
        name = rng.choice(sorted(PROGRAMS))
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        return {"prompt": f'{name}("{word}")=', "answer": PROGRAMS[name](word)}

    return unique_rows(make, n, seed)


def program_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 for exactly the program's output, else 0.5 x (share of its characters right from the left)."""
    return arithmetic_reward(completions, answer)


# tool calls (tool use)

_CITIES = (
    "Oslo",
    "Lima",
    "Rome",
    "Pune",
    "Kyiv",
    "Nice",
    "Bern",
    "Baku",
    "Doha",
    "Riga",
    "Faro",
    "Cork",
    "Graz",
    "Kobe",
    "Lyon",
    "Gent",
    "Nara",
    "Perm",
    "Sofia",
    "Turin",
)

#: Tool name -> (its two argument names, each argument's values, question templates naming them by position).
TOOLS: dict[str, tuple[tuple[str, ...], tuple[tuple[str, ...], ...], tuple[str, ...]]] = {
    "weather": (
        ("city", "day"),
        (_CITIES, ("mon", "tue", "wed", "thu", "fri", "sat", "sun")),
        ("weather in {0} on {1}?", "rain in {0} {1}?", "{1}: is it cold in {0}?"),
    ),
    "flight": (("src", "dst"), (_CITIES, _CITIES), ("fly {0} to {1}?", "flights from {0} to {1}?")),
    "stock": (
        ("ticker", "days"),
        (
            ("AAPL", "MSFT", "NVDA", "IBM", "SAP", "ASML", "AMD", "INTC", "ORCL", "UBER", "SONY", "TSLA"),
            tuple("123456789"),
        ),
        ("price of {0} over {1} days?", "{1}-day chart of {0}?"),
    ),
    "wiki": (
        ("topic", "lang"),
        (
            (
                "cats",
                "rust",
                "jazz",
                "moon",
                "tea",
                "chess",
                "bees",
                "maps",
                "rice",
                "owls",
                "wind",
                "gold",
                "silk",
                "kites",
                "ants",
                "ice",
            ),
            ("en", "de", "fr", "es"),
        ),
        ("look up {0} in {1}", "what is {0}? ({1})", "tell me about {0} in {1}"),
    ),
}

_CALL = re.compile(r"^([A-Za-z_]\w*)\((\s*\w+\s*=\s*[^,()=]+\s*(?:,\s*\w+\s*=\s*[^,()=]+\s*)*)?\)$")


def tool_call_prompts(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Questions one tool answers; the answer is the call, e.g. ``weather(city=Oslo,day=mon)``."""

    def make(rng: random.Random) -> dict[str, str]:
        tool = rng.choice(sorted(TOOLS))
        names, domains, templates = TOOLS[tool]
        values = [rng.choice(domain) for domain in domains]
        while tool == "flight" and values[0] == values[1]:
            values[1] = rng.choice(domains[1])
        arguments = ",".join(f"{k}={v}" for k, v in zip(names, values, strict=True))
        return {"prompt": rng.choice(templates).format(*values) + " ", "answer": f"{tool}({arguments})"}

    return unique_rows(make, n, seed)


def parse_call(text: str) -> tuple[str, dict[str, str]] | None:
    """``"name(k=v,...)"`` -> ``("name", {"k": "v"})``; ``None`` if the text is not a well-formed call."""
    match = _CALL.match(text)
    if match is None:
        return None
    arguments: dict[str, str] = {}
    if match.group(2):
        for part in match.group(2).split(","):
            key, value = part.split("=", 1)
            if key.strip() in arguments:
                return None
            arguments[key.strip()] = value.strip()
    return match.group(1), arguments


def tool_call_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """0.2 for a well-formed call of the wrong tool; the right tool 0.5 + 0.5 x the share of exact arguments
    (over the larger argument count); 0 for anything else."""
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        got = parse_call(completion_text(completion))
        expected = parse_call(want)
        if got is None or expected is None:
            rewards.append(0.0)
            continue
        if got[0] != expected[0]:
            rewards.append(0.2)
            continue
        matched = sum(1 for key, value in got[1].items() if expected[1].get(key) == value)
        rewards.append(0.5 + 0.5 * matched / max(len(expected[1]), len(got[1]), 1))
    return rewards


# recall (memory)


def recall_prompts(n: int, seed: int = 0, num_pairs: int = 6, key_length: int = 2) -> list[dict[str, str]]:
    """A context of ``num_pairs`` ``key=digit`` pairs, then a question for one key: ``"ka=3;qb=7;...;qb?"`` -> ``"7"``."""
    if num_pairs < 1 or num_pairs > 26**key_length:
        raise ValueError(f"num_pairs={num_pairs} must be between 1 and 26**key_length")

    def make(rng: random.Random) -> dict[str, str]:
        keys: list[str] = []
        while len(keys) < num_pairs:
            key = "".join(rng.choice(string.ascii_lowercase) for _ in range(key_length))
            if key not in keys:
                keys.append(key)
        values = [str(rng.randint(0, 9)) for _ in keys]
        asked = rng.randrange(num_pairs)
        context = ";".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))
        return {"prompt": f"{context};{keys[asked]}?", "answer": values[asked]}

    return unique_rows(make, n, seed)


def recall_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 for exactly the key's value, else 0."""
    return [1.0 if completion_text(c) == want else 0.0 for c, want in zip(completions, answer, strict=True)]


def mixture(parts: Sequence[Sequence[dict[str, str]]], seed: int = 0) -> list[dict[str, str]]:
    """Interleave several tasks' rows (a seeded shuffle of their concatenation), e.g. for a supervised warm start."""
    rows = [row for part in parts for row in part]
    random.Random(seed).shuffle(rows)
    return rows
