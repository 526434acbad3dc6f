"""`lorad serve` and `lorad prepare` hand every argument, options included, to the daemon-side parser."""

import pytest

from lorad.client.cli import _glue_token_values, _split_passthrough, build_parser, main


def test_split_keeps_global_options_and_passes_the_rest() -> None:
    assert _split_passthrough(["--json", "serve", "--help"]) == (["--json", "serve"], ["--help"])
    assert _split_passthrough(["--data-dir", "/d", "prepare", "--soc", "SM8650"]) == (
        ["--data-dir", "/d", "prepare"],
        ["--soc", "SM8650"],
    )
    # An option value spelled like a command is not the command.
    assert _split_passthrough(["--token", "serve", "status"]) == (["--token", "serve", "status"], [])


def test_prepare_list_socs_runs_the_daemon_side_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare", "--list-socs"]) == 0
    assert "SM8650" in capsys.readouterr().out


def test_a_token_that_begins_with_a_dash_is_the_tokens_value() -> None:
    """Tokens issued before the daemon stopped issuing them can begin with "-"; argparse alone read one as an option
    ("argument --token: expected one argument")."""
    tok = "-" + "x" * 42
    glued = _glue_token_values(["--token", tok, "data", "list"])
    assert glued == [f"--token={tok}", "data", "list"]
    assert build_parser().parse_args(glued).token == tok
    assert _glue_token_values(["--token", "--json", "status"]) == ["--token", "--json", "status"]  # not a token
    assert _glue_token_values(["--token", "abc", "status"]) == ["--token", "abc", "status"]
