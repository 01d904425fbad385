"""Every command in README.md's fenced ``sh`` / ``bash`` blocks is exercised, so a README command that
stops working fails here.

- ``sao sql``, ``sao replay``, ``sao lake``: run as written, in a folder holding a tiny finished run
  ``demo`` at ``./lake`` (what ``make demo`` leaves behind, in small).
- ``sao train``: run as written with the flow replaced by a recorder: the options must parse and reach
  the run config (``--lake s3://...``, ``--ray-address``, ``--set``), without a cluster.
- ``sao config``: run as written (``--config configs/...`` from the repository).
- ``export NAME=VALUE``: applied to the environment of the block's later commands.
- ``cat > FILE <<'END'`` ... ``END``: the file is written (in the run folder) for the commands after it.
- ``make TARGET``: ``make -n TARGET`` must run the ``sao`` command below it, and that command has a
  named test (:data:`COVERED_BY`), which must exist.
- ``sao ui``: its arguments must parse; the command itself is tested by :data:`COVERED_BY`.
- ``prefect ...``: must be one of the commands ``tests/flows/test_deployments.py`` runs.

Anything else fails: a new kind of README command needs a way to be tested here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

import sao.runs_cli
from sao.cli import app
from sao.lake.store import Lake
from sao.rewards import resolve_reward
from sao.rollout.user_agent import load_agent
from sao.train.loop import prepare_run, run_training
from tests.flows.test_deployments import PREFECT_COMMANDS
from tests.train.test_loop import make_config, roll_out

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
runner = CliRunner()

MAKE_RUNS = {"demo": "sao demo", "ui": "sao ui", "test": "pytest"}
"""What ``make -n TARGET`` must show for each target the README names."""

COVERED_BY = {
    "sao ui": "tests/flows/test_deployments.py::test_a_run_from_the_ui_crashed_then_retried_resumes_to_completion_with_artifacts",
    "sao demo": "tests/benchmarks/test_demo.py::test_quick_run_reports_the_demo_runs_recorded_result",
    "pytest": ".ci/run",  # `make test` is what CI runs
}
"""The test that exercises a command too long or too global to run from here."""


def readme_blocks() -> list[list[list[str]]]:
    """The fenced sh/bash blocks of README.md, each a list of commands (argv lists); a here-document
    that writes a file (``cat > FILE <<'END'`` ... ``END``) is one command ``["write", FILE, TEXT]``."""
    blocks = re.findall(r"^```(?:sh|bash|shell)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    parsed = []
    for block in blocks:
        commands, lines = [], iter(block.splitlines())
        for line in lines:
            heredoc = re.fullmatch(r"cat > (\S+) <<'(\w+)'", line.strip())
            if heredoc:
                body = []
                for inner in lines:
                    if inner == heredoc.group(2):
                        break
                    body.append(inner)
                commands.append(["write", heredoc.group(1), "\n".join(body) + "\n"])
            elif argv := shlex.split(line, comments=True):
                commands.append(argv)
        parsed.append(commands)
    return parsed


def _covered(command: str) -> None:
    target = COVERED_BY[command]
    path, _, name = target.partition("::")
    assert (REPO / path).exists(), f"{command}: {path} is gone"
    text = (REPO / path).read_text()
    assert (f"def {name}(" in text) if name else ("make test" in text), f"{command}: {target} is gone"


def _make(argv: list[str]) -> None:
    (target,) = argv[1:]
    assert target in MAKE_RUNS, f"README runs `make {target}`: say in MAKE_RUNS what it must run"
    dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert MAKE_RUNS[target] in dry.stdout, f"make {target} no longer runs {MAKE_RUNS[target]}:\n{dry.stdout}"
    _covered(MAKE_RUNS[target])


def _sao(argv: list[str], recorded: list) -> None:
    command = argv[1]
    if command in ("sql", "replay", "lake"):
        result = runner.invoke(app, argv[1:], env={"COLUMNS": "200"})
        assert result.exit_code == 0, f"{shlex.join(argv)} exited {result.exit_code}:\n{result.output}"
        assert result.output.strip()
        if command == "replay" and "--set" in argv:
            assert "what-if replay of run" in result.output and "re-run" in result.output, result.output
        elif command == "replay":
            assert '"ok": true' in result.output or ": match" in result.output, result.output
    elif command == "train":
        result = runner.invoke(app, _in_repo(argv[1:]))
        assert result.exit_code == 0, result.output
        config = recorded[-1]
        options = dict(zip(argv[2::2], argv[3::2], strict=False))
        assert config.run_id == options.get("--run-id", config.run_id)
        assert config.lake.root == options.get("--lake", config.lake.root)
        assert config.ray.address == options.get("--ray-address")
        assert config.workdir == options.get("--workdir", config.workdir)
        for flag, section in (("--replica-resource", config.rollout), ("--trainer-resource", config.train)):
            if flag in options:  # one of each in the README
                name, _, amount = options[flag].partition("=")
                assert section.resources == {name: float(amount)}
        for spec in config.reward.functions:  # the block's own reward module is found from where it ran
            resolve_reward(spec)
        if config.env.agent:  # and its agent: importable, async (then forgotten: other tests import their own)
            load_agent(config.env.agent)
            sys.modules.pop(config.env.agent.partition(":")[0], None)
        for item in (value for option, value in zip(argv, argv[1:], strict=False) if option == "--set"):
            key, _, value = item.partition("=")
            section, _, name = key.rpartition(".")
            assert str(getattr(getattr(config, section) if section else config, name)) == value
    elif command == "config":
        result = runner.invoke(app, _in_repo(argv[1:]))
        assert result.exit_code == 0, f"{shlex.join(argv)} exited {result.exit_code}:\n{result.output}"
        assert result.output.strip()
    elif command == "ui":
        get_command(app).commands["ui"].make_context("ui", list(argv[2:]))  # the options parse
        _covered("sao ui")
    else:
        pytest.fail(f"README runs `{shlex.join(argv)}`: add a way to test `sao {command}` to tests/test_readme.py")


def _in_repo(args: list[str]) -> list[str]:
    """``--config FILE`` names a file of the block (written by it) or of the repository (``configs/...``)."""
    return [str(REPO / arg) if previous == "--config" and not Path(arg).exists() else arg
            for previous, arg in zip(["", *args], args, strict=False)]


def run_block(block: list[list[str]], monkeypatch, recorded: list) -> None:
    for argv in block:
        if argv[0] == "export":
            for assignment in argv[1:]:
                name, _, value = assignment.partition("=")
                monkeypatch.setenv(name, value)
        elif argv[0] == "write":  # a here-document: the file the next commands use
            Path(argv[1]).write_text(argv[2])
        elif argv[0] == "make":
            _make(argv)
        elif argv[0] == "sao":
            _sao(argv, recorded)
        elif argv[0] == "prefect":
            assert tuple(argv[1:]) in PREFECT_COMMANDS.values(), (
                f"README runs `{shlex.join(argv)}`, which tests/flows/test_deployments.py does not")
        else:
            pytest.fail(f"README command `{shlex.join(argv)}` is not exercised by any test")


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory, policy_dir, tokenizer):
    """A folder with ``./lake`` holding run ``demo``: two committed steps on eight real trajectories."""
    root = tmp_path_factory.mktemp("readme")
    cfg = make_config(root, policy_dir, run_id="demo", total_steps=2)
    prepare_run(cfg)
    roll_out(policy_dir, tokenizer, Lake.open(cfg.lake), cfg.run_id, 8)
    run_training(cfg)
    return root


@pytest.fixture
def recorded(monkeypatch):
    """``sao train`` records its config instead of running the flow (and does not look for the run in a
    lake it names: an s3:// one in the README)."""
    calls = []

    def record(config, sources=None):
        calls.append(config)
        return {"summary": "(recorded)", "accuracy_before": 0.0, "accuracy_after": 0.0,
                "version": config.train.steps}

    monkeypatch.setattr(sao.runs_cli, "run_flow", record)
    monkeypatch.setattr("sao.runs.check_resume", lambda config, lake=None: None)
    monkeypatch.setattr("sao.runs.prepare_inputs", lambda config: ())
    return calls


BLOCKS = readme_blocks()


def test_the_readme_has_the_sections_and_commands_the_issue_asks_for():
    commands = [shlex.join(argv) for block in BLOCKS for argv in block]
    assert commands[:2] == ["make demo", "make test"]  # the two commands first
    assert "make ui" in commands
    assert sum(c.startswith("sao sql ") for c in commands) >= 3
    assert any(c.startswith("sao replay ") for c in commands)
    assert any("--ray-address" in c and "s3://" in c for c in commands)
    assert any(c.startswith("export PREFECT_API_URL=") for c in commands)


@pytest.mark.parametrize("block", BLOCKS, ids=[shlex.join(b[0])[:40] for b in BLOCKS])
def test_readme_block(block, demo_folder, monkeypatch, recorded):
    monkeypatch.chdir(demo_folder)
    run_block(block, monkeypatch, recorded)
