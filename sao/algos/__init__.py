"""The SAO algorithm core: pure torch, no Ray, Prefect or Delta.

Modules: ``masked`` (reductions and denominators), ``dis`` (importance weights and mask),
``advantages`` (skip-observation GAE, GRPO, running mean), ``losses`` (DIS, PPO clip, value),
``waits`` (the wait a group-synchronous scheme imposes).
"""
