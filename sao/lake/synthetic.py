"""Synthetic, valid trajectories for tests and benchmarks (no model involved).

A trajectory alternates action and observation segments, as an agent loop with a tool produces them:
``turns`` action segments separated by ``turns - 1`` observation segments. Log-probabilities are drawn
in (-5, 0) at action positions and are 0.0 at observation positions.
"""

from __future__ import annotations

import datetime as dt
import uuid

import numpy as np

from sao.lake.records import RecordedSampling, Segment, Timings, TrajectoryRecord
from schemas.trajectories import LogprobKind, SegmentKind, TerminationReason

__all__ = ["make_trajectory", "make_trajectories"]

_EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def make_trajectory(
    rng: np.random.Generator,
    *,
    run_id: str = "run-0",
    trajectory_id: str | None = None,
    num_tokens: int = 500,
    prompt_tokens: int = 64,
    turns: int = 2,
    policy_versions: tuple[int, ...] = (0,),
    vocab_size: int = 512,
) -> TrajectoryRecord:
    """One valid trajectory of ``num_tokens`` completion tokens.

    ``policy_versions`` are assigned to the action segments in order (the last one repeats), as when
    weights refresh between turns. With ``turns`` action segments, observations take about a fifth of
    the tokens.
    """
    if num_tokens < 2 * turns - 1:
        raise ValueError(f"num_tokens={num_tokens} cannot hold {turns} turns")
    bounds = _segment_bounds(rng, num_tokens, turns)
    segments: list[Segment] = []
    action_mask = np.zeros(num_tokens, dtype=np.bool_)
    for index, (start, end) in enumerate(bounds):
        if index % 2 == 0:
            version = policy_versions[min(index // 2, len(policy_versions) - 1)]
            segments.append(Segment(SegmentKind.ACTION, start, end, version))
            action_mask[start:end] = True
        else:
            segments.append(Segment(SegmentKind.OBSERVATION, start, end, None))
    logprobs = np.where(action_mask, -5.0 * rng.random(num_tokens, dtype=np.float32), 0.0)
    created = _EPOCH + dt.timedelta(seconds=float(rng.integers(0, 10**6)))
    return TrajectoryRecord(
        trajectory_id=trajectory_id
        or uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | int(rng.integers(0, 2**63))).hex,
        run_id=run_id,
        task_id=f"task-{int(rng.integers(0, 10_000))}",
        env_name="math_tool",
        prompt_ids=rng.integers(0, vocab_size, prompt_tokens, dtype=np.int32),
        completion_ids=rng.integers(0, vocab_size, num_tokens, dtype=np.int32),
        action_mask=action_mask,
        logprobs=logprobs.astype(np.float32),
        logprob_kind=LogprobKind.SAMPLING,
        segments=tuple(segments),
        reward=float(rng.integers(0, 2)),
        termination_reason=TerminationReason.STOP,
        num_turns=turns,
        sampling=RecordedSampling(
            temperature=1.0, top_p=1.0, top_k=None, max_tokens=num_tokens, seed=7
        ),
        tokenizer_version="tiny-qwen3-moe@1",
        chat_template_version="chatml@1",
        engine_name="torch",
        engine_version="2.13.0",
        worker_id="rollout-0",
        timings=Timings(
            created_at=created,
            started_at=created + dt.timedelta(milliseconds=5),
            finished_at=created + dt.timedelta(seconds=2),
            generation_s=1.5,
            tool_s=0.4,
        ),
    )


def make_trajectories(
    count: int, *, seed: int = 0, run_id: str = "run-0", **kwargs: object
) -> list[TrajectoryRecord]:
    """``count`` trajectories from one seeded generator (same seed, same records)."""
    rng = np.random.default_rng(seed)
    return [make_trajectory(rng, run_id=run_id, **kwargs) for _ in range(count)]  # type: ignore[arg-type]


def _segment_bounds(rng: np.random.Generator, n: int, turns: int) -> list[tuple[int, int]]:
    """``2 * turns - 1`` non-empty half-open ranges tiling ``[0, n)``."""
    pieces = 2 * turns - 1
    if pieces == 1:
        return [(0, n)]
    weights = np.where(np.arange(pieces) % 2 == 0, 4.0, 1.0) * (0.5 + rng.random(pieces))
    lengths = np.maximum(1, np.floor(weights / weights.sum() * n).astype(np.int64))
    lengths[-1] = n - lengths[:-1].sum()
    while lengths[-1] < 1:  # give the last piece a token from the longest one
        longest = int(np.argmax(lengths[:-1]))
        lengths[longest] -= 1
        lengths[-1] += 1
    ends = np.cumsum(lengths)
    return [(int(e - length), int(e)) for e, length in zip(ends, lengths, strict=True)]
