"""Back-pressure: how many trajectories may start at a trainer version."""

import pytest

from sao.rollout.staleness import StalenessGate


def test_capacity_hand_worked():
    gate = StalenessGate(batch_size=4, max_staleness=2)
    # At version 0 with staleness 2: (0 + 2 + 1) * 4 = 12 may start.
    assert gate.capacity(0) == 12
    gate.start(12)
    assert gate.capacity(0) == 0
    assert gate.capacity(1) == 4  # one more version consumed: one more batch may start
    gate.start(3)
    assert gate.capacity(1) == 1


def test_zero_staleness_is_synchronous_batches():
    gate = StalenessGate(batch_size=8, max_staleness=0)
    assert gate.capacity(0) == 8
    gate.start(8)
    assert gate.capacity(0) == 0 and gate.capacity(1) == 8


def test_a_resumed_run_counts_from_its_version():
    gate = StalenessGate(batch_size=4, max_staleness=1, initial_version=10)
    assert gate.capacity(10) == 8


@pytest.mark.parametrize(("kw", "field"), [({"batch_size": 0, "max_staleness": 1}, "batch_size"),
                                           ({"batch_size": 1, "max_staleness": -1}, "max_staleness")])
def test_bad_settings(kw, field):
    with pytest.raises(ValueError, match=field):
        StalenessGate(**kw)


def test_released_places_open_again():
    gate = StalenessGate(batch_size=4, max_staleness=0)
    gate.start(4)
    assert gate.capacity(0) == 0
    gate.release(1)  # one of them will never be trained on
    assert gate.capacity(0) == 1 and gate.started == 3
    with pytest.raises(ValueError, match="cannot release 4 of 3"):
        gate.release(4)
