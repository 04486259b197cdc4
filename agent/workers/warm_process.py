"""A started interpreter that waits, with torch imported, to become a worker.

Run by :mod:`agent.workers.warm` as ``python -u warm_process.py CONTROL_FD MODULES`` (never
imported: it must not put any module of ours into the worker's ``sys.modules``, where a
user's own ``agent`` package would find it). ``CONTROL_FD`` is this end of a
``SOCK_SEQPACKET`` socket pair; ``MODULES`` is a comma-separated list to import ahead.

1. Preload: our own folder is taken off ``sys.path`` (a worker never has it), standard
   output and error go to private temporary files, and the modules are imported. Then
   ``ready`` is sent (or ``failed <why>``, and the process exits 3).
2. Wait for one request: JSON ``{"mode", "target", "args", "env", "cwd", "argv"}`` with
   three descriptors (the worker's stdin, stdout and stderr). End of file means the pool
   was closed: exit 0 quietly. A request ``{"fork": 1}`` instead forks a *sibling*: a
   copy of this process, imports and all, in milliseconds instead of seconds of CPU
   (:func:`_fork_sibling`). The pool refills this way whenever a ready process is left.
   This process answers ``forked <pid>`` with the sibling's end of a new control socket
   and goes on waiting; the sibling says ``ready <pid>`` on that socket and waits as
   this one does.
3. Become the worker, as ``python -u`` would have started it: the descriptors go on 0, 1
   and 2 (what the preload printed is written there first), the directory and the whole
   environment are those of the request, ``sys.argv``, ``sys.path[0]`` and a fresh
   ``__main__`` module are set as the interpreter sets them for a script (``mode``
   "script"), a module (``-m``, through ``runpy._run_module_as_main`` as the interpreter
   itself does) or code (``-c``). ``started`` is sent and the socket closed before any
   line of the user's code runs.

What stays from the preload, and why that is the same as a cold start: the interpreter's
flags (``-u`` on both), variables read only at interpreter or library start-up (the
pool hands a process only to a worker whose environment equals the one it was started
with, except torchrun's per-attempt variables, which nothing reads at import), and the
imported modules themselves. Nothing here touches CUDA: importing torch does not
initialise it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

_EXIT_PRELOAD_FAILED = 3
_EXIT_NO_FILE = 2  # what ``python missing.py`` returns
_EXIT_NOT_ADOPTED = 4  # a sibling whose agent did not adopt it
_MAX_REQUEST = 4 << 20
_ADOPTION_S = 10.0  # how long a sibling waits to become the agent's child
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _capture(fd: int) -> int:
    """Point ``fd`` at a new temporary file; return a descriptor to read it back."""
    import tempfile

    with tempfile.TemporaryFile() as spool:
        os.dup2(spool.fileno(), fd)
        return os.dup(spool.fileno())


def _replay(spool: int, fd: int) -> None:
    # pread: siblings forked from one process share the spool's file offset.
    offset = 0
    while chunk := os.pread(spool, 1 << 16, offset):
        os.write(fd, chunk)
        offset += len(chunk)
    os.close(spool)


def _preload(modules: list[str]) -> str | None:
    """Import ``modules``; the error, in one line, if one fails."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a module's import may raise anything, or exit
            return f"import {name}: {type(exc).__name__}: {exc}"
    return None


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    message, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 3)
    if not message:
        return None
    return json.loads(message), fds


def _become(
    request: dict[str, Any], fds: list[int], spools: list[int], coerced: str | None
) -> None:
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    _replay(spools[0], 1)
    _replay(spools[1], 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if coerced is not None and "LC_CTYPE" not in os.environ:
        # The interpreter's start-up set it (PEP 538 locale coercion), as a cold one's
        # would for the same environment.
        os.environ["LC_CTYPE"] = coerced
    sys.orig_argv = list(request["argv"])


def _strip_own_frames(tb: Any) -> Any:
    here = os.path.abspath(__file__)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == here:
        tb = tb.tb_next
    return tb


def _run(mode: str, target: str, args: list[str]) -> None:
    """Run the worker's code in a fresh ``__main__``, as the interpreter would."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    if "__mp_main__" in sys.modules:
        # multiprocessing, imported with torch, aliased the main module of that time
        # (this program); a spawned child must find the worker's classes there.
        sys.modules["__mp_main__"] = main
    if mode == "module":
        import runpy

        sys.argv = ["-m", *args]  # runpy puts the module's file in argv[0]
        sys.path.insert(0, os.getcwd())
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        return
    if mode == "code":
        from importlib.machinery import BuiltinImporter

        sys.argv = ["-c", *args]
        sys.path.insert(0, "")
        main.__dict__.update(__loader__=BuiltinImporter)
        exec(compile(target, "<string>", "exec", dont_inherit=True), main.__dict__)
        return
    from importlib.machinery import SourceFileLoader

    # Absolute as the interpreter makes it: joined to the directory, not normalised.
    path = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
    sys.argv = [target, *args]
    sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
    try:
        with open(path, "rb") as source_file:
            source = source_file.read()
    except OSError as exc:
        print(
            f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
            file=sys.stderr,
        )
        raise SystemExit(_EXIT_NO_FILE) from None
    main.__dict__.update(
        __file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path)
    )
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def main() -> int:
    coerced = os.environ.get("LC_CTYPE")  # before anything: what start-up left
    control_fd, modules = int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m]
    del sys.path[0]  # this file's folder: a worker's sys.path never has it
    spools = [_capture(1), _capture(2)]
    sock = socket.socket(fileno=control_fd)
    failed = _preload(modules)
    if failed is not None:
        sock.sendall(f"failed {' '.join(failed.split())[:500]}".encode())
        return _EXIT_PRELOAD_FAILED
    sock.sendall(b"ready")
    while True:
        received = _receive(sock)
        if received is None:
            return 0  # the pool was closed
        request, fds = received
        if not request.get("fork"):
            break
        sibling = _fork_sibling(sock)
        if sibling is not None:  # this is the sibling now
            sock = sibling
            sock.sendall(f"ready {os.getpid()}".encode())
    _become(request, fds, spools, coerced)
    sock.sendall(b"started")
    sock.close()
    try:
        _run(request["mode"], request["target"], list(request["args"]))
    except SystemExit:
        raise  # the interpreter ends on it exactly as for a cold start
    except BaseException as exc:
        exc = exc.with_traceback(_strip_own_frames(exc.__traceback__))
        sys.excepthook(type(exc), exc, exc.__traceback__)
        if isinstance(exc, KeyboardInterrupt):
            _exit_by_sigint()
        return 1
    return 0


def _fork_sibling(sock: socket.socket) -> socket.socket | None:
    """Fork a copy of this waiting process that the agent adopts as its own child, as if
    the agent had started it: the copy's parent is the agent, it dies with the agent
    (parent-death signal), it leads a session of its own, and numpy's BLAS threads,
    which a fork leaves behind, run again. In this process: answer ``forked <pid>`` and
    return None. In the copy: return its end of the new control socket.

    How the agent becomes the parent: a middle process forks the copy and exits at once;
    the kernel hands the orphan to the nearest ancestor marked as a child subreaper,
    which the agent is while it asks for a fork (``agent.workers.adopt``)."""
    import warnings

    agent = os.getppid()
    threads = len(os.listdir("/proc/self/task"))
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_pid, write_pid = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with BLAS threads
        middle = os.fork()
        if middle == 0:
            middle = os.getpid()  # the copy's parent until this process exits
            copy = os.fork()
            if copy != 0:
                os.write(write_pid, str(copy).encode())
                os._exit(0)
            for end in (sock, mine):
                end.close()
            for fd in (read_pid, write_pid):
                os.close(fd)
            _adopted(agent, middle, threads)
            return theirs
    theirs.close()
    os.close(write_pid)
    os.waitpid(middle, 0)
    _restart_blas_threads(threads)
    copy_pid = os.read(read_pid, 32).decode()
    os.close(read_pid)
    try:
        socket.send_fds(sock, [f"forked {copy_pid}".encode()], [mine.fileno()])
    finally:
        mine.close()
    return None


def _adopted(agent: int, middle: int, threads: int) -> None:
    """In a forked copy: wait to be the agent's child (``middle`` is the parent until
    then), then arm the parent-death signal and lead a session, as a started worker
    does; restart numpy's BLAS threads."""
    deadline = time.monotonic() + _ADOPTION_S
    while (parent := os.getppid()) != agent:  # the middle process is exiting
        if parent != middle or time.monotonic() > deadline:
            os._exit(_EXIT_NOT_ADOPTED)  # given to another: the agent is gone
        time.sleep(0.001)
    import ctypes
    import signal

    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(_EXIT_NOT_ADOPTED)
    if os.getppid() != agent:  # the agent died before the signal was armed
        os._exit(_EXIT_NOT_ADOPTED)
    os.setsid()
    _restart_blas_threads(threads)


def _restart_blas_threads(threads: int) -> None:
    """OpenBLAS starts its thread pool when numpy loads it, and stops it before a fork
    (in the process that forks, too); only the forking thread survives a fork anyway.
    One threaded product starts the pool again, so both processes run the threads a
    started interpreter runs (``threads`` of them before the fork)."""
    if threads > len(os.listdir("/proc/self/task")) and "numpy" in sys.modules:
        square = sys.modules["numpy"].ones((256, 256))
        square @ square


def _exit_by_sigint() -> None:
    """End as the interpreter ends on an uncaught KeyboardInterrupt: finalise (atexit,
    flushed streams), then die of SIGINT so that the parent sees the signal."""
    import atexit
    import contextlib
    import signal

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
