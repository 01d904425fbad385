"""Pinning the engine thread to CPUs of its own and keeping the other threads off them."""

import os
import subprocess
import sys
import textwrap

import pytest

from sao.rollout.cpus import check_cpus
from sao.rollout.engine import SamplingParams
from sao.rollout.engine_process import TorchEngineProcess
from sao.rollout.torch_engine import TorchEngine, TorchEngineConfig
from tests.rollout.conftest import tiny_policy
from tests.rollout.test_engine_contract import PROMPTS

LAST = (os.cpu_count() or 1) - 1
needs_two = pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"),
                               reason="needs Linux and at least two CPUs")


def _thread_cpus(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_cpus_are_checked_and_normalised():
    assert check_cpus([LAST, 0, LAST]) == tuple(sorted({0, LAST}))
    with pytest.raises(ValueError, match="cpus is empty"):
        check_cpus([])
    with pytest.raises(ValueError, match=rf"cpus \[{LAST + 1}\] are not CPUs of this machine \(0 \.\. {LAST}\)"):
        check_cpus([LAST + 1])
    with pytest.raises(ValueError, match="cpus is empty"):
        TorchEngineConfig(cpus=())
    assert TorchEngineConfig(cpus=[LAST]).cpus == (LAST,)


@needs_two
def test_the_engine_thread_runs_on_its_cpus_and_the_callers_threads_are_left_alone():
    before = os.sched_getaffinity(0)
    engine = TorchEngine(tiny_policy(), config=TorchEngineConfig(cpus=(LAST,)))
    try:
        assert os.sched_getaffinity(engine._thread.native_id) == {LAST}
        assert os.sched_getaffinity(0) == before
        assert len(engine.generate_sync(PROMPTS[0], SamplingParams(max_tokens=5, seed=0), timeout=60).token_ids) == 5
    finally:
        engine.close()


@needs_two
def test_the_engine_process_keeps_its_pipe_thread_off_the_engine_cpus():
    engine = TorchEngineProcess(tiny_policy, config=TorchEngineConfig(cpus=(LAST,)))
    try:
        engine.generate_sync(PROMPTS[0], SamplingParams(max_tokens=5, seed=0), timeout=60)
        masks = list(_thread_cpus(engine._process.pid).values())
        assert masks.count({LAST}) == 1, masks  # the engine thread
        assert all(LAST not in mask for mask in masks if mask != {LAST}), masks
    finally:
        engine.close()


@needs_two
def test_keep_process_off_moves_every_thread_of_the_process():
    """In a process of its own (it moves the whole process): threads started before and after the call."""
    script = textwrap.dedent(f"""
        import os, threading, time
        from sao.rollout.cpus import keep_process_off
        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        others = keep_process_off([{LAST}])
        late = threading.Thread(target=stop.wait); late.start()
        masks = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")]
        stop.set()
        assert others and {LAST} not in others, others
        assert len(masks) >= 3 and all({LAST} not in m for m in masks), masks
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
