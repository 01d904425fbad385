"""The Python tool sandbox against a list of escape attempts, run the way a rollout worker runs them:
through the math_tool environment's tool call. Every attempt ends in bounded time as a non-OK
observation, leaves nothing outside its folder, and the worker (this process and its sandbox) stays
healthy: the next ordinary tool call answers correctly.

Several attempts reach the fork server's own ``os`` / ``sys`` modules without importing anything
(through ``object.__subclasses__()`` or a traceback's frames): from there only the audit hook and the
rlimits stand in the way, which is what these attempts check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sao.envs.base import Split, Task
from sao.envs.math_tool import MathToolConfig, MathToolEnv
from sao.envs.sandbox import Sandbox, SandboxConfig, SandboxStatus
from sao.models.chat import TOOL_CALL_END, TOOL_CALL_START

BOUND_S = 10.0  # per attempt, on a busy 2-core machine (the limits below are much shorter)
CONFIG = SandboxConfig(wall_timeout_s=1.5, cpu_seconds=1, memory_bytes=192 * 2**20)

# The server's module globals (os, sys, resource, signal, ...) through a traceback's frames.
FRAMES = """
try:
    1 / 0
except ZeroDivisionError as error:
    frame = error.__traceback__.tb_frame
while frame.f_back is not None:
    frame = frame.f_back
g = frame.f_globals
os, sys = g['os'], g['sys']
"""
# The loaded ``os`` module's namespace through a class defined in os.py.
SUBCLASSES = (
    "g = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]"
    ".__init__.__globals__\n"
)
# An extension module loaded straight from lib-dynload, bypassing ``import``.
EXTENSION = FRAMES + """
def every(cls):
    try:
        kids = cls.__subclasses__()
    except TypeError:
        return []
    return [k for c in kids for k in [c, *every(c)]]
classes = {c.__name__: c for c in every(object)}
def load(name):
    path = os.path.dirname(os.__file__) + '/lib-dynload/' + name + '.cpython-311-x86_64-linux-gnu.so'
    loader = classes['ExtensionFileLoader'](name, path)
    return loader.create_module(classes['ModuleSpec'](name, loader, origin=path))
"""
BUILTIN = (
    "bi = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'BuiltinImporter'][0]\n"
)

NOT_OK = {
    SandboxStatus.REFUSED,
    SandboxStatus.ERROR,
    SandboxStatus.TIMEOUT,
    SandboxStatus.MEMORY,
    SandboxStatus.OUTPUT_LIMIT,
    SandboxStatus.CRASHED,
}


def attempts(outside: Path) -> dict[str, tuple[str, set[SandboxStatus]]]:
    """name -> (code, acceptable outcomes). ``outside`` is a folder the code must not touch."""
    target = str(outside / "pwned.txt")
    refused = {SandboxStatus.REFUSED}
    return {
        # Imports of dangerous modules, and tricks around the import guard.
        **{f"import_{m}": (f"import {m}", refused)
           for m in ("os", "subprocess", "socket", "ctypes", "sys", "io", "pathlib", "shutil", "threading",
                     "multiprocessing", "importlib", "builtins", "posix", "_posixsubprocess", "signal")},
        "dunder_import": ("__import__('os').system('id')", refused),
        "builtins_dict_import": ("__builtins__['__import__']('subprocess')", refused),
        "from_import": ("from os import system", refused),
        "importlib_via_random": ("import random\nrandom._os.system('id')", refused),
        "eval_import": ("eval(\"__import__('socket')\")", refused),
        "exec_import": ("exec('import ctypes')", refused),
        "frames_real_import": (
            "try:\n    1/0\nexcept ZeroDivisionError as e:\n    f = e.__traceback__.tb_frame.f_back\n"
            "f.f_locals['real_import']('subprocess')", refused),
        "builtin_importer_posix": (BUILTIN + f"bi.load_module('posix').open({target!r}, 65)", refused),
        "extension_posixsubprocess": (EXTENSION + "load('_posixsubprocess')", refused),
        "extension_socket": (EXTENSION + "load('_socket').socket()", refused),
        "extension_ctypes": (EXTENSION + "load('_ctypes')", refused),
        # Process creation and signals through the server's own modules.
        "os_system": (SUBCLASSES + "g['system']('touch " + target + "')", refused),
        "os_popen": (SUBCLASSES + "g['popen']('id').read()", refused),
        "os_fork": (FRAMES + "os.fork()", refused),
        "os_posix_spawn": (FRAMES + "os.posix_spawn('/bin/sh', ['sh'], {})", refused),
        "os_exec": (FRAMES + "os.execv('/bin/sh', ['sh', '-c', 'touch " + target + "'])", refused),
        "os_kill_parent": (FRAMES + "os.kill(os.getppid(), 9)", refused),
        "os_killpg": (FRAMES + "os.killpg(0, 9)", refused),
        "setrlimit": (FRAMES + "g['resource'].setrlimit(g['resource'].RLIMIT_CPU, (100, 100))", refused),
        # signal.signal raises no audit event: ignoring SIGXCPU works, and the wall clock still ends it.
        "signal_handler": (FRAMES + "g['signal'].signal(24, g['signal'].SIG_IGN)\nwhile True: pass",
                           {SandboxStatus.REFUSED, SandboxStatus.TIMEOUT}),
        "fork_bomb": (FRAMES + "while True:\n    os.fork()", refused),
        # CPython drops a new hook silently when an existing one objects: it must never run.
        "add_audit_hook": (FRAMES + "sys.addaudithook(lambda *a: print('ESCAPED'))\nopen('f', 'w').close()",
                           {SandboxStatus.OK, SandboxStatus.REFUSED}),
        # Files outside the folder.
        "read_etc_passwd": ("print(open('/etc/passwd').read())", refused),
        "read_parent_dir": ("print(open('../../secret').read())", refused),
        "write_outside": (f"open({target!r}, 'w').write('x')", refused),
        "append_outside": (f"open({target!r}, 'a').write('x')", refused),
        "os_open_outside": (FRAMES + f"os.open({target!r}, os.O_WRONLY | os.O_CREAT)", refused),
        "listdir_root": (FRAMES + "print(os.listdir('/'))", refused),
        "remove_outside": (FRAMES + f"os.remove({target!r})", refused),
        "rename_outside": (FRAMES + f"open('a', 'w').close()\nos.rename('a', {target!r})", refused),
        "symlink_out": (FRAMES + "os.symlink('/etc/passwd', 'link')\nprint(open('link').read())", refused),
        "chdir_out": (FRAMES + "os.chdir('/')", refused),
        "stdlib_dotdot": (FRAMES + "print(open(os.path.dirname(os.__file__) + '/../../../../etc/passwd').read())",
                          refused),
        "environ_secret": (FRAMES + "os.putenv('X', '1')", refused),
        # Network.
        "socket_via_frames": (FRAMES + "sys.modules.get('socket') or __import__('socket')", refused),
        # Resource bombs and loops.
        "memory_bomb": ("x = 'a' * (10**10)", {SandboxStatus.MEMORY}),
        "memory_list_bomb": ("x = [0] * (10**9)", {SandboxStatus.MEMORY}),
        "output_bomb": ("while True:\n    print('x' * 10000)", {SandboxStatus.OUTPUT_LIMIT}),
        "output_bomb_raw_fd": (FRAMES + "while True:\n    os.write(1, b'y' * 65536)", {SandboxStatus.OUTPUT_LIMIT}),
        "disk_bomb": ("f = open('big', 'w')\nwhile True:\n    f.write('x' * 10**6)", {SandboxStatus.ERROR}),
        "infinite_loop": ("while True:\n    pass", {SandboxStatus.TIMEOUT}),
        "sleep_forever": (BUILTIN + "t = bi.load_module('time')\nt.sleep(3600)", {SandboxStatus.TIMEOUT}),
        "recursion_crash": ("import functools\nf = lambda n: f(n + 1)\nf(0)", NOT_OK),
        "huge_int_print": ("print(10 ** (10 ** 8))", {SandboxStatus.TIMEOUT, SandboxStatus.ERROR}),
    }  # fmt: skip


@pytest.fixture(scope="module")
def env():
    with Sandbox(CONFIG) as sandbox:
        environment = MathToolEnv(MathToolConfig(max_tool_calls=1000), sandbox=sandbox)
        environment.reset(Task("t-1", "math_tool", "What is 483 * 27 + 915?", "13956", Split.TRAIN))
        yield environment


def tool_call(env: MathToolEnv, code: str) -> tuple[SandboxStatus, str]:
    result = env.step(f"{TOOL_CALL_START}{code}{TOOL_CALL_END}")
    assert not result.done
    return SandboxStatus(result.info["tool_status"]), result.observation


def test_every_escape_attempt_is_contained_in_bounded_time(env, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    cwd, environ = os.getcwd(), dict(os.environ)
    failures = []
    for name, (code, acceptable) in attempts(outside).items():
        started = time.monotonic()
        status, observation = tool_call(env, code)
        elapsed = time.monotonic() - started
        if status not in acceptable or elapsed > BOUND_S or "ESCAPED" in observation:
            failures.append(f"{name}: {status} in {elapsed:.1f} s: {observation[:200]!r}")
        if list(outside.iterdir()):
            failures.append(f"{name}: wrote {[p.name for p in outside.iterdir()]} outside its folder")
    assert failures == []
    # The worker is healthy: same folder and environment, the sandbox still answers correctly.
    assert os.getcwd() == cwd and dict(os.environ) == environ
    assert tool_call(env, "print(483*27+915)") == (SandboxStatus.OK, "13956")


def test_attempts_are_bounded_even_back_to_back(env):
    """Ten bombs in a row do not wedge the sandbox's server: each call still gets a fresh child."""
    started = time.monotonic()
    for _ in range(5):
        assert tool_call(env, "x = [0] * (10**9)")[0] is SandboxStatus.MEMORY
        assert tool_call(env, "while True:\n    print('x' * 10000)")[0] is SandboxStatus.OUTPUT_LIMIT
    assert time.monotonic() - started < 10 * BOUND_S
    assert tool_call(env, "sum(range(10))") == (SandboxStatus.OK, "45")
