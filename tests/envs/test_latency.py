"""Injected tool latency: off by default, seeded per (key, call), heavy-tailed when on."""

from __future__ import annotations

import math
import statistics
import time

import pytest

from sao.envs.latency import LatencyConfig, LatencyKind, LatencyModel


def test_off_by_default():
    model = LatencyModel()
    assert model.config.kind is LatencyKind.NONE
    assert model.delay_s("task", 0) == 0.0
    start = time.monotonic()
    assert model.sleep("task", 0) == 0.0
    assert time.monotonic() - start < 0.05


def test_draws_depend_only_on_seed_key_and_call():
    config = LatencyConfig(kind="lognormal", seed=3)
    a, b = LatencyModel(config), LatencyModel(config)
    assert [a.delay_s("t1", i) for i in range(5)] == [b.delay_s("t1", i) for i in range(5)]
    assert a.delay_s("t1", 0) != a.delay_s("t2", 0)
    assert a.delay_s("t1", 0) != LatencyModel(LatencyConfig(kind="lognormal", seed=4)).delay_s("t1", 0)


def test_lognormal_median_and_heavy_tail():
    model = LatencyModel(LatencyConfig(kind="lognormal", median_s=0.05, sigma=1.0, max_s=100.0))
    draws = sorted(model.delay_s(f"k{i}", 0) for i in range(4000))
    assert statistics.median(draws) == pytest.approx(0.05, rel=0.1)
    p99 = draws[int(0.99 * len(draws))]
    assert p99 / statistics.median(draws) == pytest.approx(math.exp(2.326), rel=0.25)  # exp(sigma * z_0.99)


def test_pareto_tail_probability():
    config = LatencyConfig(kind="pareto", pareto_alpha=1.5, pareto_scale_s=0.02, max_s=1000.0)
    model = LatencyModel(config)
    draws = [model.delay_s(f"k{i}", 0) for i in range(4000)]
    assert min(draws) >= 0.02
    tail = sum(d > 0.2 for d in draws) / len(draws)
    assert tail == pytest.approx(10 ** -1.5, rel=0.25)  # P(X > 10 x_m) = 10^-alpha


def test_cap():
    model = LatencyModel(LatencyConfig(kind="pareto", pareto_alpha=0.5, max_s=0.3))
    assert max(model.delay_s(f"k{i}", 0) for i in range(500)) == 0.3


def test_sleep_waits_the_drawn_delay():
    model = LatencyModel(LatencyConfig(kind="lognormal", median_s=0.05, sigma=0.0))
    start = time.monotonic()
    assert model.sleep("k", 0) == pytest.approx(0.05)
    assert time.monotonic() - start >= 0.045


@pytest.mark.parametrize(("field", "value"), [("median_s", 0.0), ("sigma", -1.0), ("pareto_alpha", 0.0), ("kind", "uniform")])
def test_config_errors(field, value):
    with pytest.raises(ValueError, match=field if field != "kind" else "uniform"):
        LatencyConfig(**{field: value})
