"""Validation of trajectories on write: every rule, a vectorised fast path and a slow reference.

- :mod:`sao.lake.validate.rules`: what makes a trajectory row valid (:class:`Rule`, in reporting
  order), the :class:`Violation` each rule reports, and the messages both implementations share.
- :mod:`sao.lake.validate.vectorised`: :func:`validate_table`, the fast path the writer runs on each
  flushed batch (Arrow columns, numpy over the flat token arrays: no Python loop per token).
- :mod:`sao.lake.validate.reference`: :func:`validate_record`, the slow reference, written row by
  row over ``TrajectoryRecord.to_row()``; a property test holds the two equal on random corruptions.
"""

from sao.lake.validate.reference import validate_record
from sao.lake.validate.rules import NO_VERSION, Rule, Violation
from sao.lake.validate.vectorised import validate_table

__all__ = ["NO_VERSION", "Rule", "Violation", "validate_record", "validate_table"]
