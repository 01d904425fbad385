"""Fixtures of the trainer tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread, the training loop's default (``TrainConfig.torch_threads``), for tests that
    run torch in the test process: on a busy machine extra threads only contend (a 16-step critic fit
    took 81 s with two threads under load, 3.5 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
