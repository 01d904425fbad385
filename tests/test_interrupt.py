"""The run's Ctrl-C handler (sao/interrupt.py) in this process: the first SIGINT raises
KeyboardInterrupt outside a graceful stage and only asks for a stop inside one; the handler is removed
afterwards. (The second SIGINT exits the process: tests/reliability/test_crash_resume.py.)"""

import os
import signal
import time

import pytest

from sao import interrupt


def sigint_and_wait() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs in the main thread between bytecodes


def test_outside_a_graceful_stage_the_first_ctrl_c_interrupts_at_once():
    lines = []
    before = signal.getsignal(signal.SIGINT)
    requested = []
    with pytest.raises(KeyboardInterrupt), interrupt.handle_ctrl_c("sao train --run-id r", echo=lines.append):
        try:
            sigint_and_wait()
        finally:
            requested.append(interrupt.requested())
    assert requested == [True]
    assert "Ctrl-C again to exit at once" in lines[0]
    assert signal.getsignal(signal.SIGINT) is before
    assert not interrupt.requested()  # the request ends with the run: later runs in this process start clean


def test_inside_a_graceful_stage_the_first_ctrl_c_only_asks_for_a_stop():
    lines = []
    with interrupt.handle_ctrl_c("sao train --run-id r", echo=lines.append):
        assert not interrupt.requested()  # a new run starts with no stop asked for
        with interrupt.graceful():
            sigint_and_wait()  # no KeyboardInterrupt
            assert interrupt.requested()
    assert len(lines) == 1 and not interrupt.requested()


def test_kill_children_stops_every_descendant():
    """In a child process (here it would kill this test session's Ray and servers): a grandchild and
    its own child are both killed."""
    import subprocess
    import sys

    import psutil

    script = ("import subprocess, sys, time\n"
              "from sao import interrupt\n"
              "inner = 'import subprocess, sys, time; subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"]); time.sleep(60)'\n"
              "child = subprocess.Popen([sys.executable, '-c', inner])\n"
              "time.sleep(2)\n"
              "import psutil\n"
              "pids = [p.pid for p in psutil.Process().children(recursive=True)]\n"
              "print(interrupt.kill_children(), *pids, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    killed, *pids = map(int, out.stdout.split())
    assert killed == len(pids) == 2
    time.sleep(0.5)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
