"""Fixtures of the fault-injection suite (the Ray session, ``policy_dir`` and ``tokenizer`` come from
``tests/conftest.py``)."""

from tests.train.conftest import one_thread  # noqa: F401 - one intra-op thread for in-process training
