"""Progress lines of a run's long steps (ram_trl/recipes/progress.py)."""

from __future__ import annotations

import pytest

from ram_trl.recipes.progress import Progress, duration


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0s"), (42, "42s"), (185, "3m05s"), (3720, "1h02m")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_a_line_per_item_with_the_time_left_until_the_last():
    lines = []
    progress = Progress("evaluation", 3, bar=False, write=lines.append)
    for done, name in enumerate(["base", "coding", "ram"], 1):
        progress.update(done, name)
    progress.close()
    assert [line.split(" (")[0] for line in lines] == [
        "evaluation 1/3: base",
        "evaluation 2/3: coding",
        "evaluation 3/3: ram",
    ]
    assert all("left)" in line for line in lines[:2]) and "left" not in lines[2]


def test_steps_get_a_line_at_each_tenth_only():
    lines = []
    progress = Progress("stage a: step", 95, bar=False, write=lines.append, every_item=False)
    for step in range(1, 96):
        progress.update(step)
    # the first step at or past each tenth of 95: 9.5, 19, 28.5, ...
    steps = [10, 19, 29, 38, 48, 57, 67, 76, 86, 95]
    assert [line.split(" (")[0] for line in lines] == [f"stage a: step {n}/95" for n in steps]


def test_counting_from_first_a_line_every_n_steps_with_the_time_left():
    lines = []
    progress = Progress(
        "warm start (answers): step", 700, bar=False, write=lines.append, every_item=False, first=600, every=60
    )
    progress.start -= 30  # step 660 ends 30 s after step 600
    for step in range(601, 701):
        progress.update(step)
    assert [line.rsplit(" (", 1)[0] for line in lines] == [
        "warm start (answers): step 660/700",
        "warm start (answers): step 700/700",
    ]
    # 40 steps left at 60 steps per 30 s (counted from 600, not from 0: that would say 40 * 30 / 660, 2s)
    assert lines[0].endswith("(30s; about 20s left)")
