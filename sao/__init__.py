"""SAO: single-rollout asynchronous RL with every trajectory in Delta Lake."""

__version__ = "0.1.0"
