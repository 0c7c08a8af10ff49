"""``ram_trl.recipes.agent_tasks``: the chat-template tasks of the SmolLM2 recipes, their answers and rewards."""

from __future__ import annotations

import hashlib
import json

import pytest

from ram_trl.recipes.agent_tasks import (
    AGENT_TOOLS,
    DEFAULT_SYSTEM,
    EXAMPLE_CALL,
    EXAMPLE_PROGRAM,
    chat_prompt,
    code_writing_prompts,
    code_writing_reward,
    fact_recall_prompts,
    fact_recall_reward,
    json_tool_call_prompts,
    json_tool_call_reward,
    program_output_prompts,
    program_output_reward,
    run_program,
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


def test_program_answers_are_what_the_programs_print():
    rows = program_output_prompts(60, seed=3)
    assert len({r["prompt"] for r in rows}) == 60
    for row in rows:
        source = row["prompt"].split("```python\n", 1)[1].split("\n```", 1)[0]
        assert row["answer"] == run_program(source) != ""
        assert row["prompt"].startswith("<|im_start|>system\n") and row["prompt"].endswith("<|im_start|>assistant\n")
    assert run_program("x = 7\ny = 3\nprint(x * y + 2)") == "23"
    assert run_program('word = "robot"\nprint(word[::-1])') == "tobor"
    with pytest.raises(NameError):
        run_program("print(open('/etc/passwd'))")
    assert program_output_prompts(5, seed=1) == program_output_prompts(5, seed=1) != program_output_prompts(5, 2)


def _sources(rows):
    return [row["prompt"].split("```python\n", 1)[1].split("\n```", 1)[0] for row in rows]


def test_easy_share_mixes_one_line_programs_and_leaves_the_default_draw_alone():
    rows = program_output_prompts(200, seed=0, easy_share=0.5)
    one_line = [s for s in _sources(rows) if "\n" not in s]
    assert 70 <= len(one_line) <= 130  # a binomial(200, 0.5) draw
    for row, source in zip(rows, _sources(rows), strict=True):
        assert row["answer"] == run_program(source) != ""
    assert all("\n" not in s for s in _sources(program_output_prompts(20, seed=0, easy_share=1.0)))
    # easy_share 0 draws exactly the programs of the first revision (no extra random numbers consumed): the digest
    # and the answers were taken from the generator before easy_share existed
    default = program_output_prompts(30, seed=4)
    assert hashlib.sha256(json.dumps(default).encode()).hexdigest()[:16] == "48d3d445a7aa989f"
    assert [r["answer"] for r in default[:6]] == ["38", "12", "25", "45", "TIGER", "3"]
    assert all("\n" in s for s in _sources(default))
    with pytest.raises(ValueError, match="easy_share"):
        program_output_prompts(3, easy_share=1.5)


def test_show_example_appends_the_reply_format_and_draws_the_same_programs():
    plain = program_output_prompts(40, seed=3, easy_share=0.5)
    shown = program_output_prompts(40, seed=3, easy_share=0.5, show_example=True)
    assert [r["answer"] for r in shown] == [r["answer"] for r in plain]
    assert _sources(shown) == _sources(plain)
    for row in shown:
        assert row["prompt"].count('For example, for print("ab" * 2) the reply is: abab') == 1
    assert all("For example" not in row["prompt"] for row in plain)
    # the example's program is none of the generator's and its answer is what it prints
    assert run_program(EXAMPLE_PROGRAM[0]) == EXAMPLE_PROGRAM[1]
    assert EXAMPLE_PROGRAM[0] not in _sources(program_output_prompts(500, seed=0, easy_share=1.0))


def test_running_a_program_leaves_the_process_stdout_alone(monkeypatch):
    # the reward runs inside the user's trainer: its output is captured without redirecting sys.stdout
    class Refuses:
        def write(self, text):
            raise AssertionError("run_program wrote to sys.stdout")

        def flush(self):
            pass

    def no_redirect(*args, **kwargs):
        raise AssertionError("run_program redirected the process's stdout")

    monkeypatch.setattr("sys.stdout", Refuses())
    monkeypatch.setattr("contextlib.redirect_stdout", no_redirect)
    assert run_program("nums = [3, 9, 4]\nprint(max(nums))\nprint(len(nums), end='!')") == "9\n3!"


def test_program_reward():
    completions = ["23", "```\n23\n```", "The output is 23.", "123", "`23` is printed", "", "24", "I think\n23"]
    assert program_output_reward(completions, ["23"] * 8) == [1.0, 1.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0]
    assert program_output_reward([[{"role": "assistant", "content": "tobor"}]], ["tobor"]) == [1.0]


def test_program_reward_reads_the_answer_after_an_echoed_program():
    # revision 4: the coding agent of revision 3 echoed the program in a fence, then "Output: 9"; the first line was
    # the program's, so 1.0 was never earned, and an echoed list program earned 0.5 for its own numbers
    echo = "```python\nnums = [23, 4]\nprint(max(nums))\n```\n\nOutput: {}"
    completions = [
        echo.format("23"),  # the program, then the labelled answer
        echo.format("4"),  # a wrong answer: the program's own 23 earns nothing
        "```python\nnums = [23, 4]\nprint(max(nums))",  # cut off inside the echo
        "output:23\nbecause 23 > 4",  # the label in any case, without a space
        "Output: 236",  # not the whole token
        "print(max([23, 4]))\n23",  # an unfenced echo is the first line (revision 6: its answer below earns 0)
        "```\n23\n```\n```python\nprint(23)\n```",  # a fenced answer is kept, the code block dropped
    ]
    assert program_output_reward(completions, ["23"] * 7) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_program_reward_reads_the_last_output_line_after_reasoning():
    # revision 5's prompts ask for reasoning first and an "Output:" line last (answer_line=True)
    completions = [
        "x is 20 and y is 3, so 20 + 3 = 23.\nOutput: 23",  # reasoning, then the labelled answer
        "Output: 24\nNo wait.\nOutput: 23",  # the last labelled line is the answer
        "Output: 23\n\nOutput:",  # an empty label is not an answer
        "20 + 3 = 23\nOutput: 24",  # a wrong labelled answer (revision 6: the reasoning's 23 earns nothing)
        "It prints 23",  # no label: the first line, as before
    ]
    assert program_output_reward(completions, ["23"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.5]


def test_program_reward_reads_the_answer_line_only():
    # revision 6: the revision-5 coding agent wrote "Output:" and then a fenced block listing many values, which
    # earned 0.5 whenever the output was among them (the partial credit read the whole reply); the answer is now the
    # line after the last label, and partial credit needs the output as that line's first or last token
    completions = [
        "Output:\n```\n23\n```",  # the answer on the line below the label, fenced
        "Output:\n```\n0 1 3 23 5 7\n```",  # a list of guesses earns nothing
        "This Python program will output:\n```\n20 21 22 23 24\n```",  # a label mid-line is no label
        "Output: 3 * 7 + 2 = 23.",  # the answer line ends with the output
        "Output:\n\nThe answer is 23",  # the line below the label
        "Output: 23\nOutput:\n```\n24\n```",  # the last label with a value
        "Output: 2\n23",  # the line below a non-empty label is not read
    ]
    assert program_output_reward(completions, ["23"] * 7) == [1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]


def test_answer_line_changes_the_instruction_not_the_programs():
    plain = program_output_prompts(20, seed=3, easy_share=0.5, show_example=True)
    marked = program_output_prompts(20, seed=3, easy_share=0.5, show_example=True, answer_line=True)
    assert [r["answer"] for r in plain] == [r["answer"] for r in marked]
    for a, b in zip(plain, marked, strict=True):
        assert a["prompt"].split("```")[1] == b["prompt"].split("```")[1]  # the same program
        assert "Reply with the output only." in a["prompt"] and "end your reply with the line Output:" in b["prompt"]
        assert "the last line is: Output: abab" in b["prompt"]


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
    import re

    rows = code_writing_prompts(80, seed=3)
    assert len({r["prompt"] for r in rows}) == 80 and rows == code_writing_prompts(80, seed=3)
    seen = set()
    for row in rows:
        request = row["prompt"].split("prints ", 1)[1].split(". Reply", 1)[0]
        pattern = next(p for p in _REFERENCE if re.fullmatch(p, request))
        seen.add(pattern)
        program = _REFERENCE[pattern].format(*re.fullmatch(pattern, request).groups())
        assert run_program(program) == row["answer"], (request, row["answer"])
        assert row["prompt"].endswith("in a ```python block.<|im_end|>\n<|im_start|>assistant\n")
    assert seen == set(_REFERENCE)  # every task is drawn


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
