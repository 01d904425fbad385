"""The sandboxed Python tool: run model-written code in a throwaway, resource-limited child process.

Each call runs in a fresh child process, in its own process group and its own temporary working
directory (deleted afterwards), forked from a small *fork server* (:mod:`sao.envs._sandbox_server`):
a separate ``python -I -S`` interpreter (isolated mode, no site-packages, no environment variables)
that has already imported the allow-listed modules. Before the code runs, the child limits itself with
``resource.setrlimit`` (CPU seconds, address space, file size, processes, open files) and installs an
audit hook that refuses process creation, sockets, ctypes, new imports outside the allow-list and file
access outside its working directory. The server enforces the wall-clock timeout (SIGKILL to the
child's process group) and the output cap, reading the output incrementally.

A call never raises into the caller: a refused, failed, killed or unstartable call comes back as a
:class:`SandboxResult` whose ``observation`` is the error text the model sees.

Departures from a textbook sandbox, written down:
    * Fork server instead of one ``subprocess`` per call: a fresh interpreter that imports the
      allow-listed modules costs about 25 ms of CPU per call, a fork about 2 ms, and rollouts call the
      tool a lot. Every call still gets a new process and a new directory, and nothing survives it.
    * The limits are set by the child on itself after the fork, instead of in a ``preexec_fn`` (unsafe
      in multi-threaded parents such as Ray actors, and it disables ``vfork``). User code runs only
      after the limits and the hook are in place.
    * ``RLIMIT_NPROC`` is not enforced for root; the audit hook refuses ``os.fork`` and friends anyway.
    * ``random`` is imported once by the server, so each call starts from the same random state
      (tool calls are deterministic, which replay wants).
    * CPython audit hooks plus rlimits contain a model's mistakes and ordinary misuse; they are not a
      boundary against a determined attacker. Untrusted production code belongs in a container or VM.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

__all__ = [
    "DEFAULT_ALLOWED_MODULES",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxStatus",
    "run_python",
    "shared_sandbox",
]

DEFAULT_ALLOWED_MODULES: tuple[str, ...] = (
    "bisect",
    "cmath",
    "collections",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
)

_SERVER = Path(__file__).with_name("_sandbox_server.py")
_REPLY_HEADER = struct.Struct("<iBBI")
# Exit codes of the child (see _sandbox_server.py).
_EXIT_OK, _EXIT_REFUSED, _EXIT_MEMORY, _EXIT_BOOTSTRAP = 0, 2, 3, 70
# How long past the wall timeout the parent waits for the server's reply before declaring it dead.
_SERVER_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one tool call.

    Attributes:
        wall_timeout_s: wall-clock seconds from the fork to killing the child's process group.
        cpu_seconds: CPU-time limit (RLIMIT_CPU); the child gets SIGXCPU past it.
        memory_bytes: address-space limit (RLIMIT_AS) of the child, interpreter included.
        file_size_bytes: largest file the code may write in its working directory (RLIMIT_FSIZE).
        max_output_bytes: stdout + stderr kept; past it the child is killed and the output truncated.
        max_code_bytes: longer code is refused without running anything.
        open_files: file-descriptor limit (RLIMIT_NOFILE).
        allowed_modules: top-level modules the code may import.
        python_executable: interpreter of the fork server; ``None`` is the current one.
    """

    wall_timeout_s: float = 3.0
    cpu_seconds: int = 2
    memory_bytes: int = 256 * 2**20
    file_size_bytes: int = 2**20
    max_output_bytes: int = 2048
    max_code_bytes: int = 16384
    open_files: int = 32
    allowed_modules: tuple[str, ...] = DEFAULT_ALLOWED_MODULES
    python_executable: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "wall_timeout_s",
            "cpu_seconds",
            "memory_bytes",
            "file_size_bytes",
            "max_output_bytes",
            "max_code_bytes",
            "open_files",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        bad = [m for m in self.allowed_modules if not m.isidentifier()]
        if bad:
            raise ValueError(f"SandboxConfig.allowed_modules must be top-level module names, got {bad}")

    def server_argv(self) -> list[str]:
        return [
            self.python_executable or sys.executable, "-I", "-S", "-X", "utf8", str(_SERVER),
            str(round(self.wall_timeout_s * 1000)), str(self.max_output_bytes), str(self.cpu_seconds),
            str(self.memory_bytes), str(self.file_size_bytes), str(self.open_files),
            *self.allowed_modules,
        ]  # fmt: skip


class SandboxStatus(enum.StrEnum):
    """How a tool call ended."""

    OK = "ok"
    ERROR = "error"  # the code raised, did not parse, or hit the file-size limit
    REFUSED = "refused"  # an import, file, process or network operation outside the rules
    MEMORY = "memory"
    TIMEOUT = "timeout"  # wall clock or CPU time
    OUTPUT_LIMIT = "output_limit"
    CRASHED = "crashed"  # killed by another signal, or the sandbox itself failed


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """The outcome of one call.

    Attributes:
        status: see :class:`SandboxStatus`.
        output: what the code printed (stdout and stderr interleaved), truncated, decoded as UTF-8.
        returncode: the child's exit status (negative: killed by that signal), ``None`` if none ran.
        wall_s: seconds from the call to its result, as the caller saw them.
        detail: the sandbox's own note on a timeout, truncation or crash ('' otherwise).
    """

    status: SandboxStatus
    output: str
    returncode: int | None
    wall_s: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is SandboxStatus.OK

    @property
    def observation(self) -> str:
        """The text the model sees: the output, then the sandbox's note for a killed call."""
        text = self.output.strip()
        if self.detail:
            text = f"{text}\n{self.detail}" if text else self.detail
        return text


def _classify(returncode: int, timed_out: bool, capped: bool, config: SandboxConfig) -> tuple[SandboxStatus, str]:
    """Map the child's exit to ``(status, detail)``; the detail is appended to the observation."""
    if timed_out:
        return SandboxStatus.TIMEOUT, f"TimeoutError: the call ran longer than {config.wall_timeout_s:g} s"
    if capped:
        return SandboxStatus.OUTPUT_LIMIT, f"[output truncated at {config.max_output_bytes} bytes]"
    if returncode == _EXIT_OK:
        return SandboxStatus.OK, ""
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return SandboxStatus.TIMEOUT, f"TimeoutError: the CPU limit of {config.cpu_seconds} s was reached"
    if returncode == -signal.SIGXFSZ:
        return SandboxStatus.ERROR, f"OSError: the file size limit of {config.file_size_bytes} bytes was reached"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return SandboxStatus.CRASHED, f"Error: the process was killed by {name}"
    if returncode == _EXIT_REFUSED:
        return SandboxStatus.REFUSED, ""
    if returncode == _EXIT_MEMORY:
        return SandboxStatus.MEMORY, ""
    if returncode == _EXIT_BOOTSTRAP:
        return SandboxStatus.CRASHED, "Error: the sandbox could not set up the call"
    return SandboxStatus.ERROR, ""


class _ServerDied(Exception):
    pass


class _ForkServer:
    """One fork-server process; serves one call at a time."""

    def __init__(self, config: SandboxConfig, base_dir: str) -> None:
        self.process = subprocess.Popen(
            config.server_argv(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=base_dir,
            env={"LC_ALL": "C.UTF-8"},
            start_new_session=True,
            close_fds=True,
        )

    def call(self, code: bytes, deadline: float) -> tuple[int, bool, bool, bytes]:
        """Send ``code``; return ``(returncode, timed_out, capped, output)``; raise ``_ServerDied``."""
        try:
            self.process.stdin.write(struct.pack("<I", len(code)) + code)
            self.process.stdin.flush()
        except OSError as error:
            raise _ServerDied(f"could not send the code: {error}") from error
        header = self._read(_REPLY_HEADER.size, deadline)
        returncode, timed_out, capped, size = _REPLY_HEADER.unpack(header)
        return returncode, bool(timed_out), bool(capped), self._read(size, deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self.process.stdout.fileno()
        chunks: list[bytes] = []
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while n > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _ServerDied("the fork server did not answer in time")
                if not selector.select(remaining):
                    continue
                chunk = os.read(fd, n)
                if not chunk:
                    raise _ServerDied(f"the fork server exited (status {self.process.poll()})")
                chunks.append(chunk)
                n -= len(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:  # unsent bytes to a dead server: nothing left to deliver them to
                pass


def _shutdown(idle: list[_ForkServer], base_dir: str) -> None:
    while idle:
        idle.pop().kill()
    shutil.rmtree(base_dir, ignore_errors=True)


class Sandbox:
    """Runs tool calls in throwaway children; thread-safe.

    Keeps a pool of fork servers, one per concurrent caller, started on demand. Use as a context
    manager or call :meth:`close`; an unclosed sandbox is shut down when collected or at interpreter
    exit, and its servers exit by themselves if this process dies.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._base_dir = tempfile.mkdtemp(prefix="sao-sandbox-")
        self._lock = threading.Lock()
        self._idle: list[_ForkServer] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._idle, self._base_dir)

    def close(self) -> None:
        with self._lock:
            self._finalizer()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> _ForkServer:
        with self._lock:
            if not self._finalizer.alive:
                raise OSError("the sandbox is closed")
            if self._idle:
                return self._idle.pop()
            base_dir = tempfile.mkdtemp(dir=self._base_dir)
        return _ForkServer(self.config, base_dir)

    def _give_back(self, server: _ForkServer) -> None:
        with self._lock:
            if self._finalizer.alive:
                self._idle.append(server)
                return
        server.kill()

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` and return its result; never raises for anything the code does."""
        start = time.monotonic()
        data = code.encode("utf-8", errors="replace")

        def failed(status: SandboxStatus, detail: str) -> SandboxResult:
            return SandboxResult(status, "", None, time.monotonic() - start, detail)

        if len(data) > self.config.max_code_bytes:
            limit = self.config.max_code_bytes
            return failed(SandboxStatus.REFUSED, f"Error: the code is {len(data)} bytes, over the limit of {limit}")
        try:
            server = self._take()
        except OSError as error:
            return failed(SandboxStatus.CRASHED, f"Error: the sandbox could not start: {error}")
        try:
            returncode, timed_out, capped, raw = server.call(data, start + self.config.wall_timeout_s + _SERVER_GRACE_S)
        except _ServerDied as error:
            server.kill()
            return failed(SandboxStatus.CRASHED, f"Error: the sandbox failed: {error}")
        self._give_back(server)
        status, detail = _classify(returncode, timed_out, capped, self.config)
        output = raw.decode("utf-8", errors="replace")
        return SandboxResult(status, output, returncode, time.monotonic() - start, detail)


_SHARED: dict[SandboxConfig, Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """One process-wide :class:`Sandbox` per config (environments share it across episodes)."""
    config = config or SandboxConfig()
    with _SHARED_LOCK:
        sandbox = _SHARED.get(config)
        if sandbox is None:
            sandbox = _SHARED[config] = Sandbox(config)
        return sandbox


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in the shared sandbox for ``config`` (see :class:`Sandbox`)."""
    return shared_sandbox(config).run(code)
