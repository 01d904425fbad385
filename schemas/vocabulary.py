"""The lake's vocabulary: the values that string columns of the ``trajectories`` table may hold.

Standard library only (no pyarrow), so that code below the lake, the algorithm core included
(:mod:`sao.algos.sampling`), can share these names with the tables. :mod:`schemas.trajectories`
re-exports them next to the columns that store them.
"""

from __future__ import annotations

import enum

__all__ = ["LogprobKind", "SegmentKind", "TerminationReason"]


class TerminationReason(enum.StrEnum):
    """Why a trajectory ended (``termination_reason``). Only ``stop`` ends with value 0; the budget
    reasons (``length``, ``turns``, ``timeout``) bootstrap; ``cancelled`` and ``error`` ends are stored
    and, by default, not trained on (SAO.md section 2; ``UpdateConfig.skip_reasons``)."""

    STOP = "stop"  # natural end: stop token or answer given
    LENGTH = "length"  # token budget exhausted
    TURNS = "turns"  # turn budget exhausted
    TIMEOUT = "timeout"  # wall-clock budget exhausted
    CANCELLED = "cancelled"  # cancelled by the driver (shutdown, weight refresh policy, ...)
    ERROR = "error"  # the engine, a tool or the environment failed


class LogprobKind(enum.StrEnum):
    """Which distribution the engine's log-probabilities come from (``logprob_kind``); the trainer
    recomputes the current policy's under the same kind."""

    SAMPLING = "sampling"  # after temperature / top-k / top-p: what the sampler drew from
    RAW = "raw"  # the model's own distribution


class SegmentKind(enum.StrEnum):
    """Who produced a run of completion tokens (``segments.kind``)."""

    ACTION = "action"  # sampled by the policy
    OBSERVATION = "observation"  # inserted by a tool or the environment
