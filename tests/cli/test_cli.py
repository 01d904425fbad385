"""The `sao` command's own behaviour: help, usage errors, the demo placeholder."""

from typer.testing import CliRunner

from sao.cli import app

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "bench" in result.output


def test_unknown_benchmark_is_a_usage_error_without_traceback():
    result = runner.invoke(app, ["bench", "no-such-bench"])
    assert result.exit_code == 2
    assert "unknown benchmark 'no-such-bench'" in result.output
    assert "Traceback" not in result.output


def test_unknown_command_exits_2():
    result = runner.invoke(app, ["frobnicate"])
    assert result.exit_code == 2
