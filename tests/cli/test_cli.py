"""The `sao` command's own behaviour: help, usage errors, the demo placeholder, a fast start."""

import subprocess
import sys

from typer.testing import CliRunner

from sao.cli import app

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "bench" in result.output


def test_a_flags_help_shows_the_config_key_it_sets():
    """`sao train --help` says each flag names the config key it sets, as `[train.steps]` at the end of
    the flag's help; Rich markup took such brackets for style tags and dropped them."""
    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for key in ("[train.steps]", "[train.max_staleness]", "[algorithm.lr_policy]", "[lake.root]", "[run_id]"):
        assert key in result.output, key
    replay = runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "200"})
    assert "the run id, -whatif- and a hash of the request" in " ".join(replay.output.split())


def test_unknown_benchmark_is_a_usage_error_without_traceback():
    result = runner.invoke(app, ["bench", "no-such-bench"])
    assert result.exit_code == 2
    assert "unknown benchmark 'no-such-bench'" in result.output
    assert "Traceback" not in result.output


def test_unknown_command_exits_2():
    result = runner.invoke(app, ["frobnicate"])
    assert result.exit_code == 2


def test_the_sao_command_starts_without_the_training_stack():
    """`sao --help`, `sao sql` and `sao lake ...` must not wait for torch, transformers, Ray and Prefect to
    import (about 8 s on 2 cores): a command imports those when it runs."""
    heavy = ("torch", "transformers", "ray", "prefect")
    code = f"import sys, sao.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing sao.cli imports {done.stdout.strip()}"
