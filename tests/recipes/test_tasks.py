"""Golden tests of the demo tasks: each reward on hand-written completions, and the prompt generators."""

from __future__ import annotations

import pytest

from ram_trl.recipes.tasks import (
    TOOLS,
    arithmetic_prompts,
    arithmetic_reward,
    completion_text,
    mixture,
    parse_call,
    program_prompts,
    program_reward,
    recall_prompts,
    recall_reward,
    tool_call_prompts,
    tool_call_reward,
)


def test_completion_text_cuts_at_newline_and_reads_messages():
    assert completion_text(" 82 \nmore") == "82"
    assert completion_text([{"role": "assistant", "content": "weather(city=Oslo)"}]) == "weather(city=Oslo)"


def test_arithmetic_reward_golden():
    completions = ["82", " 82\n7+1=8", "8", "80", "x", "823", "", "-82"]
    # exact -> 1; else 0.5 * (matched leading characters / len("82")): "8" and "80" match 1 of 2, "823" 2 of 2.
    assert arithmetic_reward(completions, answer=["82"] * len(completions)) == [
        1.0, 1.0, 0.25, 0.25, 0.0, 0.5, 0.0, 0.0,
    ]  # fmt: skip
    assert arithmetic_reward(["123", "129"], answer=["123", "123"]) == [1.0, 0.5 * 2 / 3]


def test_tool_call_reward_golden():
    completions = [
        "weather(city=Oslo,day=mon)",  # right tool, right arguments
        " weather( day = mon , city = Oslo ) ",  # spaces and argument order do not matter
        "weather(city=Lima,day=mon)",  # right tool, one of two arguments right: 0.5 + 0.5 * 1/2
        "weather(town=Oslo,day=tue)",  # right tool, no argument right
        "weather(city=Oslo)",  # right tool, one of two arguments given (and right)
        "weather(city=Oslo,day=mon,unit=C)",  # an extra argument: 2 right of 3 given
        "weather()",  # right tool, no arguments
        "flight(city=Oslo,day=mon)",  # well-formed, wrong tool (arguments do not count)
        "weather(city=Oslo,day=mon",  # not well-formed
        "weather(city=Oslo,city=Oslo)",  # duplicate argument: not well-formed
        "Oslo",
        "",
    ]
    assert tool_call_reward(completions, answer=["weather(city=Oslo,day=mon)"] * len(completions)) == [
        1.0, 1.0, 0.75, 0.5, 0.75, 0.5 + 0.5 * 2 / 3, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0,
    ]  # fmt: skip


def test_parse_call():
    assert parse_call("stock(ticker=IBM)") == ("stock", {"ticker": "IBM"})
    assert parse_call("f(a=1, b=2)") == ("f", {"a": "1", "b": "2"})
    assert parse_call("f()") == ("f", {})
    assert parse_call("f(a)") is None
    assert parse_call("1f(a=1)") is None


def test_recall_reward_golden():
    completions = ["7", "7\n", " 7 ", "77", "", "3", "7;"]
    assert recall_reward(completions, answer=["7"] * len(completions)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_rewards_need_one_answer_per_completion():
    with pytest.raises(ValueError):
        recall_reward(["1", "2"], answer=["1"])


def test_arithmetic_prompts_are_distinct_seeded_and_correct():
    rows = arithmetic_prompts(200, seed=3, ops="+-*")
    assert rows == arithmetic_prompts(200, seed=3, ops="+-*")
    assert rows != arithmetic_prompts(200, seed=4, ops="+-*")
    assert len({r["prompt"] for r in rows}) == 200
    for row in rows:
        expression = row["prompt"].removesuffix("=")
        assert int(row["answer"]) == eval(expression)  # noqa: S307 - digits and one operator
        assert int(row["answer"]) >= 0
    assert arithmetic_prompts(1, seed=0) == [{"prompt": "48-26=", "answer": "22"}]  # pinned: seeded draw
    with pytest.raises(ValueError, match="ops"):
        arithmetic_prompts(1, ops="/")


def test_tool_call_prompts_answers_are_the_right_calls():
    rows = tool_call_prompts(1588, seed=0)  # every question / argument combination
    assert len({r["prompt"] for r in rows}) == 1588
    for row in rows:
        tool, arguments = parse_call(row["answer"])
        names, domains, templates = TOOLS[tool]
        assert tuple(arguments) == names
        assert all(arguments[n] in d for n, d in zip(names, domains, strict=True))
        values = [arguments[n] for n in names]
        assert row["prompt"] in {t.format(*values) + " " for t in templates}
        assert tool != "flight" or values[0] != values[1]
    assert tool_call_prompts(2, seed=0) == tool_call_prompts(2, seed=0) != tool_call_prompts(2, seed=1)
    with pytest.raises(ValueError, match="distinct prompts"):
        tool_call_prompts(1589, seed=0)


def test_recall_prompts_answer_is_the_asked_keys_value():
    for row in recall_prompts(50, seed=1, num_pairs=4):
        *pairs, question = row["prompt"].split(";")
        assert len(pairs) == 4
        context = dict(p.split("=") for p in pairs)
        assert len(context) == 4
        assert row["answer"] == context[question.removesuffix("?")]


def test_recall_prompts_with_one_letter_keys():
    rows = recall_prompts(30, seed=2, num_pairs=3, key_length=1)
    for row in rows:
        *pairs, question = row["prompt"].split(";")
        keys = [p.split("=")[0] for p in pairs]
        assert len(keys) == 3 and len(set(keys)) == 3 and all(len(k) == 1 for k in keys)
        assert row["answer"] == dict(p.split("=") for p in pairs)[question.removesuffix("?")]
    with pytest.raises(ValueError, match="num_pairs=27"):
        recall_prompts(1, num_pairs=27, key_length=1)


def test_program_prompts_answers_are_the_programs_outputs():
    rows = program_prompts(200, seed=0, length=4)
    assert len({r["prompt"] for r in rows}) == 200
    assert rows == program_prompts(200, seed=0, length=4)
    seen = set()
    for row in rows:
        name, rest = row["prompt"].split("(", 1)
        word = rest.removesuffix('")=').removeprefix('"')
        assert len(word) == 4 and word.islower()
        expected = {
            "rev": word[::-1],
            "sort": "".join(sorted(word)),
            "upper": word.upper(),
            "next": "".join("a" if c == "z" else chr(ord(c) + 1) for c in word),
        }[name]
        assert row["answer"] == expected
        seen.add(name)
    assert seen == {"rev", "sort", "upper", "next"}
    assert program_prompts(1, seed=3, length=3)[0]["prompt"].endswith('")=')
    with pytest.raises(ValueError, match="length=0"):
        program_prompts(1, length=0)


def test_program_reward_golden():
    # exact 1.0; else half the share of characters right from the left (cut at the first wrong one)
    assert program_reward(["bzfqk", "bzfxk", "xzfqk", "bz", "bzfqk\nmore", "(I don't know)"], ["bzfqk"] * 6) == [
        1.0,
        0.5 * 3 / 5,
        0.0,
        0.5 * 2 / 5,
        1.0,
        0.0,
    ]


def test_mixture_is_a_seeded_shuffle_of_all_rows():
    a, b = [{"prompt": "a"}, {"prompt": "b"}], [{"prompt": "c"}]
    mixed = mixture([a, b], seed=0)
    assert sorted(r["prompt"] for r in mixed) == ["a", "b", "c"]
    assert mixed == mixture([a, b], seed=0)
