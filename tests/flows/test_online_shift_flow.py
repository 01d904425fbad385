"""The online_shift flow end to end on a tiny run (style warm start, training across one shift, the
recovery table), and its argument checks."""

from __future__ import annotations

import pytest

from flows.online_shift import online_shift


def test_shifts_outside_the_run_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="must lie inside"):
        online_shift.fn(run_id="bad", steps=10, shifts=[10], workdir=str(tmp_path))
    with pytest.raises(ValueError, match="increasing"):
        online_shift.fn(run_id="bad", steps=10, shifts=[6, 3], workdir=str(tmp_path))
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_a_tiny_run_reports_recovery_per_shift(tmp_path, ray_session, monkeypatch, prefect_harness):
    monkeypatch.chdir(tmp_path)
    result = online_shift(run_id="online-tiny", steps=6, shifts=[3], batch_size=4, max_in_flight=8,
                          max_tokens=24, sft_steps=6, smooth_window=2, pre_window=2, workdir="runs",
                          lake_root="lake")
    assert result["steps"] == 6
    (row,) = result["recovery"]
    assert row["shift"] == 3 and 0.0 <= row["pre_shift_reward"] <= 1.0
    assert row["steps_to_recover"] is None or 0 <= row["steps_to_recover"] < 3
    assert (tmp_path / "runs" / "online-tiny" / "sft" / "config.json").exists()
    assert result["settings"]["algorithm"]["name"] == "sao"
