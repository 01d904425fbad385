"""Bad arguments are usage errors: exit code 2, the reason on one line, no traceback, and nothing started
(no flow run, no Ray, no server)."""

import socket

import pytest
from typer.testing import CliRunner

import sao.runs_cli
from sao.cli import app
from sao.prefect_server import LOOPBACK

runner = CliRunner()
WIDE = {"COLUMNS": "200"}  # click's error box wraps at the terminal width; the reason is one line


@pytest.fixture(autouse=True)
def no_flow_runs(monkeypatch):
    """A usage error must stop `sao train` before the flow starts."""

    def refuse(settings, sources=None):
        raise AssertionError(f"the flow started despite a usage error: {settings}")

    monkeypatch.setattr(sao.runs_cli, "run_flow", refuse)


def usage_error(args: list[str], reason: str) -> str:
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if reason in line]
    assert len(lines) == 1, f"expected the reason {reason!r} on one line:\n{result.output}"
    return lines[0]


@pytest.mark.parametrize(("args", "reason"), [
    (["train", "--run-id", "bad id!"], "run_id: 'bad id!' is not a valid run id"),
    (["train", "--run-id", "x" * 129], "is not a valid run id"),
    (["train", "--steps", "-1"], "train.steps: Input should be greater than or equal to 0 (got -1) [from --steps]"),
    (["train", "--replica-resource", "rollout"], "--replica-resource 'rollout': expected NAME=AMOUNT"),
    (["train", "--trainer-resource", "trainer=-1"], "--trainer-resource 'trainer=-1': expected NAME=AMOUNT"),
    (["train", "--trainer-resource", "trainer=lots"], "--trainer-resource 'trainer=lots': expected NAME=AMOUNT"),
    (["train", "--batch-size", "0"], "train.batch_size: Input should be greater than or equal to 1 (got 0)"),
    (["train", "--batch-size", "12", "--group-size", "8"], "train.batch_size 12 is not a multiple of rollout.group_size 8"),
    (["train", "--synchronous", "--max-staleness", "2"], "train.synchronous needs train.max_staleness 0, got 2"),
])
def test_bad_train_arguments_exit_2_with_the_reason(args, reason):
    usage_error(args, reason)


def test_an_unknown_algorithm_names_the_known_ones():
    line = usage_error(["train", "--algorithm", "ppo-sync"], "Invalid value for '--algorithm'")
    assert "'ppo-sync'" in line and all(name in line for name in ("'sao'", "'grpo'", "'running_mean'"))


def test_sql_on_a_missing_lake_says_where_it_looked(tmp_path):
    line = usage_error(["sql", "--lake", str(tmp_path / "nowhere"), "SELECT 1"], "cannot open the lake at")
    assert str(tmp_path / "nowhere") in line
    assert not (tmp_path / "nowhere").exists()  # opening never creates an empty lake


def test_sql_refuses_a_statement_that_writes(tmp_path):
    usage_error(["sql", "--lake", str(tmp_path), "DROP TABLE trajectories"], "DROP")


def test_replay_of_an_unknown_run_is_a_usage_error(tmp_path):
    from sao.lake.store import Lake

    Lake.open(str(tmp_path / "lake"))  # an empty lake: tables, no runs
    line = usage_error(["replay", "--lake", str(tmp_path / "lake"), "--run", "nobody", "--step", "0"],
                       "unknown run 'nobody'")
    assert "policy_versions" in line


def test_replay_needs_exactly_one_mode():
    usage_error(["replay", "--run", "r"], "give exactly one of --step N, --steps N:M or --trajectory ID")


@pytest.mark.parametrize(("args", "reason"), [
    (["--run", "r", "--step", "0", "--as", "x"], "--as names the run a what-if replay is recorded under: it goes with --set"),
    (["--run", "r", "--step", "0", "--tasks", "t.jsonl"], "--tasks does nothing in a replay of steps"),
    (["--run", "r", "--step", "0", "--atol", "0.1"], "--atol does nothing in a replay of steps"),
    (["--run", "r", "--step", "0", "--set", "algorithm.eps_high=4", "--ray"],
     "--ray does nothing in a what-if replay (--set)"),
    (["--run", "r", "--step", "0", "--set", "algorithm.eps_high=4", "--metric-tolerance", "0.1"],
     "--metric-tolerance does nothing in a what-if replay (--set)"),
    (["--trajectory", "t", "--ray", "--metric-tolerance", "0.1"], "--metric-tolerance, --ray do nothing in --trajectory"),
])
def test_replay_refuses_an_option_the_chosen_replay_would_ignore(tmp_path, args, reason):
    usage_error(["replay", "--lake", str(tmp_path / "nowhere"), *args], reason)
    assert not (tmp_path / "nowhere").exists()  # refused before the lake is opened


def test_the_replay_flow_refuses_what_it_would_ignore():
    from flows.replay import replay

    with pytest.raises(ValueError, match="as_run_id names the run a what-if replay is recorded under"):
        replay.fn(run_id="r", as_run_id="x")
    with pytest.raises(ValueError, match="metric_tolerance is for a replay without overrides"):
        replay.fn(run_id="r", overrides={"algorithm.eps_high": 4.0}, metric_tolerance=0.1)


def test_ui_on_a_busy_port_is_a_usage_error_and_starts_no_server():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = usage_error(["ui", "--port", str(port)], f"port {port} on 127.0.0.1 is already in use")
    assert "--port N" in line


def test_ui_rejects_a_port_out_of_range():
    usage_error(["ui", "--port", "70000"], "Invalid value for '--port'")


def test_the_vllm_engine_without_its_environment_names_the_command_that_creates_it(tmp_path, monkeypatch):
    import sao.rollout.vllm_engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    monkeypatch.setattr(vllm_engine, "default_vllm_python", lambda: tmp_path / "checkout" / ".venv-vllm" / "bin" / "python")
    line = usage_error(["train", "--set", "rollout.engine=vllm", "--workdir", str(tmp_path)],
                       "rollout.engine is vllm, but this Python")
    assert "`make vllm-env`" in line and str(tmp_path / "checkout" / ".venv-vllm") in line and "rollout.python" in line


def test_training_without_the_flows_extra_says_which_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prefect" else find_spec(name, *a))
    usage_error(["train"], "`sao train` runs through the Prefect flows, which need the extra `flows`: pip install 'sao[flows]'")


def _tasks(tmp_path) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(f'{{"prompt": "What is {n} + 1?", "answer": "{n + 1}"}}\n' for n in range(20)))
    return str(path)


def test_an_agent_that_cannot_be_imported_is_a_usage_error(tmp_path):
    # Before, an AgentImportError (like a VerifiersError) went out as a traceback with exit 1.
    where = ["--workdir", str(tmp_path / "runs"), "--set", f"lake.root={tmp_path / 'lake'}",
             "--set", f"data.train={_tasks(tmp_path)}"]
    usage_error(["train", *where, "--set", "env.agent=no_such_module_here:agent"], "no_such_module_here")
    usage_error(["train", *where, "--set", "env.agent=sao.rewards:exact_match"],
                "must be an async function agent(client, task)")


def test_a_refused_start_writes_nothing(tmp_path):
    from sao import runs
    from sao.config import RunConfig

    where = ["--workdir", str(tmp_path / "runs"), "--set", f"lake.root={tmp_path / 'lake'}"]
    usage_error(["train", *where, "--set", f"data.train={tmp_path / 'missing.jsonl'}"], "missing.jsonl")
    assert not (tmp_path / "lake").exists()  # a new run refused for its input: no empty lake either
    runs.record_start(RunConfig(run_id="demo", workdir=str(tmp_path / "runs"), lake={"root": str(tmp_path / "lake")}))
    # The run started on the built-in tasks; resumed with tasks of one's own, it is refused before the
    # task file is written (before, the run's folder got tasks.jsonl from the refused start).
    usage_error(["train", *where, "--set", f"data.train={_tasks(tmp_path)}"], "data.train: recorded None")
    assert not (tmp_path / "runs" / "demo" / "tasks.jsonl").exists()


def test_a_resume_whose_task_file_changed_is_refused_without_suggesting_to_delete_the_runs_copy(tmp_path):
    from sao import runs
    from sao.config import RunConfig

    tasks = _tasks(tmp_path)
    runs.prepare_inputs(RunConfig(run_id="r", workdir=str(tmp_path / "runs"), data={"train": tasks}))  # its start
    with open(tasks, "a") as more:
        more.write('{"prompt": "What is 40 + 2?", "answer": "42"}\n')
    line = usage_error(["train", "--run-id", "r", "--workdir", str(tmp_path / "runs"), "--set",
                        f"lake.root={tmp_path / 'lake'}", "--set", f"data.train={tasks}"],
                       "holds the tasks run 'r' started with")
    # Deleting the run's copy (what the message said before) would let the run go on with other tasks.
    assert "start a new run id" in line and "delete" not in line
