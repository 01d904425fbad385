"""Named crash points for the crash harness (``tests/reliability/test_crash_resume.py``).

Some moments of a run are too short to hit by killing it from outside at a random time: the gap
between a step's ``train_steps`` row and its ``policy_versions`` row, or between that row and the
weight publication. :func:`crash_point` marks them. It does nothing unless the environment names the
point, in ``SAO_CRASH_AT=<name>:<step>``, and a process group to kill, in ``SAO_CRASH_PGID`` (a
number, or ``session``: the group whose id is this process's session id, i.e. the ``sao train`` the
harness started with a session of its own); then,
on reaching that point at that step, it sends SIGKILL to that process group (the whole ``sao train``
a user started) exactly as ``kill -9 -PGID`` from a shell would, and then to itself (a Ray worker has a
process group of its own).

Points: ``mid-step`` (the update is computed, nothing of it saved), ``after-commit`` (the step's row is
committed, its version's row is not), ``before-publish`` (both rows committed, weights not yet
published to the replicas), each at a step; ``after-issue`` at the n-th append to
``rollout_tasks`` that one :class:`sao.lake.issued.IssueLog` makes. Each log counts its own: the training
driver's, value pretraining's collection's and a resume's close-out (one append, of ``abandoned`` rows)
each keep one, so the harness sets the point on a start whose first log with n appends is the driver's
(a first start without value pretraining). There, the n-th append's launches are committed and none
of their records is (a record is never committed before its launch): rollouts a resume must close out
and launch again.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_AT_ENV", "CRASH_PGID_ENV", "POINTS", "crash_point"]

CRASH_AT_ENV = "SAO_CRASH_AT"
CRASH_PGID_ENV = "SAO_CRASH_PGID"
POINTS = ("mid-step", "after-commit", "before-publish", "after-issue")


def crash_point(name: str, step: int) -> None:
    """SIGKILL the process group in ``SAO_CRASH_PGID`` if ``SAO_CRASH_AT`` is ``name:step`` (``step``: the
    step, or for ``after-issue`` the count of appends)."""
    target = os.environ.get(CRASH_AT_ENV)
    if not target or target != f"{name}:{step}":
        return
    group = os.environ[CRASH_PGID_ENV]
    pgid = os.getsid(0) if group == "session" else int(group)
    os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)  # a Ray worker has a group of its own: it must not go on
