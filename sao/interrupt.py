"""Ctrl-C of a run: the first one stops it cleanly, the second one exits at once.

``sao train`` and ``sao demo`` run inside :func:`handle_ctrl_c`. The first SIGINT sets
:func:`requested`:

* in a stage that stops on its own (:func:`graceful`: the asynchronous pipeline, the version-0
  rollouts of value pretraining), launching stops, the trainer finishes the step it is in and commits
  it, rollouts in flight get a grace period to finish and be stored, and the rest are cancelled and
  stored as ``cancelled`` trajectories; the stage then raises :class:`RunInterrupted`;
* in any other stage (the SFT warm start, an evaluation, fitting the critic) it raises
  ``KeyboardInterrupt`` at once: those stages write their results atomically, so a resume redoes
  them.

The second SIGINT kills every process the run started (a local Ray instance, its workers, the
temporary Prefect server) and exits with status 130 without cleaning up: the run is still resumable,
and the rollouts left in flight are closed out when it resumes (:mod:`sao.lake.issued`).

The terminal sends SIGINT to the whole foreground process group, so the processes that must outlive
the first Ctrl-C run in sessions of their own (the temporary Prefect server,
:func:`sao.prefect_server.temporary_server`); Ray Train's own handler is kept out of the way by calling
``fit()`` off the main thread (:func:`sao.train.ray_trainer.run_fit`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = ["GRACE_S", "RunInterrupted", "graceful", "handle_ctrl_c", "kill_children", "request", "requested",
           "reset"]

GRACE_S = 5.0
"""Seconds in-flight rollouts get to finish after the first Ctrl-C before they are cancelled."""

_requested = threading.Event()
_graceful_depth = 0
_lock = threading.Lock()


class RunInterrupted(Exception):
    """The run stopped at a Ctrl-C (after committing what had finished); re-running it resumes."""


def requested() -> bool:
    """Whether a stop of the run was asked for (the first Ctrl-C, or :func:`request`)."""
    return _requested.is_set()


def request() -> None:
    """Ask the run to stop, as the first Ctrl-C does."""
    _requested.set()


def reset() -> None:
    _requested.clear()


@contextlib.contextmanager
def graceful() -> Iterator[None]:
    """Mark a stage that watches :func:`requested` and stops by itself: inside it, the first Ctrl-C
    does not raise ``KeyboardInterrupt``."""
    global _graceful_depth
    with _lock:
        _graceful_depth += 1
    try:
        yield
    finally:
        with _lock:
            _graceful_depth -= 1


def kill_children() -> int:
    """SIGKILL every descendant of this process (depth first); returns how many were signalled."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return len(children)


@contextlib.contextmanager
def handle_ctrl_c(resume_hint: str, *, echo: Callable[[str], None] | None = None) -> Iterator[None]:
    """Install the run's SIGINT handler (see the module docstring) for the block; ``resume_hint`` is
    the command that resumes the run, printed on the way out. Only from the main thread."""
    say = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    count = 0

    def on_sigint(signum, frame) -> None:
        nonlocal count
        count += 1
        if count == 1:
            _requested.set()
            if _graceful_depth == 0:  # a stage that stops at once (the warm start, an evaluation, a fit)
                say("\nCtrl-C: stopping. Ctrl-C again to exit at once.")
                raise KeyboardInterrupt
            say(f"\nCtrl-C: stopping (the current step is committed, rollouts in flight get {GRACE_S:.0f} s, "
                "the rest are cancelled). Ctrl-C again to exit at once.")
            return
        say(f"\nCtrl-C again: exiting now. Resume with: {resume_hint}")
        kill_children()
        os._exit(130)

    previous = signal.signal(signal.SIGINT, on_sigint)
    reset()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        reset()  # a stop asked for belongs to this run only
