"""The shared report helpers: each section's machine line names the commit its figures were measured at."""

from benchmarks._report import machine_line, parts_lines

INFO = {"cpus": 2, "memory_gib": 23.5, "platform": "Linux", "python": "3.11.7", "torch": "2.13.0+cpu",
        "ray": "2.60.0", "date": "2026-12-04T09:36:20+00:00", "load_average_1m": 1.67, "commit": "35df562"}


def test_the_machine_line_names_the_commit_once_and_leaves_it_out_when_unknown():
    line = machine_line(INFO)
    assert line.endswith("1-minute load average at the start 1.67. Commit `35df562`.")
    assert "Commit" not in machine_line({**INFO, "commit": None})
    parts = parts_lines(["sao bench quality --seeds 0"], [{"seed": 0, "machine": INFO, "wall_s": 90.0}])
    assert parts[-1].count("35df562") == 1 and parts[-1].endswith("1.5 min")
