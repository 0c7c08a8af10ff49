"""The output-commit protocol (ram_trl.output): temporary sibling, signals, leftovers of killed runs, atomic
no-replace commit, --overwrite rules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from ram_trl import fs, output
from ram_trl.errors import OutputError
from ram_trl.fs import rename_noreplace
from ram_trl.output import OutputDir, atomic_file
from ram_trl.signals import Interrupted
from ram_trl.temp_siblings import LOCK_FILE, remove_stale
from tests.helpers import dead_pid


def _siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def test_commit_moves_the_temporary_directory_into_place(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    out = OutputDir(target, markers=("report.json",))
    temp = out.begin()
    assert temp.parent == target.parent and (temp / LOCK_FILE).is_file()
    assert json.loads((temp / LOCK_FILE).read_text())["pid"] == os.getpid()
    (temp / "report.json").write_text("{}")
    out.commit()
    assert sorted(p.name for p in target.iterdir()) == ["report.json"]  # the lock file is gone
    assert _siblings(target) == []


def test_abort_removes_the_temporary_and_the_parents_it_created(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    out = OutputDir(target)
    out.begin()
    out.abort()
    assert sorted(tmp_path.iterdir()) == []


def test_abort_keeps_parents_that_existed(tmp_path):
    (tmp_path / "a").mkdir()
    out = OutputDir(tmp_path / "a" / "out")
    out.begin()
    out.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] and not any((tmp_path / "a").iterdir())


def test_commit_refuses_a_target_that_appeared_meanwhile(tmp_path):
    target = tmp_path / "out"
    out = OutputDir(target)
    temp = out.begin()
    (temp / "mine.txt").write_text("mine")
    target.mkdir()
    (target / "theirs.txt").write_text("theirs")
    with pytest.raises(OutputError, match="appeared while this run was writing"):
        out.commit()
    assert sorted(p.name for p in target.iterdir()) == ["theirs.txt"]
    assert _siblings(target) == []


def test_commit_refuses_even_an_empty_directory_that_appeared(tmp_path):
    target = tmp_path / "out"
    out = OutputDir(target)
    out.begin()
    target.mkdir()
    with pytest.raises(OutputError, match="appeared"):
        out.commit()


@pytest.mark.parametrize("portable", [False, True])
def test_rename_noreplace(tmp_path, monkeypatch, portable):
    if portable:
        monkeypatch.setattr(fs, "_RENAMEAT2", None)
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    (source / "f").write_text("x")
    target.mkdir()
    with pytest.raises(FileExistsError):
        rename_noreplace(source, target)
    assert (source / "f").is_file()
    target.rmdir()
    rename_noreplace(source, target)
    assert (target / "f").read_text() == "x" and not source.exists()


def test_overwrite_replaces_a_previous_output(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "report.json").write_text("old")
    (target / "old.bin").write_text("old")
    out = OutputDir(target, overwrite=True, markers=("report.json",))
    temp = out.begin()
    (temp / "report.json").write_text("new")
    out.commit()
    assert sorted(p.name for p in target.iterdir()) == ["report.json"]
    assert (target / "report.json").read_text() == "new"
    assert _siblings(target) == []


def test_overwrite_refuses_a_directory_that_is_not_an_output_and_names_its_content(tmp_path):
    target = tmp_path / "home"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputError, match=r"not a previous ram_trl output.*would delete: thesis\.tex"):
        OutputDir(target, overwrite=True, markers=("report.json",)).check()
    assert (target / "thesis.tex").read_text() == "years of work"


def test_overwrite_refuses_a_file(tmp_path):
    target = tmp_path / "out"
    target.write_text("a file")
    with pytest.raises(OutputError, match="is a file"):
        OutputDir(target, overwrite=True).check()


def test_an_output_holding_an_input_file_is_refused(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    (target / "report.json").write_text("{}")
    config = target / "merge.yaml"
    config.write_text("merge_method: ram")
    with pytest.raises(OutputError, match="merge config"):
        OutputDir(target, overwrite=True, reads=[("merge config", config)], markers=("report.json",)).check()
    assert config.is_file()


def test_an_output_inside_an_input_directory_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(OutputError, match="overlaps the agent"):
        OutputDir(model / "merged", reads=[("agent", model)]).check()


def test_leftovers_of_a_dead_process_are_removed_and_named(tmp_path):
    target = tmp_path / "out"
    pid = dead_pid()
    stale = tmp_path / f".out.ram-trl-tmp-{pid}-0123abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    (stale / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": os.uname().nodename}))
    old = tmp_path / f".out.ram-trl-old-{pid}-0123abcd"  # a previous output moved aside, then killed
    old.mkdir()
    with pytest.warns(UserWarning, match=f"process {pid}"):
        removed = remove_stale(target)
    assert sorted(p.name for p in removed) == sorted([stale.name, old.name])
    assert not stale.exists() and not old.exists()


def test_leftovers_of_a_live_process_or_another_host_are_kept(tmp_path):
    target = tmp_path / "out"
    live = tmp_path / f".out.ram-trl-tmp-{os.getppid()}-0123abcd"
    live.mkdir()
    other = tmp_path / f".out.ram-trl-tmp-{dead_pid()}-89abcdef"
    other.mkdir()
    (other / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "another-node"}))
    unrelated = tmp_path / ".outer.ram-trl-tmp-1-0123abcd"
    unrelated.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert remove_stale(target) == []
    assert live.exists() and other.exists() and unrelated.exists()


def test_a_kill_9_run_is_cleaned_up_by_the_next_run(tmp_path):
    target = tmp_path / "out"
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from ram_trl.output import OutputDir
        temp = OutputDir(Path({str(target)!r})).begin()
        (temp / "big.bin").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], check=False)
    assert result.returncode == -signal.SIGKILL
    assert len(_siblings(target)) == 1
    out = OutputDir(target)
    with pytest.warns(UserWarning, match="was killed"):
        out.begin()
    out.abort()
    assert _siblings(target) == [] and not target.exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_catchable_signals_remove_the_temporary_directory(tmp_path, signum):
    target = tmp_path / "x" / "out"
    ignored = signal.signal(signum, signal.SIG_DFL)  # under nohup SIGHUP is ignored, and stays so (test_signals.py)
    try:
        out = OutputDir(target)
        with pytest.raises(Interrupted) as info:
            try:
                out.begin()
                os.kill(os.getpid(), signum)
                out.commit()
            except BaseException:
                out.abort()
                raise
        assert info.value.signum == signum
        assert not (tmp_path / "x").exists()
        assert signal.getsignal(signum) == signal.SIG_DFL  # the handler is restored
    finally:
        signal.signal(signum, ignored)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_cli_merge_leaves_nothing(tmp_path, monkeypatch, capsys, signum):
    from ram_trl.cli import main
    from ram_trl.io import safetensors_io
    from tests.helpers import config_for, make_checkpoints

    ckpts = make_checkpoints(tmp_path / "inputs")
    config = tmp_path / "merge.json"
    config.write_text(json.dumps(config_for(ckpts)))
    out = tmp_path / "deep" / "merged"

    def write_rows(self, *args, **kwargs):
        os.kill(os.getpid(), signum)  # delivered to the main thread, whichever thread writes

    monkeypatch.setattr(safetensors_io.ShardFile, "write_rows", write_rows)
    ignored = signal.signal(signum, signal.SIG_DFL)  # under nohup SIGHUP is ignored, and stays so (test_signals.py)
    try:
        assert main(["merge", str(config), str(out), "--no-progress"]) == 128 + signum
    finally:
        signal.signal(signum, ignored)
    assert "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()


def test_atomic_file_replaces_or_leaves_nothing(tmp_path):
    target = tmp_path / "fisher.safetensors"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(target) as temp:
        temp.write_text("half")
        raise RuntimeError("failed")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    with atomic_file(target) as temp:
        temp.write_text("new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_file_system_errors_become_output_errors(tmp_path, monkeypatch):
    import errno

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "mkdir", read_only)
    out = OutputDir(tmp_path / "out")
    with pytest.raises(OutputError, match="read-only"):
        out.begin()


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_merge_mode_moves_files_into_an_existing_directory_marker_last(tmp_path, monkeypatch):
    """``merge=True`` (an agent saved into a trainer's output_dir): the directory's other files are kept, files of
    the same name replaced, and the marker is hidden first and moved in last."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "trainer_log.txt").write_text("kept")
    (target / "model.bin").write_text("old")
    (target / "stage.json").write_text("old")
    order = []
    rename = os.rename
    monkeypatch.setattr(output.os, "rename", lambda a, b: (order.append((Path(a).name, Path(b).parent)), rename(a, b)))
    out = OutputDir(target, merge=True, markers=("stage.json",))
    out.check()  # an existing directory is not refused in merge mode
    temp = out.begin()
    (temp / "model.bin").write_text("new")
    (temp / "stage.json").write_text("new")
    out.commit()
    assert _tree(target) == {"model.bin": b"new", "stage.json": b"new", "trainer_log.txt": b"kept"}
    assert order[0][0] == "stage.json" and order[0][1] != target  # the old marker is moved aside first
    assert order[-1] == ("stage.json", target)  # the new one moved in last
    assert _siblings(target) == []


@pytest.mark.parametrize("fail_at", [1, 2, 4, 6])
def test_merge_mode_failure_midway_restores_the_directory(tmp_path, monkeypatch, fail_at):
    """A failure at any rename of a merge commit (moving the old files aside or the new ones in) restores every
    previous file and leaves no temporary directory."""
    target = tmp_path / "out"
    target.mkdir()
    for name in ("a.bin", "b.bin", "stage.json", "other.txt"):
        (target / name).write_text(f"old {name}")
    before = _tree(target)
    out = OutputDir(target, merge=True, markers=("stage.json",))
    temp = out.begin()
    for name in ("a.bin", "b.bin", "stage.json"):
        (temp / name).write_text(f"new {name}")
    calls = []
    rename = os.rename

    def failing(a, b):
        calls.append(a)
        if len(calls) == fail_at:  # 3 renames aside (the marker first), then 3 in (the marker last)
            raise OSError(28, "No space left on device", str(b))
        return rename(a, b)

    monkeypatch.setattr(output.os, "rename", failing)
    with pytest.raises(OutputError, match="No space left"):
        out.commit()
    monkeypatch.undo()
    assert _tree(target) == before
    assert _siblings(target) == []


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_outputs_are_as_readable_as_the_umask_allows(tmp_path, umask, mask, mode):
    # safetensors' save_file writes through a private 0600 temporary whatever the umask: the commit fixes the mode
    from safetensors.torch import save_file

    umask(mask)
    with OutputDir(tmp_path / "out") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "sub").mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp / "sub" / "x.safetensors"))
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o700)
    with atomic_file(tmp_path / "fisher.safetensors") as temp:
        save_file({"w": torch.zeros(2)}, str(temp))
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in tmp_path.rglob("*") if p.is_file()}
    assert modes == {
        "out/model.safetensors": mode,
        "out/sub/x.safetensors": mode,
        "out/run.sh": mode | (mode & 0o444) >> 2,
        "fisher.safetensors": mode,
    }


@pytest.mark.parametrize("size", [256, 300])
def test_an_output_name_longer_than_a_file_name_may_be_is_one_line(tmp_path, size):
    long = tmp_path / ("a" * size)
    for check in (lambda: OutputDir(long).check(), lambda: output.check_output_file(long / "x.json")):
        with pytest.raises(OutputError, match=rf"is {size} bytes, over the 255 bytes a file name may have"):
            check()
    OutputDir(tmp_path / ("a" * 255)).check()  # the longest name is accepted
