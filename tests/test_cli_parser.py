"""ram_trl/cli_parser.py: one subcommand per command, with the defaults the commands rely on (the commands themselves
are run in tests/test_cli.py)."""

from __future__ import annotations

import pytest

from ram_trl.cli_parser import build_parser


@pytest.mark.parametrize(
    "command", ["merge", "example", "methods", "analyze", "run", "eval", "demo", "fisher", "convert-gguf"]
)
def test_every_command_has_its_subcommand(command, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ram-trl {command}")


def test_merge_defaults():
    args = build_parser().parse_args(["merge", "merge.yaml", "out"])
    assert (args.command, args.config, args.device, args.dry_run) == ("merge", "merge.yaml", "cpu", False)


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    assert "required" in capsys.readouterr().err
