"""`sao bench fresh`: a clone of the committed HEAD, timed phase by phase in a new shell's environment.

The real run (`make install` and `make demo`, 7-12 minutes) is the benchmark itself; these tests run the
same code on a small repository whose Makefile stands in for the project's and records what it saw."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.demo import TARGET_WALL_S
from benchmarks.fresh_clone import _markdown, fresh_clone_run, main, newcomer_env, summary

MAKEFILE = """\
install:
\tmkdir -p .venv && echo "$${VIRTUAL_ENV:-none} $${PYTHONPATH:-none} $$PIP_CACHE_DIR" > .venv/env.txt

demo: install
\ttest -f .venv/env.txt
\tmkdir -p runs/demo && cp result.json runs/demo/result.json
"""

RESULT = {"accuracy_before": 0.467, "accuracy_after": 0.72, "eval_tasks": 150, "steps": 150, "trajectories": 4800,
          "train_wall_s": 231.0, "failures_after": {"tool_call": 30}}


def _git(*args, cwd):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A repository whose `make install` and `make demo` stand in for the project's, HEAD committed, and
    one change left uncommitted."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "Makefile").write_text(MAKEFILE)
    (root / "result.json").write_text(json.dumps(RESULT))
    _git("init", "--quiet", cwd=root)
    _git("add", ".", cwd=root)
    _git("commit", "--quiet", "-m", "start", cwd=root)
    (root / "uncommitted.txt").write_text("not in HEAD")
    return root


def test_a_new_shell_has_no_virtual_environment_and_the_given_pip_cache(tmp_path):
    venv_bin = str(Path(sys.prefix) / "bin")
    env = newcomer_env(tmp_path / "cache", {"VIRTUAL_ENV": "/x/.venv", "PYTHONPATH": "/x", "HOME": "/h",
                                             "PATH": f"/x/.venv/bin:{venv_bin}:/usr/local/bin:/usr/bin"})
    assert env == {"HOME": "/h", "PATH": "/usr/local/bin:/usr/bin", "PIP_CACHE_DIR": str(tmp_path / "cache")}
    assert newcomer_env(None, {"PATH": "/usr/bin", "PIP_CACHE_DIR": "/own"})["PIP_CACHE_DIR"] == "/own"  # kept


def test_a_run_clones_head_and_times_install_then_demo_in_a_new_shell(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    seconds = fresh_clone_run(repo, tmp_path / "run")
    clone = tmp_path / "run" / "clone"
    assert set(seconds) == {"clone", "install", "demo", "total"}
    assert seconds["total"] == pytest.approx(seconds["clone"] + seconds["install"] + seconds["demo"])
    assert all(value > 0 for value in seconds.values())
    assert not (clone / "uncommitted.txt").exists()  # the committed HEAD, not the work tree
    assert (clone / ".venv" / "env.txt").read_text().split() == ["none", "none", str(tmp_path / "run" / "pip-cache")]
    assert json.loads((clone / "runs" / "demo" / "result.json").read_text()) == RESULT


def test_a_run_refuses_a_folder_that_is_not_empty_and_a_failing_target_names_itself(repo, tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(RuntimeError, match="not empty"):
        fresh_clone_run(repo, tmp_path / "used")
    (repo / "Makefile").write_text("install:\n\techo broken-install && false\n")
    _git("commit", "--quiet", "-am", "broken", cwd=repo)
    with pytest.raises(RuntimeError, match=r"make install: make install exited 2(.|\n)*broken-install"):
        fresh_clone_run(repo, tmp_path / "run")


def _run(total, after, before=0.47):
    return {"seconds": {"clone": 1.0, "install": 200.0, "demo": total - 201.0, "total": total},
            "result": {"accuracy_before": before, "accuracy_after": after, "rise": after - before}}


def test_the_summary_is_the_median_of_the_runs_and_judges_the_targets_on_it():
    figures = summary([_run(620.0, 0.70), _run(500.0, 0.82), _run(560.0, 0.74)])
    assert figures["total"] == {"median": 560.0, "min": 500.0, "max": 620.0}
    assert figures["demo"] == {"median": 359.0, "min": 299.0, "max": 419.0}
    assert figures["accuracy_after"] == {"median": 0.74, "min": 0.70, "max": 0.82}
    assert figures["rise"]["median"] == pytest.approx(0.27)
    assert figures["met"] == {"time": True, "accuracy": False, "rise": True}
    assert summary([_run(TARGET_WALL_S, 0.81, before=0.57)])["met"] == {"time": False, "accuracy": True, "rise": False}


def test_main_writes_the_record_and_the_section(repo, tmp_path):
    out, md = tmp_path / "fresh.json", tmp_path / "RESULTS.md"
    assert main(["--runs", "2", "--repo", str(repo), "--workdir", str(tmp_path / "work"), "--out-json", str(out),
                 "--results-md", str(md)]) == 0
    record = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert record["commit"] == head  # the clone's commit: the uncommitted change is not in it
    assert [run["result"]["accuracy_after"] for run in record["runs"]] == [0.72, 0.72]
    assert record["runs"][0]["result"]["rise"] == pytest.approx(0.253)
    assert record["summary"]["met"] == {"time": True, "accuracy": False, "rise": True}
    assert not (tmp_path / "work" / "run-1").exists()  # removed once read
    text = md.read_text()
    assert "<!-- fresh-clone:begin -->" in text and "0.467 -> 0.720" in text
    assert _markdown(record).strip() in text
    assert "| `make demo` from a fresh clone under 10 minutes | " in text and "| rise at least +0.25 | +0.253 (+0.253 to +0.253) | yes |" in text
    md.write_text("# Results\n\n<!-- fresh-clone:begin -->\nold\n<!-- fresh-clone:end -->\n")
    assert main(["--reread", str(out), "--results-md", str(md)]) == 0  # runs nothing: the section again
    assert md.read_text() == text
    with pytest.raises(SystemExit):
        main(["--runs", "0"])

