"""Verifiable tasks for a real instruct model in its chat template (smollm2-agents.yaml, docs/small-model-rl.md)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ram_trl.recipes.tasks import unique_rows

__all__ = [
    "AGENT_TOOLS",
    "DEFAULT_SYSTEM",
    "EXAMPLE_CALL",
    "chat_prompt",
    "code_writing_prompts",
    "code_writing_reward",
    "fact_recall_prompts",
    "fact_recall_reward",
    "json_tool_call_prompts",
    "json_tool_call_reward",
    "run_sandboxed",
    "schema_valid",
]

#: SmolLM2-Instruct's default system message (its chat template inserts it when a conversation has none).
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_prompt(user: str, system: str | None = DEFAULT_SYSTEM) -> str:
    """``user`` in ChatML with the generation prompt, as SmolLM2-Instruct's ``apply_chat_template`` renders it."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _strip_fences(text: str) -> str:
    text = re.sub(r"```[A-Za-z]*", "", str(text))
    return text.replace("`", "").strip()


def _completion(completion: Any) -> str:
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


# coding: write a program that prints something

_WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "robot", "maple", "ocean", "pixel", "delta")
#: A fenced block (its language tag, its content, its closing fence or the end of the reply: a cut-off block).
_FENCED_BLOCK = re.compile(r"```[^\n`]*\n?(.*?)(?:```|\Z)", re.S)
#: Punctuation around a near-miss answer token ("23.", "`23`").
_AROUND = ".,;:!?\"'`"

#: Task -> (what the program must print, its output), drawn from words and numbers.
_CODE_TASKS: dict[str, Callable[[list[str], list[int]], tuple[str, str]]] = {
    "sum": lambda w, v: (f"the sum of {v[0]} and {v[1]}", str(v[0] + v[1])),
    "difference": lambda w, v: (f"{v[0]} minus {v[1]}", str(v[0] - v[1])),
    "product": lambda w, v: (f"{v[0]} times {v[2]}", str(v[0] * v[2])),
    "largest": lambda w, v: (f"the largest of the numbers {v[0]}, {v[1]} and {v[2]}", str(max(v))),
    "smallest": lambda w, v: (f"the smallest of the numbers {v[0]}, {v[1]} and {v[2]}", str(min(v))),
    "upper": lambda w, v: (f'the word "{w[0]}" in capital letters', w[0].upper()),
    "length": lambda w, v: (f'the number of letters in the word "{w[0]}"', str(len(w[0]))),
    "reverse": lambda w, v: (f'the word "{w[0]}" backwards', w[0][::-1]),
    "repeat": lambda w, v: (f'the word "{w[0]}" three times with no spaces', w[0] * 3),
    "join": lambda w, v: (f'the words "{w[0]}" and "{w[1]}" joined with a dash', f"{w[0]}-{w[1]}"),
}


def code_writing_prompts(n: int, seed: int = 0, system: str | None = DEFAULT_SYSTEM) -> list[dict[str, str]]:
    """A request for a short Python program that prints a value (arithmetic, min/max, a string operation); the
    answer is what it must print, graded by :func:`code_writing_reward` executing the reply's program."""

    def make(rng: random.Random) -> dict[str, str]:
        task = _CODE_TASKS[rng.choice(sorted(_CODE_TASKS))]
        words = rng.sample(_WORDS, 2)
        numbers = [rng.randint(10, 99), rng.randint(2, 99), rng.randint(2, 9)]
        what, output = task(words, numbers)
        user = f"Write a Python program that prints {what}. Reply with the program only, in a ```python block."
        return {"prompt": chat_prompt(user, system), "answer": output}

    return unique_rows(make, n, seed)


#: Runs a program in a child interpreter: no imports, no names or attributes with underscores, a few builtins,
#: 512 MiB of memory and 2 s of CPU; exit 3 when the program is refused.
_SANDBOX = """
import ast, builtins, sys
try:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (1 << 29, 1 << 29))
    resource.setrlimit(resource.RLIMIT_CPU, (2, 2))
except (ImportError, ValueError, OSError):
    pass
tree = ast.parse(sys.stdin.read())
for node in ast.walk(tree):
    name = getattr(node, "attr", getattr(node, "id", ""))  # an attribute's or a variable's name
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)) or name.startswith("_"):
        sys.exit(3)
names = "abs all any bool dict enumerate float int len list map max min print range reversed round set sorted str sum tuple zip"
exec(compile(tree, "<reply>", "exec"), {"__builtins__": {k: getattr(builtins, k) for k in names.split()}})
"""


def run_sandboxed(source: str, timeout: float = 5.0) -> str | None:
    """What ``source`` prints (trailing newlines stripped) when run in a restricted child interpreter, or ``None``
    when it is refused, fails or runs past ``timeout`` seconds. A guard against a small model's mistakes (loops that
    never end, huge strings), not a security boundary against hostile code."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _SANDBOX],
            input=source,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.rstrip("\n") if done.returncode == 0 else None


def code_writing_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the reply's program (its first fenced block, else the whole reply) prints exactly the answer, 0.5
    when the last token of what it prints is the answer (``The sum is 23.``), else 0 (also when it fails)."""
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        text = _completion(completion)
        block = _FENCED_BLOCK.search(text)
        printed = run_sandboxed(block.group(1) if block else text)
        tokens = (printed or "").split()
        if printed == want:
            rewards.append(1.0)
        elif tokens and tokens[-1].strip(_AROUND) == want:
            rewards.append(0.5)
        else:
            rewards.append(0.0)
    return rewards


# tool use: JSON calls checked against a schema

_CITIES = ("Oslo", "Lima", "Rome", "Paris", "Tokyo", "Cairo", "Berlin", "Madrid", "Dublin", "Seoul")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")

#: Tool name -> its arguments' JSON schema (shown in the prompt, checked by the reward), requests, draws.
AGENT_TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "day": {"type": "string", "enum": list(_DAYS)}},
            "required": ["city", "day"],
        },
        "requests": ("What's the weather in {city} on {day}?", "Will it rain in {city} on {day}?"),
        "draw": lambda rng: {"city": rng.choice(_CITIES), "day": rng.choice(_DAYS)},
    },
    "convert_currency": {
        "schema": {
            "type": "object",
            "properties": {
                "amount": {"type": "integer"},
                "from": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]},
                "to": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]},
            },
            "required": ["amount", "from", "to"],
        },
        "requests": ("Convert {amount} {from} to {to}.", "How much is {amount} {from} in {to}?"),
        "draw": lambda rng: dict(
            zip(
                ("amount", "from", "to"),
                [rng.randint(5, 500), *rng.sample(["USD", "EUR", "JPY", "GBP"], 2)],
                strict=True,
            )
        ),
    },
    "set_timer": {
        "schema": {
            "type": "object",
            "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}},
            "required": ["minutes", "label"],
        },
        "requests": ("Set a {minutes} minute timer for {label}.", "Remind me about {label} in {minutes} minutes."),
        "draw": lambda rng: {
            "minutes": rng.randint(1, 90),
            "label": rng.choice(["tea", "pasta", "laundry", "a call", "the oven", "a break"]),
        },
    },
}

_TYPES = {"string": str, "integer": int, "object": dict}


#: The example call every tool prompt shows (values outside every draw, so it never is the answer).
EXAMPLE_CALL = '{"name": "set_timer", "arguments": {"minutes": 120, "label": "bread"}}'


def _tool_list() -> str:
    # "name: schema" lines, not {"name": ..., "parameters": ...} objects: a small model copies the listing's shape
    return "\n".join(
        f"{name}: {json.dumps(spec['schema'], separators=(',', ':'))}" for name, spec in sorted(AGENT_TOOLS.items())
    )


def json_tool_call_prompts(n: int, seed: int = 0, system: str | None = DEFAULT_SYSTEM) -> list[dict[str, str]]:
    """A request one of :data:`AGENT_TOOLS` answers, the schemas in the prompt; the answer is the compact JSON call."""
    tools = _tool_list()

    def make(rng: random.Random) -> dict[str, str]:
        name = rng.choice(sorted(AGENT_TOOLS))
        spec = AGENT_TOOLS[name]
        arguments = spec["draw"](rng)
        request = rng.choice(spec["requests"]).format(**arguments)
        user = (
            f"Tools (name: JSON schema of the arguments):\n{tools}\nRequest: {request}\n"
            f"Reply with one JSON tool call only, for example {EXAMPLE_CALL}"
        )
        answer = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
        return {"prompt": chat_prompt(user, system), "answer": answer}

    return unique_rows(make, n, seed)


def _json_object(text: str) -> Any:
    """The first JSON object in ``text`` (code fences ignored), or ``None``."""
    text = _strip_fences(text)
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text[match.start() :])
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def schema_valid(arguments: dict[str, Any], schema: dict[str, Any]) -> bool:
    """Whether ``arguments`` fit a flat JSON schema: required keys, no others, types (a bool is no integer), enums."""
    properties = schema["properties"]
    if set(schema["required"]) - set(arguments) or set(arguments) - set(properties):
        return False
    for key, value in arguments.items():
        rule = properties[key]
        wanted = _TYPES[rule["type"]]
        if isinstance(value, bool) or not isinstance(value, wanted):
            return False
        if "enum" in rule and value not in rule["enum"]:
            return False
    return True


def json_tool_call_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """0.25 each: a JSON call object, the right tool, schema-valid arguments, exactly the expected arguments."""
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        expected = json.loads(want)
        call = _json_object(_completion(completion))
        if not (
            isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)
        ):
            rewards.append(0.0)
            continue
        score = 0.25
        if call["name"] == expected["name"]:
            score += 0.25
            if schema_valid(call["arguments"], AGENT_TOOLS[expected["name"]]["schema"]):
                score += 0.25
            if call["arguments"] == expected["arguments"]:
                score += 0.25
        rewards.append(score)
    return rewards


# memory: recall a fact from a longer context

_NAMES = (
    "Mia", "Omar", "Lena", "Ravi", "Sofia", "Jonas", "Aiko", "Pedro", "Nora", "Ivan", "Zoe", "Kofi", "Elif", "Hugo",
    "Yara", "Tariq",
)  # fmt: skip
_ATTRIBUTES = ("locker code", "room number", "badge number", "parking spot")


def fact_recall_prompts(
    n: int, seed: int = 0, num_facts: int = 8, system: str | None = DEFAULT_SYSTEM
) -> list[dict[str, str]]:
    """A context of ``num_facts`` records about distinct people, then a question about one of them."""
    if not 1 <= num_facts <= len(_NAMES):
        raise ValueError(f"num_facts={num_facts} must be between 1 and {len(_NAMES)}")

    def make(rng: random.Random) -> dict[str, str]:
        attribute = rng.choice(_ATTRIBUTES)
        people = rng.sample(_NAMES, num_facts)
        values = [str(rng.randint(100, 9999)) for _ in people]
        asked = rng.randrange(num_facts)
        facts = " ".join(f"The {attribute} of {p} is {v}." for p, v in zip(people, values, strict=True))
        user = f"{facts}\nWhat is the {attribute} of {people[asked]}? Reply with the number only."
        return {"prompt": chat_prompt(user, system), "answer": values[asked]}

    return unique_rows(make, n, seed)


def fact_recall_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's first number is the asked value, 0.5 when another of its numbers is, else 0."""
    rewards = []
    for completion, want in zip(completions, answer, strict=True):
        numbers = re.findall(r"\d+", _completion(completion))
        rewards.append(1.0 if numbers[:1] == [want] else 0.5 if want in numbers else 0.0)
    return rewards
