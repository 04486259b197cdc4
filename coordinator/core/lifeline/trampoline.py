"""The first program a lifeline child runs: arm the parent-death signal, then become the
real program.

Run as ``python -S -I trampoline.py PARENT_PID ERROR_FD SIGNAL LC_CTYPE PROGRAM ARG...``
(never imported): it asks the kernel to send ``SIGNAL`` to this process when the thread
that forked it dies (``prctl(PR_SET_PDEATHSIG)``, which survives ``execve``), and then
replaces itself with ``PROGRAM`` through ``execvp``, so the program keeps this pid, its
session and every descriptor the parent set up.

- ``PARENT_PID``: the parent's pid when it forked us. If the parent died between the fork
  and the ``prctl`` call, the signal will never come (we were re-parented already), so
  the program is not started and this process ends by ``SIGNAL`` itself, as if the
  signal had come.
- ``ERROR_FD``: the write end of a pipe. On a successful exec it closes (it is made
  close-on-exec here), so the parent reads end-of-file; on failure it carries
  ``exec <errno>`` or ``prctl <errno>`` and this process exits with 127.
- ``LC_CTYPE``: ``-`` if the variable was unset in the environment the parent gave, else
  ``=`` and its value. The interpreter's start-up may rewrite ``LC_CTYPE`` (PEP 538 locale
  coercion, not switched off by ``-I``); the program gets the environment as given.

Start-up cost is the point of this file: it runs in front of every worker. It imports
``_signal`` instead of ``signal`` (whose ``enum`` import doubled the run time, measured)
and nothing else beyond ``ctypes``; ``-S -I`` skips ``site`` and every ``PYTHON*``
variable, so the user's environment cannot slow it down or break it.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (no stubs: signal's C half)
import os
import sys
from ctypes import CDLL, get_errno

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_EXIT_FAILED = 127  # what a shell returns when it cannot run a command


def _fail(error_fd: int, what: bytes, errno: int) -> None:
    os.write(error_fd, b"%s %d" % (what, errno))
    os._exit(_EXIT_FAILED)


def main(argv: list[str]) -> None:
    parent, error_fd, signum = int(argv[1]), int(argv[2]), int(argv[3])
    lc_ctype, program = argv[4], argv[5:]
    if CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        _fail(error_fd, b"prctl", get_errno())
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)
    # Python ignores SIGPIPE and SIGXFSZ at start-up and an ignored signal stays ignored
    # across exec; subprocess resets both for its children, and so do we.
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)
    env = dict(os.environb)
    if lc_ctype == "-":
        env.pop(b"LC_CTYPE", None)
    else:
        env[b"LC_CTYPE"] = os.fsencode(lc_ctype[1:])
    os.set_inheritable(error_fd, False)
    try:
        os.execvpe(program[0], program, env)
    except OSError as exc:
        _fail(error_fd, b"exec", exc.errno or 0)


if __name__ == "__main__":
    main(sys.argv)
