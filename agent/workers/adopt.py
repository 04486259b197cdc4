"""Children this process adopts instead of starting (Linux): the warm pool's forked
interpreters (:mod:`agent.workers.warm_process`).

A ready warm interpreter forks a copy of itself through a middle process that exits at
once; the kernel gives the orphaned copy to the nearest ancestor marked as a *child
subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``). :func:`adopting` marks this process for
just the time of one such fork, so the copy becomes this process's child, as a worker
started through the lifeline is: the same parent, reaped by ``waitpid``, signalled by
pid. Marked only for that moment, because while the mark is on, every orphan below this
process comes here too (a worker's leftover child, say) and would wait as a zombie for a
``waitpid`` nobody makes.

:class:`AdoptedProcess` is the ``subprocess.Popen`` of such a child: Popen's own
``wait``, ``poll`` and ``send_signal`` work on any child's pid; only the start is
skipped.
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import threading
from collections.abc import Iterator, Sequence

__all__ = ["AdoptedProcess", "adopting"]

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_PR_GET_CHILD_SUBREAPER = 37

_lock = threading.Lock()
_holders = 0
_was_marked: bool | None = None  # the mark this process had before the first hold


_libc: ctypes.CDLL | None = None


def _prctl(option: int, value: int | ctypes.c_int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # once: a fork is on a restart's path
    arg = ctypes.byref(value) if isinstance(value, ctypes.c_int) else value
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}) failed")


@contextlib.contextmanager
def adopting() -> Iterator[None]:
    """While inside, orphans below this process become its children (nested and
    thread-safe: the mark is on while any thread is inside; a mark this process had
    before stays).

    Raises:
        OSError: the kernel refused the mark (not Linux, or older than 3.4).
    """
    global _holders, _was_marked
    with _lock:
        if _holders == 0:
            if _was_marked is None:
                current = ctypes.c_int(0)
                _prctl(_PR_GET_CHILD_SUBREAPER, current)
                _was_marked = bool(current.value)
            if not _was_marked:
                _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and not _was_marked:
                _prctl(_PR_SET_CHILD_SUBREAPER, 0)


class AdoptedProcess(subprocess.Popen[bytes]):
    """A child of this process that it did not start (adopted): ``pid``, ``wait``,
    ``poll``, ``send_signal``, ``kill``, ``terminate`` and ``returncode`` as Popen's."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        # Popen.__init__ would start a process; these are the fields its waiting,
        # polling and signalling read.
        self.args = list(args)
        self.stdin = self.stdout = self.stderr = None
        self.pid = pid
        self.returncode = None
        self.encoding = self.errors = None
        self.text_mode = False
        self.universal_newlines = False
        self.pipesize = -1
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self._child_created = True
