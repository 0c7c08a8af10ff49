"""``ram_trl.recipes.agent_tasks``: the chat-template tasks of the SmolLM2 recipes, their answers and rewards."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re

import pytest

from ram_trl.recipes.agent_tasks import (
    AGENT_TOOLS,
    DEFAULT_SYSTEM,
    EXAMPLE_CALL,
    chat_prompt,
    code_writing_prompts,
    code_writing_reward,
    fact_recall_prompts,
    fact_recall_reward,
    json_tool_call_prompts,
    json_tool_call_reward,
    run_sandboxed,
    schema_valid,
)


def test_chat_prompt_is_chatml_with_the_generation_prompt():
    assert chat_prompt("hi") == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat_prompt("hi", system=None) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_prompt_matches_a_chatml_tokenizer_template():
    """The template SmolLM2-Instruct ships (its GGUF file's tokenizer.chat_template), applied by transformers."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
        "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    tokenizer.chat_template = template
    user = "What is 2 + 2?\nLine two."
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == chat_prompt(user)


# Reference programs for each code-writing task: what a correct reply runs (the answers are computed, not run).
_REFERENCE = {
    "the sum of (\\d+) and (\\d+)": "print({0} + {1})",
    "(\\d+) minus (\\d+)": "print({0} - {1})",
    "(\\d+) times (\\d+)": "print({0} * {1})",
    "the largest of the numbers (\\d+), (\\d+) and (\\d+)": "print(max({0}, {1}, {2}))",
    "the smallest of the numbers (\\d+), (\\d+) and (\\d+)": "print(min({0}, {1}, {2}))",
    'the word "(\\w+)" in capital letters': 'print("{0}".upper())',
    'the number of letters in the word "(\\w+)"': 'print(len("{0}"))',
    'the word "(\\w+)" backwards': 'print("{0}"[::-1])',
    'the word "(\\w+)" three times with no spaces': 'print("{0}" * 3)',
    'the words "(\\w+)" and "(\\w+)" joined with a dash': 'print("{0}" + "-" + "{1}")',
}


def test_code_writing_answers_are_what_a_reference_program_prints():
    rows = code_writing_prompts(80, seed=3)
    assert len({r["prompt"] for r in rows}) == 80 and rows == code_writing_prompts(80, seed=3)
    seen = set()
    for row in rows:
        request = row["prompt"].split("prints ", 1)[1].split(". Reply", 1)[0]
        pattern = next(p for p in _REFERENCE if re.fullmatch(p, request))
        seen.add(pattern)
        program = _REFERENCE[pattern].format(*re.fullmatch(pattern, request).groups())
        printed = io.StringIO()
        exec(program, {"print": functools.partial(print, file=printed)})  # noqa: S102 - the reference programs above
        assert printed.getvalue().rstrip("\n") == row["answer"], (request, row["answer"])
        assert row["prompt"].endswith("in a ```python block.<|im_end|>\n<|im_start|>assistant\n")
    assert seen == set(_REFERENCE)  # every task is drawn


def test_code_writing_draw_is_pinned():
    """The recipes' training, validation and test prompts come from this draw: a change to it changes their test set."""
    rows = code_writing_prompts(30, seed=4)
    assert hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == "01e1f273b8b850fe"


def test_code_writing_reward_runs_the_reply():
    completions = [
        "```python\nprint(30 + 4)\n```\nThis prints 34.",  # a fenced program: exact
        "```python\nx = 30\nprint(x + 4)",  # a block cut off by the token limit still runs
        'print("The sum is", 30 + 4)',  # no fence: the whole reply; last token is the answer
        'print(f"The sum is {30 + 4}.")',  # punctuation around the last token
        "```python\nprint(30 + 5)\n```",  # runs, wrong output
        "The answer is 34.",  # prose is no program
        "```python\nprint(34\n```",  # a syntax error
        "```python\nprint(34)\nprint(1)\n```",  # extra output: last token is not the answer
    ]
    assert code_writing_reward(completions, ["34"] * 8) == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert code_writing_reward([[{"role": "assistant", "content": 'print("OCEAN")'}]], ["OCEAN"]) == [1.0]


def test_sandbox_refuses_imports_dunders_and_runaway_programs():
    assert run_sandboxed('print("ab" * 2)') == "abab"
    assert run_sandboxed("s = 0\nfor i in range(4):\n    s += i\nprint(s)") == "6"
    assert run_sandboxed("import os\nprint(1)") is None  # no imports
    assert run_sandboxed("print(().__class__.__base__)") is None  # no dunder attributes
    assert run_sandboxed("print(open)") is None  # builtins outside the list are absent
    assert run_sandboxed('print(len("a" * 10**10))') is None  # memory limit
    assert run_sandboxed("while True:\n    pass", timeout=1.0) is None  # killed at the time limit
    assert run_sandboxed("print(1 / 0)") is None  # an error is no output


def test_tool_call_prompts_show_every_schema_and_answers_validate():
    rows = json_tool_call_prompts(40, seed=0)
    names = set()
    for row in rows:
        call = json.loads(row["answer"])
        names.add(call["name"])
        assert schema_valid(call["arguments"], AGENT_TOOLS[call["name"]]["schema"])
        for tool, spec in AGENT_TOOLS.items():
            assert f"\n{tool}: {json.dumps(spec['schema'], separators=(',', ':'))}\n" in row["prompt"]
        assert EXAMPLE_CALL in row["prompt"]
    assert names == set(AGENT_TOOLS)
    # the example call is a valid call that no row asks for
    example = json.loads(EXAMPLE_CALL)
    assert schema_valid(example["arguments"], AGENT_TOOLS[example["name"]]["schema"])
    compact = json.dumps(example, separators=(",", ":"))
    assert compact not in {r["answer"] for r in json_tool_call_prompts(1500, seed=1)}


def test_tool_call_reward_grades_format_tool_schema_and_arguments():
    want = '{"name":"set_timer","arguments":{"minutes":5,"label":"tea"}}'
    completions = [
        want,  # exact
        '```json\n{"name": "set_timer", "arguments": {"label": "tea", "minutes": 5}}\n```',  # same call, fenced
        '{"name":"set_timer","arguments":{"minutes":6,"label":"tea"}}',  # valid, wrong value
        '{"name":"set_timer","arguments":{"minutes":"5","label":"tea"}}',  # a string for an integer
        '{"name":"set_timer","arguments":{"minutes":true,"label":"tea"}}',  # a bool is not an integer
        '{"name":"set_timer","arguments":{"minutes":5,"label":"tea","x":1}}',  # an extra key
        '{"name":"get_weather","arguments":{"city":"Oslo","day":"monday"}}',  # wrong tool
        '{"name":"set_timer"}',  # no arguments
        "set_timer(minutes=5, label=tea)",  # not JSON
    ]
    assert json_tool_call_reward(completions, [want] * len(completions)) == [
        1.0,
        1.0,
        0.75,
        0.5,
        0.5,
        0.5,
        0.25,
        0.0,
        0.0,
    ]
    weather = '{"name":"get_weather","arguments":{"city":"Oslo","day":"monday"}}'
    bad_enum = '{"name":"get_weather","arguments":{"city":"Oslo","day":"Mon"}}'
    assert json_tool_call_reward([bad_enum], [weather]) == [0.5]


def test_fact_recall_prompts_and_reward():
    rows = fact_recall_prompts(30, seed=0, num_facts=8)
    for row in rows:
        assert row["prompt"].count(" is ") == 8 + 1  # eight records and the question's "What is"
        assert f"is {row['answer']}." in row["prompt"]
    completions = ["4821", "The locker code of Mia is 4821.", "It is 1234, or maybe 4821", "48210", "none"]
    assert fact_recall_reward(completions, ["4821"] * 5) == [1.0, 1.0, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="num_facts=17"):
        fact_recall_prompts(1, num_facts=17)
