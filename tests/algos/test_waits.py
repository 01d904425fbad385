import pytest

from sao.algos.waits import group_waits, mean_group_wait


def test_seed_group_wait():
    assert group_waits([5, 8, 13, 40]) == [35, 32, 27, 0]
    assert mean_group_wait([5, 8, 13, 40]) == 23.5


def test_one_rollout_waits_for_nobody():
    assert mean_group_wait([7.0]) == 0.0


@pytest.mark.parametrize("times", [[], [1.0, -2.0], [float("nan")]])
def test_bad_times_are_refused(times):
    with pytest.raises(ValueError, match="completion_times"):
        group_waits(times)
