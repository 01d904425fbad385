"""The algorithms a run can train with (``algorithm.name``). A module of its own, free of torch, so
that the ``sao`` command builds its options without importing the training stack (``sao --help`` and
``sao sql`` then start in about a second)."""

from __future__ import annotations

import enum


class Algorithm(enum.StrEnum):
    SAO = "sao"
    GRPO = "grpo"
    GRPO_DIS = "grpo_dis"
    PPO_ASYNC = "ppo_async"
    RUNNING_MEAN = "running_mean"
    SELF_IMITATION = "self_imitation"
