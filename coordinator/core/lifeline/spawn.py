"""Start child processes that die with this process (Linux: a parent-death signal).

:func:`spawn` starts a program through :mod:`trampoline <coordinator.core.lifeline.trampoline>`,
which arms ``prctl(PR_SET_PDEATHSIG)`` and then ``exec``\\ s the program (same pid). The
result is a :class:`Spawned`; :meth:`Spawned.confirm` waits until the program really
runs and raises the ``OSError`` that ``subprocess.Popen`` would have raised when it
cannot (missing program, no permission).

Two traps of the parent-death signal, and how they are closed here:

- **It follows the forking thread, not the process.** The kernel sends it when the
  *thread* that forked the child ends, even if the process lives on. So a fork is done
  either by the main thread (which, in Python, ends only with the process) when that is
  the caller, or else by one daemon thread ("lifeline spawner") that lives as long as
  the process, whatever other thread calls :func:`spawn` (a test's helper thread, an
  agent run in a thread). That thread starts when this module is imported, so it is
  there before any caller's threads (and before any test that counts threads); after
  ``os.fork()`` a child process gets its own on first need.
- **The parent may die before the child arms it.** The trampoline compares
  ``getppid()`` with the pid it was given after ``prctl``; if they differ, the program
  is never started.

Why not ``Popen(preexec_fn=…prctl…)``, which costs no extra interpreter: the Python
documentation calls ``preexec_fn`` unsafe in a process with threads (the child runs
Python code between ``fork`` and ``exec``, with any lock another thread held at the fork
possibly held forever), and an agent always has threads (gRPC's, the etcd keep-alive,
the worker waiters). It also forces a real ``fork`` of the whole parent instead of
``vfork``: measured here with torch imported in the parent, 16.8 ms per child for
``preexec_fn`` against 20 ms for the trampoline's extra interpreter start, which runs in
the child, in parallel with the next fork (the parent's fork + exec stays at ~1 ms).
``setpriv --pdeathsig`` (util-linux, 2 ms) cannot make the parent check and is not on
every image.

Not Linux (no ``PR_SET_PDEATHSIG``): :func:`spawn` is a plain ``Popen``; children of a
process that is SIGKILLed keep running there (macOS and the BSDs have no parent-death
signal; a child would have to watch its parent itself). Only a clean exit of the parent
stops them.

The kernel clears the setting when the program is set-user-ID, set-group-ID or has file
capabilities: such a program does not die with its parent.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

__all__ = ["PDEATHSIG_SUPPORTED", "Spawned", "spawn"]

PDEATHSIG_SUPPORTED = sys.platform == "linux"

_TRAMPOLINE = str(Path(__file__).with_name("trampoline.py"))

# What Popen takes for a standard stream: an fd, a file, PIPE/DEVNULL, or None (inherit).
Stream = int | IO[Any] | None

T = TypeVar("T")


@dataclass
class _Call(Generic[T]):
    fn: Callable[[], T]
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None


class _Spawner:
    """Runs every fork of this process on a thread that lives as long as the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[_Call[Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def start(self) -> queue.SimpleQueue[_Call[Any]]:
        """Make sure the thread runs in this process; returns its queue."""
        with self._lock:
            if self._pid != os.getpid():
                # A forked child inherits this object but not the thread.
                self._calls, self._thread, self._pid = queue.SimpleQueue(), None, os.getpid()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, args=(self._calls,), name="lifeline spawner", daemon=True
                )
                self._thread.start()
            return self._calls

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on such a thread; return its result or raise its exception."""
        if threading.current_thread() is threading.main_thread():
            return fn()  # no thread hop
        calls = self.start()
        call = _Call(fn)
        calls.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    @staticmethod
    def _serve(calls: queue.SimpleQueue[_Call[Any]]) -> None:
        # Children inherit the forking thread's signal mask; a thread inherits its
        # creator's. Whoever created this thread, the children start with none blocked.
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        while True:
            call = calls.get()
            try:
                call.result = call.fn()
            except BaseException as exc:  # handed to the caller, who raises it
                call.error = exc
            call.done.set()


_SPAWNER = _Spawner()
if PDEATHSIG_SUPPORTED:
    _SPAWNER.start()


@dataclass
class Spawned:
    """A started child. ``process`` is usable at once (pid, signals, ``wait``);
    :meth:`confirm` tells whether the program itself runs."""

    process: subprocess.Popen[bytes]
    argv: tuple[str, ...]
    _error_fd: int | None = field(default=None, repr=False)
    _fd_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def confirm(self) -> subprocess.Popen[bytes]:
        """Block until the program has replaced the trampoline (a few tens of ms).

        Returns:
            ``process``.

        Raises:
            OSError: the program could not be executed, as ``Popen`` raises it
                (``FileNotFoundError``, ``PermissionError``, ...); the trampoline has
                exited and is reaped.
        """
        with self._fd_lock:
            fd, self._error_fd = self._error_fd, None
        if fd is None:
            return self.process
        try:
            report = _read_all(fd)
        finally:
            os.close(fd)
        if not report:
            return self.process  # end of file: the exec closed the pipe
        self.process.wait()
        what, _, number = report.decode(errors="replace").partition(" ")
        errno = int(number) if number.isdigit() else 0
        if what == "prctl":
            raise OSError(
                errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}", self.argv[0]
            )
        raise OSError(errno, os.strerror(errno), self.argv[0])

    def abandon(self) -> None:
        """Forget a pending confirmation (the caller stops the process instead). Safe
        to call from another thread than :meth:`confirm`'s, and more than once."""
        with self._fd_lock:
            fd, self._error_fd = self._error_fd, None
        if fd is not None:
            os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 512):
        chunks.append(chunk)
    return b"".join(chunks)


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: Stream = subprocess.DEVNULL,
    stdout: Stream = None,
    stderr: Stream = None,
    start_new_session: bool = False,
    pass_fds: Sequence[int] = (),
    death_signal: int = signal.SIGKILL,
) -> Spawned:
    """Start ``argv`` as a child that gets ``death_signal`` when this process dies.

    Args:
        argv: the program (looked up on the ``PATH`` of ``env``, as ``Popen`` does) and
            its arguments.
        env: its environment (default: this process's).
        cwd, stdin, stdout, stderr, start_new_session, pass_fds: as for
            ``subprocess.Popen``; file objects passed may be closed by the caller once
            this returns.
        death_signal: the signal the child gets when this process ends, however it ends.

    Returns:
        The started child; call :meth:`Spawned.confirm` before relying on the program.

    Raises:
        OSError: the trampoline itself could not be started (``Popen``'s errors).
    """
    program = tuple(argv)
    if not program:
        raise ValueError("spawn: empty argv; give the program to run")
    if not PDEATHSIG_SUPPORTED or not sys.executable:
        plain = subprocess.Popen(
            program, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
            start_new_session=start_new_session, pass_fds=tuple(pass_fds),
        )  # fmt: skip
        return Spawned(plain, program)
    base = os.environ if env is None else env
    lc_ctype = "-" if "LC_CTYPE" not in base else "=" + base["LC_CTYPE"]
    read_fd, write_fd = os.pipe()
    parent = str(os.getpid())
    wrapped = [
        sys.executable, "-S", "-I", _TRAMPOLINE,
        parent, str(write_fd), str(int(death_signal)), lc_ctype, *program,
    ]  # fmt: skip

    def start() -> subprocess.Popen[bytes]:
        try:
            return subprocess.Popen(
                wrapped, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                start_new_session=start_new_session, pass_fds=(write_fd, *pass_fds),
            )  # fmt: skip
        finally:
            # Closed here, on the forking thread, before any other fork can copy it.
            os.close(write_fd)

    try:
        process = _SPAWNER.run(start)
    except BaseException:
        os.close(read_fd)
        raise
    return Spawned(process, program, read_fd)
