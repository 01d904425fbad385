"""The lake benchmark runs end to end (``--quick``) and writes its JSON and its RESULTS.md section."""

from __future__ import annotations

import json

import pytest

from benchmarks.lake_ingest import MARK_BEGIN, MARK_END, main, update_results_md


@pytest.mark.slow
def test_quick_run_writes_json_and_markdown(tmp_path):
    out, results = tmp_path / "lake.json", tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Someone else's section\n\nkept\n")
    assert main(["--quick", "--out", str(out), "--results-md", str(results)]) == 0
    data = json.loads(out.read_text())
    assert [row["batch"] for row in data["ingest"]] == [1, 64, 1024]
    assert all(row["rows_per_s"] > 0 for row in data["ingest"])
    assert data["two_writers"]["rows"] == 4096
    assert [q["rows"] for q in data["query"]] == [1000, 3000]
    text = results.read_text()
    assert "Someone else's section" in text and text.count(MARK_BEGIN) == 1


def test_results_section_is_replaced_in_place(tmp_path):
    path = tmp_path / "RESULTS.md"
    update_results_md(path, f"{MARK_BEGIN}\nfirst\n{MARK_END}")
    path.write_text(path.read_text() + "\n## Later section\n")
    update_results_md(path, f"{MARK_BEGIN}\nsecond\n{MARK_END}")
    text = path.read_text()
    assert text.startswith("# Results") and "first" not in text and "second" in text
    assert text.index("second") < text.index("## Later section")
