"""Remove directories after this process ends, even when it is SIGKILLed.

A process that is SIGKILLed runs no clean-up, so something else has to: a **janitor**, a
small helper process that outlives its parent just long enough. The parent holds the
write end of a pipe that is the janitor's stdin; it writes one line per child process
whose files live in those directories (``pid starttime``: the start time makes the pid
unambiguous even after the pid is reused). The pipe reaches end-of-file when the parent
closes it (:meth:`Janitor.close`) or dies (the kernel closes it; nothing else holds it,
as it is close-on-exec and every child is started with ``close_fds``). Then the janitor
SIGKILLs every watched process that still runs, waits until each is gone (so no write
lands in a directory after its removal), removes the directories and exits.

The janitor runs in its own session (a Ctrl-C on the terminal is not for it) and ignores
SIGINT and SIGTERM: its one job is to act after everything around it was killed, and it
ends on its own a moment after its parent. It is not started with a parent-death signal,
for the same reason. Only SIGKILLing the janitor itself, or the machine going down,
leaves the directories behind.

Linux only (it reads ``/proc``); elsewhere :meth:`Janitor.start` does nothing and a
SIGKILLed parent leaves the directories behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

__all__ = ["JANITOR_SUPPORTED", "Janitor"]

log = logging.getLogger(__name__)

JANITOR_SUPPORTED = sys.platform == "linux"

# How long the janitor waits for SIGKILLed processes to go (one stuck in uninterruptible
# sleep ignores SIGKILL until the kernel lets go) before removing the directories anyway.
_GONE_WITHIN_S = 30.0
# The janitor polls /proc while waiting: it has nothing else to do and runs once.
_POLL_S = 0.02


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid``, None if no such."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it. The
    # state is field 3, the start time field 22.
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def _running(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a zombie has
    closed its files: it counts as gone)."""
    stat = _stat(pid)
    return stat is not None and stat[1] == start and stat[0] != "Z"


def _kill(pid: int, start: int) -> None:
    pidfd: int | None = None
    with contextlib.suppress(OSError):  # gone already, or a kernel before 5.3
        pidfd = os.pidfd_open(pid)
    try:
        # With the pidfd opened first, a matching start time proves the pidfd names our
        # process, and the signal cannot reach a newcomer that reused the pid.
        if not _running(pid, start):
            return
        with contextlib.suppress(ProcessLookupError):
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _clean(watched: list[tuple[int, int]], paths: Sequence[str]) -> int:
    for pid, start in watched:
        _kill(pid, start)
    deadline = time.monotonic() + _GONE_WITHIN_S
    while any(_running(pid, start) for pid, start in watched):
        if time.monotonic() > deadline:
            left = [pid for pid, start in watched if _running(pid, start)]
            print(f"janitor: pids {left} still run {_GONE_WITHIN_S:.0f} s after SIGKILL; "
                  "removing their directories anyway", file=sys.stderr)  # fmt: skip
            break
        time.sleep(_POLL_S)
    code = 0
    for path in paths:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass  # the parent removed it itself
        except OSError as exc:
            print(f"janitor: cannot remove {path}: {exc}", file=sys.stderr)
            code = 1
    return code


def main(argv: Sequence[str]) -> int:
    """The janitor process: ``python -S -I janitor.py PATH...``, watched pids on stdin."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    watched: list[tuple[int, int]] = []
    for line in sys.stdin.buffer:  # until the parent closes the pipe or dies
        with contextlib.suppress(ValueError):  # a torn last line of a dying parent
            pid, start = line.split()
            watched.append((int(pid), int(start)))
    return _clean(watched, argv[1:])


class Janitor:
    """Parent side: start the janitor for ``paths``, tell it the children to wait for,
    close it. :meth:`close` is idempotent; the janitor is always reaped."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = [Path(p) for p in paths]
        self._process: subprocess.Popen[bytes] | None = None
        self._pipe: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The janitor's pid while it runs under us (None when not started)."""
        return None if self._process is None else self._process.pid

    def start(self) -> bool:
        """Start the janitor; False (and a warning) if it could not be started, or where
        it is not supported (no warning)."""
        if not JANITOR_SUPPORTED or not sys.executable:
            return False
        if self._process is not None:
            return True
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-S", "-I", __file__, *map(str, self.paths)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                cwd="/",  # do not pin the parent's working directory (an unmount, a removal)
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("no janitor (%s): %s will stay behind if this process is killed",
                        exc, ", ".join(map(str, self.paths)))  # fmt: skip
            return False
        self._pipe = self._process.stdin
        return True

    def watch(self, process: subprocess.Popen[bytes]) -> None:
        """Have the janitor SIGKILL ``process`` and wait for it to end before removing
        the directories. Call right after starting it, before anything reaps it."""
        stat = _stat(process.pid)
        if self._pipe is None or stat is None:
            return
        try:
            self._pipe.write(b"%d %d\n" % (process.pid, stat[1]))
            self._pipe.flush()
        except OSError as exc:
            log.warning(
                "janitor pid %s is gone (%s): %s will stay behind if this process is killed",
                self.pid, exc, ", ".join(map(str, self.paths)),
            )  # fmt: skip
            self._pipe = None

    def close(self, timeout: float = 30.0) -> None:
        """Let the janitor finish now (it removes the paths if they are still there) and
        reap it."""
        process, self._process = self._process, None
        pipe, self._pipe = self._pipe, None
        if process is None:
            return
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("janitor pid %d still runs %.0f s after its pipe closed; killing it",
                        process.pid, timeout)  # fmt: skip
            process.kill()
            code = process.wait()
        if code != 0:
            log.warning("janitor pid %d exited with code %d", process.pid, code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
