"""Progress lines: the time left from the stage's own rate, worked by hand on a fake clock."""

from sao.progress import Progress, time_left


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_time_left_is_the_rate_since_the_first_update_times_what_remains():
    clock = Clock()
    progress = Progress("training", 10, "steps", clock=clock)
    assert progress.line(1, "reward 0.500") == "training 1/10 steps: reward 0.500"  # one point: no rate yet
    clock.now += 30.0  # 2 more steps in 30 s: 15 s a step, 7 to go: 105 s, shown in minutes from 90 s
    assert progress.line(3) == "training 3/10 steps (about 2 min left)"
    clock.now += 15.0  # 3 steps in 45 s, 6 to go: 90 s
    assert progress.line(4) == "training 4/10 steps (about 2 min left)"
    clock.now += 60.0  # 5 steps since the first in 105 s (21 s a step), 4 to go: 84 s
    assert progress.line(6) == "training 6/10 steps (about 84 s left)"
    clock.now += 15.0
    assert progress.line(10) == "training 10/10 steps (done)"


def test_a_stage_timed_from_its_start_and_resumed_part_way():
    clock = Clock()
    progress = Progress("SFT", 200, "steps", start=50, clock=clock)  # 50 done before a restart
    clock.now += 60.0  # 10 steps a minute from here on, 140 to go
    assert progress.line(60, "loss 1.234") == "SFT 60/200 steps: loss 1.234 (about 14 min left)"


def test_time_left_reads_in_the_unit_that_fits():
    assert [time_left(s) for s in (0.2, 40, 89, 90, 600, 5400, 9000)] == [
        "about 1 s left", "about 40 s left", "about 89 s left", "about 2 min left", "about 10 min left",
        "about 1.5 h left", "about 2.5 h left"]
