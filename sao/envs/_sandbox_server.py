"""The sandboxed Python tool's fork server (run as ``python -I -S -X utf8 _sandbox_server.py ARGS``).

Standard library only; never imported by the parent package. The server imports the allow-listed
modules once, then serves requests from its parent over stdin/stdout, one at a time. For each request
it forks a child that, before running anything:

1. moves into its own process group, points stdout/stderr at a fresh pipe, closes every other
   descriptor and enters a throwaway working directory;
2. limits itself with ``resource.setrlimit`` (CPU seconds, address space, file size, processes, open
   files, core dumps);
3. installs an audit hook (``sys.addaudithook``: Python code cannot remove it) that refuses new module
   imports outside the allow-list, process creation (fork, exec, spawn, system, subprocess), signals,
   sockets, ctypes, rlimit changes, and file-system access outside the working directory (reads of the
   standard library's own files excepted);
4. runs the code with ``__import__`` replaced by an allow-list check, prints the value of a trailing
   expression like a REPL, and reports an exception as one line ``Type: message``.

The server enforces the wall-clock timeout (SIGKILL to the child's process group) and the output cap,
reaps the child, deletes its directory, and replies.

Protocol (little-endian). Request: ``u32 n`` then ``n`` bytes of UTF-8 code. Reply: ``i32 returncode``
(negative: killed by that signal), ``u8 timed_out``, ``u8 capped``, ``u32 m``, ``m`` bytes of output.

Child exit codes: 0 ok, 1 the code raised, 2 a refusal escaped the code, 3 memory, 70 bootstrap failure.

Arguments (positional): wall_timeout_ms, max_output_bytes, cpu_seconds, address_space_bytes,
file_size_bytes, open_files, then the allowed top-level module names.
"""

import os
import resource
import selectors
import shutil
import signal
import struct
import sys
import time

EXIT_OK, EXIT_ERROR, EXIT_REFUSED, EXIT_MEMORY, EXIT_BOOTSTRAP = 0, 1, 2, 3, 70

# Audit events refused outright (prefix match on the event name).
_REFUSED_EVENTS = (
    "os.system",
    "os.exec",
    "os.spawn",
    "os.posix_spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "os.chdir",
    "os.chroot",
    "os.setuid",
    "os.setgid",
    "os.putenv",
    "os.unsetenv",
    "subprocess.",
    "pty.",
    "socket.",
    "ctypes.",
    "mmap.",
    "resource.setrlimit",
    "resource.prlimit",
    "signal.",
    "sys.addaudithook",
    "sys.setprofile",
    "sys.settrace",
    "urllib.",
    "webbrowser.",
)
# Audit events whose string arguments are paths: allowed only inside the working directory.
_PATH_EVENTS = ("os.", "shutil.", "glob.", "tempfile.", "pathlib.", "open")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class SandboxRefusal(PermissionError):
    """Raised by the audit hook and the import guard for anything outside the sandbox's rules."""


def _refuse_import(name: str, allowed: frozenset) -> None:
    if name.partition(".")[0] not in allowed:
        raise SandboxRefusal(f"refused: import of {name!r} (allowed: {', '.join(sorted(allowed))})")


def _inside(path: object, directory: str) -> bool:
    full = os.path.realpath(os.fspath(path))
    return full == directory or full.startswith(directory + os.sep)


def _is_write(event: str, args: tuple) -> bool:
    if event != "open":
        return True  # os.remove, os.rename, os.listdir ...: every other path event counts as a write
    mode, flags = args[1], args[2]
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(isinstance(flags, int) and flags & _WRITE_FLAGS)


def _install_hook(root: str, stdlib: str, allowed: frozenset) -> None:
    def hook(event: str, args: tuple) -> None:
        if event == "import":
            _refuse_import(args[0], allowed)
        elif event.startswith(_REFUSED_EVENTS):
            raise SandboxRefusal(f"refused: {event}")
        elif event.startswith(_PATH_EVENTS):
            writes = _is_write(event, args)
            paths = args[:1] if event == "open" else args
            for path in paths:
                if not isinstance(path, (str, bytes)):
                    continue
                if _inside(path, root) or (not writes and _inside(path, stdlib)):
                    continue
                raise SandboxRefusal(f"refused: {event} outside the working directory ({path!r})")

    sys.addaudithook(hook)


def _run(code: str, allowed: frozenset) -> int:
    import ast  # already imported by main(), before any hook
    import builtins

    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0:
            _refuse_import(name, allowed)
        return real_import(name, globals, locals, fromlist, level)

    namespace = {"__name__": "__main__", "__builtins__": {**vars(builtins), "__import__": guarded_import}}
    try:
        tree = ast.parse(code, "<tool>", "exec")
    except SyntaxError as error:
        print(f"SyntaxError: {error.msg} (line {error.lineno})")
        return EXIT_ERROR
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    try:
        exec(compile(tree, "<tool>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except MemoryError:
        print("MemoryError: the memory limit was reached")
        return EXIT_MEMORY
    except SandboxRefusal as error:
        print(f"SandboxRefusal: {error}")
        return EXIT_REFUSED
    except BaseException as error:  # noqa: BLE001 - every failure of user code becomes one line
        print(f"{type(error).__name__}: {error}")
        return EXIT_ERROR
    return EXIT_OK


def _child(code: bytes, workdir: str, out_fd: int, limits: tuple, allowed: frozenset, stdlib: str):
    status = EXIT_BOOTSTRAP
    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.chdir(workdir)
        cpu_s, address_space, file_size, open_files = limits
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no fork (root is exempt: the hook is not)
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _install_hook(os.path.realpath(workdir), stdlib, allowed)
        status = _run(code.decode("utf-8", errors="replace"), allowed)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - never fall back into the server's loop
        pass
    os._exit(status)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, size = [], 0
    while size < n:
        chunk = os.read(fd, n - size)
        if not chunk:
            return None
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _collect(fd: int, deadline: float, cap: int) -> tuple:
    """Read the child's output until EOF, the deadline or ``cap`` bytes: ``(data, timed_out, capped)``."""
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return b"".join(chunks), True, False
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks), False, False
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                return b"".join(chunks)[:cap], False, True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int, deadline: float) -> tuple:
    """Wait for the child until ``deadline`` (then kill it): ``(returncode, timed_out)``."""
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), timed_out
        if time.monotonic() >= deadline:
            _kill_group(pid)
            timed_out = True
            done, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), timed_out
        time.sleep(0.001)


def _serve_one(code: bytes, workdir: str, config: tuple, allowed: frozenset, stdlib: str) -> bytes:
    wall_s, cap, limits = config
    os.mkdir(workdir)
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(code, workdir, write_fd, limits, allowed, stdlib)
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)  # also done by the child: whichever runs first wins the race
    except (ProcessLookupError, PermissionError):
        pass
    deadline = start + wall_s
    output, timed_out, capped = _collect(read_fd, deadline, cap)
    if timed_out or capped:
        _kill_group(pid)
    returncode, late = _reap(pid, max(deadline, time.monotonic() + 0.05))
    os.close(read_fd)
    shutil.rmtree(workdir, ignore_errors=True)
    return struct.pack("<iBBI", returncode, timed_out or late, capped, len(output)) + output


def main() -> int:
    wall_ms, cap, cpu_s, address_space, file_size, open_files = (int(a) for a in sys.argv[1:7])
    allowed = frozenset(sys.argv[7:])
    import ast  # noqa: F401 - used by the children, imported before their hook refuses new imports

    for name in sorted(allowed):
        __import__(name)
    config = (wall_ms / 1000.0, cap, (cpu_s, address_space, file_size, open_files))
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    base = os.getcwd()
    for call in range(1 << 62):
        header = _read_exact(0, 4)
        if header is None:
            return 0  # the parent closed the pipe (or died)
        (n,) = struct.unpack("<I", header)
        code = _read_exact(0, n)
        if code is None:
            return 0
        reply = memoryview(_serve_one(code, os.path.join(base, f"call-{call}"), config, allowed, stdlib))
        while reply:
            reply = reply[os.write(1, reply) :]
    return 0


if __name__ == "__main__":
    sys.exit(main())
