"""The shared report helpers: each section's machine line names the commit its figures were measured at."""

import subprocess

from benchmarks._report import git_commit, machine_line, parts_lines

INFO = {"cpus": 2, "memory_gib": 23.5, "platform": "Linux", "python": "3.11.7", "torch": "2.13.0+cpu",
        "ray": "2.60.0", "date": "2026-12-04T09:36:20+00:00", "load_average_1m": 1.67, "commit": "35df562"}


def test_the_machine_line_names_the_commit_once_and_leaves_it_out_when_unknown():
    line = machine_line(INFO)
    assert line.endswith("1-minute load average at the start 1.67. Commit `35df562`.")
    assert "Commit" not in machine_line({**INFO, "commit": None})
    parts = parts_lines(["sao bench quality --seeds 0"], [{"seed": 0, "machine": INFO, "wall_s": 90.0}])
    assert parts[-1].count("35df562") == 1 and parts[-1].endswith("1.5 min")


def test_the_machine_record_lists_every_installed_package_with_its_version():
    import importlib.metadata

    import torch

    from benchmarks._report import machine

    packages = machine()["packages"]
    assert list(packages) == sorted(packages) and len(packages) > 50
    assert packages["torch"] == importlib.metadata.version("torch") and torch.__version__.startswith(packages["torch"])
    assert packages["transformers"] == importlib.metadata.version("transformers")


def test_the_commit_is_marked_changed_by_code_but_not_by_what_the_benchmarks_write_under_docs(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "docs" / "results" / "peer.json").write_text("{}\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "docs" / "results" / "peer.json").write_text('{"a": 1}\n')  # a result file written
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")  # code the figures would run
    assert git_commit(tmp_path) == head + "+changes"
    assert git_commit(tmp_path / "nowhere") == "unknown"
