"""The statistics of the learning benchmarks (`sao bench quality`, `sao bench online`): areas under
accuracy curves and bootstrap intervals.

A run's accuracy curve is known at a few evaluated versions (knots ``(x_k, acc_k)``: x in seconds or
trajectories). Between knots the curve is the straight line through them; after the last knot it holds
the last value (the run's final policy stays available). Its normalised area over ``[0, H]`` and its
value at one point are then linear in the knots' accuracies, ``sum_k w_k acc_k``, with weights that
depend on the x's only (:func:`area_weights`, :func:`point_weights`). Accuracy is a mean over the same
tasks for every run of a seed, so the same weights applied to each task's rewards give each task's
share of the area, and two runs of one seed compare task by task.

:func:`paired_bootstrap` resamples seeds, and tasks within each seed, with replacement: the interval
holds both the seed-to-seed spread of training and the evaluation's sampling noise. With one seed it
holds the evaluation noise only. :func:`two_sample_bootstrap` does the same for two unpaired samples of
each seed (two runs' own trajectories).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["area_weights", "decode_rewards", "encode_rewards", "interval_text", "paired_bootstrap",
           "point_weights", "two_sample_bootstrap"]


def _check(xs: Sequence[float]) -> None:
    if not xs or xs[0] != 0 or any(b < a for a, b in zip(xs, xs[1:], strict=False)):
        raise ValueError(f"knots must start at 0 and not decrease, got {list(xs)}")


def point_weights(xs: Sequence[float], t: float) -> np.ndarray:
    """Weights ``w`` with ``w @ acc`` the curve's value at ``t`` (``t`` >= 0)."""
    _check(xs)
    w = np.zeros(len(xs))
    if t >= xs[-1]:
        w[-1] = 1.0
        return w
    i = max(k for k in range(len(xs)) if xs[k] <= t)
    u = (t - xs[i]) / (xs[i + 1] - xs[i])
    w[i], w[i + 1] = 1.0 - u, u
    return w


def area_weights(xs: Sequence[float], horizon: float) -> np.ndarray:
    """Weights ``w`` with ``w @ acc`` the curve's mean over ``[0, horizon]`` (its area / horizon)."""
    _check(xs)
    if horizon <= 0:
        raise ValueError(f"horizon must be > 0, got {horizon}")
    w = np.zeros(len(xs))
    for i in range(len(xs) - 1):
        lo, hi = xs[i], min(xs[i + 1], horizon)
        if hi <= lo:
            continue
        # the segment's line over [lo, hi]: its mean is the mean of its ends' values
        end = point_weights(xs, hi)
        w[i] += (hi - lo) / 2
        w += (hi - lo) / 2 * end
    if horizon > xs[-1]:
        w[-1] += horizon - xs[-1]
    return w / horizon


def _resample_mean(values: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """(samples,) means of ``values`` drawn with replacement."""
    if len(values) == 0:
        raise ValueError("a seed has no values to resample")
    return values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)


def _over_seeds(point: list[float], per_seed: np.ndarray, samples: int, level: float,
                rng: np.random.Generator) -> dict[str, float]:
    """The mean of ``point`` (one figure per seed) and its percentile interval, from ``per_seed``
    (S, samples) resampled figures with the seeds themselves resampled."""
    drawn = rng.integers(0, len(point), size=(samples, len(point)))
    means = per_seed[drawn, np.arange(samples)[:, None]].mean(axis=1)
    tail = (1 - level) / 2
    return {"mean": float(np.mean(point)), "low": float(np.quantile(means, tail)),
            "high": float(np.quantile(means, 1 - tail)), "seeds": len(point), "per_seed": point,
            "level": level, "samples": samples}


def paired_bootstrap(differences: Sequence[np.ndarray], samples: int = 2000, seed: int = 0,
                     level: float = 0.95) -> dict[str, float]:
    """Mean of per-task differences (one array per seed, tasks of a seed paired) over seeds, and its
    percentile interval from resampling seeds, then tasks within each drawn seed."""
    if not differences:
        raise ValueError("no seeds to compare")
    rng = np.random.default_rng(seed)
    per_seed = np.stack([_resample_mean(d, samples, rng) for d in differences])
    return _over_seeds([float(d.mean()) for d in differences], per_seed, samples, level, rng)


def two_sample_bootstrap(pairs: Sequence[tuple[np.ndarray, np.ndarray]], samples: int = 2000, seed: int = 0,
                         level: float = 0.95) -> dict[str, float]:
    """Mean over seeds of ``mean(a) - mean(b)``, with ``a`` and ``b`` one seed's two independent samples
    (not paired: the rewards of two runs' own trajectories), and its percentile interval from
    resampling seeds, then each sample within its seed."""
    if not pairs:
        raise ValueError("no seeds to compare")
    rng = np.random.default_rng(seed)
    per_seed = np.stack([_resample_mean(a, samples, rng) - _resample_mean(b, samples, rng) for a, b in pairs])
    return _over_seeds([float(a.mean() - b.mean()) for a, b in pairs], per_seed, samples, level, rng)


def interval_text(result: dict[str, float]) -> str:
    """A bootstrap result as ``mean [low, high] (per seed ...)``."""
    return (f"{result['mean']:+.3f} [{result['low']:+.3f}, {result['high']:+.3f}] (per seed "
            + ", ".join(f"{d:+.3f}" for d in result["per_seed"]) + ")")


def encode_rewards(rewards: Sequence[float]) -> str | list[float]:
    """Per-task rewards as a string of 0s and 1s when every reward is 0 or 1 (a list otherwise)."""
    if all(r in (0.0, 1.0) for r in rewards):
        return "".join("1" if r else "0" for r in rewards)
    return [round(float(r), 6) for r in rewards]


def decode_rewards(encoded: str | Sequence[float]) -> np.ndarray:
    if isinstance(encoded, str):
        return np.frombuffer(encoded.encode(), dtype=np.uint8).astype(np.float64) - ord("0")
    return np.asarray(encoded, dtype=np.float64)
