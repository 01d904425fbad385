"""Progress lines a person can read for the long stages of a run (SFT, collecting version-0 rollouts,
training): ``<stage> <done>/<total> <unit>: <the figure that matters> (about 3 min left)``.

The time left is the stage's rate in this process so far (from its start, or from the first update it
saw, so a resumed stage is not credited with work done before the restart) applied to what remains;
nothing is shown until one unit of work has been timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Progress", "time_left"]


def time_left(seconds: float) -> str:
    """``"about 40 s left"``, ``"about 3 min left"``, ``"about 1.5 h left"``."""
    if seconds < 90:
        return f"about {max(seconds, 1.0):.0f} s left"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min left"
    return f"about {seconds / 3600:.1f} h left"


class Progress:
    """Counts a stage's work towards ``total`` and says where it stands.

    Args:
        stage: what is running, e.g. ``"SFT"`` or ``"value pretraining: version-0 rollouts"``.
        total: units of work of the whole stage.
        unit: their name (``"steps"``, ``"rollouts"``).
        start: units already done when the stage starts now (None: time from the first update, for a
            stage whose first unit includes a start-up that the rest do not pay).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, stage: str, total: int, unit: str, *, start: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stage, self.total, self.unit, self._clock = stage, max(int(total), 0), unit, clock
        self._first: tuple[float, int] | None = None if start is None else (clock(), start)  # (time, done)

    def left_s(self, done: int) -> float | None:
        """Seconds left at ``done`` units, from the rate since the first update (None: not known yet)."""
        now = self._clock()
        if self._first is None:
            self._first = (now, done)
            return None
        started, done_then = self._first
        if done <= done_then:
            return None
        return (now - started) / (done - done_then) * max(self.total - done, 0)

    def line(self, done: int, figure: str = "") -> str:
        """``"<stage> <done>/<total> <unit>[: figure][ (about N left)]"``; also times this update."""
        left = self.left_s(done)
        text = f"{self.stage} {done}/{self.total} {self.unit}" + (f": {figure}" if figure else "")
        if done >= self.total:
            return text + " (done)"
        return text if left is None else f"{text} ({time_left(left)})"
