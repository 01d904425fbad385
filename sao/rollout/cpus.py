"""Keeping the engine's decode loop on CPUs of its own (Linux ``sched_setaffinity``).

A CPU engine's decode step is one thread of short, memory-bound kernels. When request handling shares
its core (a Serve replica's request threads, the caller's handle and router, Ray's I/O threads), each
wake-up preempts it and evicts part of its working set from the core's cache: on the rollout benchmark
at 64 requests through Serve the engine thread got 0.89 of a core and was preempted 737 times a second
while the machine's two cores were only 73% busy (docs/RESULTS.md).
:attr:`TorchEngineConfig.cpus <sao.rollout.torch_engine.TorchEngineConfig.cpus>` pins the engine thread
to the CPUs given, and the replica moves its other threads off them (:func:`keep_process_off`), as vLLM's
CPU backend binds its OpenMP threads to cores of their own (``VLLM_CPU_OMP_THREADS_BIND``). Which CPUs to give is a property of the machine and of how many replicas
share it, so nothing is pinned by default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["check_cpus", "keep_process_off", "pin_thread", "set_process_cpus"]


def _machine_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def check_cpus(cpus: Iterable[int]) -> tuple[int, ...]:
    """``cpus`` as a sorted tuple, or ``ValueError`` naming what is wrong (empty, not CPUs of this machine,
    no affinity call on this platform)."""
    wanted = tuple(sorted({int(c) for c in cpus}))
    if not wanted:
        raise ValueError("cpus is empty: give at least one CPU, or None to leave placement to the OS")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pinning to cpus needs Linux (os.sched_setaffinity); leave cpus None on this platform")
    outside = [c for c in wanted if c not in _machine_cpus()]
    if outside:
        raise ValueError(f"cpus {outside} are not CPUs of this machine (0 .. {os.cpu_count() - 1})")
    return wanted


def pin_thread(cpus: Iterable[int], native_id: int = 0) -> None:
    """Run a thread of this process (``threading.Thread.native_id``; 0: the calling one) on ``cpus`` only;
    threads it starts afterwards inherit that."""
    wanted = check_cpus(cpus)
    try:
        os.sched_setaffinity(native_id, wanted)
    except OSError as exc:  # EINVAL: none of them is in this process's cpuset (a container's CPU limit)
        raise ValueError(f"cannot run on cpus {list(wanted)}: {exc}") from exc


def keep_process_off(cpus: Iterable[int]) -> set[int]:
    """Move every thread of this process off ``cpus``; returns the CPUs they run on now.

    They keep the other CPUs of their current mask, or, where that holds no other (a process started by
    one already moved off, say the engine's own child process), the machine's other CPUs. Threads started
    afterwards inherit their creator's CPUs. Nothing moves when ``cpus`` are all the CPUs there are (a
    one-CPU machine): the engine then shares its CPU as before."""
    wanted = set(check_cpus(cpus))
    current = set(os.sched_getaffinity(0))
    others = (current - wanted) or (_machine_cpus() - wanted)
    if not others:
        return current
    set_process_cpus(others)
    return others


def set_process_cpus(cpus: Iterable[int]) -> None:
    """Run every thread of this process on ``cpus`` (threads it starts afterwards inherit their
    creator's)."""
    wanted = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), wanted)
        except (ProcessLookupError, PermissionError):  # the thread ended meanwhile / is not ours to move
            pass
