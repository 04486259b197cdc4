"""How one worker process is started: cold (a new interpreter through the lifeline) or
warm (handed to a ready interpreter of :mod:`agent.workers.warm`), with its standard streams as
the attempt's log plan says. Both return the process and where its piped output is read.
A group's warm interpreters are claimed together (:func:`warm_claims`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from agent.workers.logs import StreamPlan
from agent.workers.warm import WarmPool, hand_over
from agent.workers.warm_interpreter import WarmInterpreter
from coordinator.core.lifeline import Spawned, spawn

if TYPE_CHECKING:
    from agent.workers.launch import WorkerLaunch

__all__ = ["Sources", "start_cold", "start_warm", "warm_claims"]

# Where a started worker's piped stdout and stderr are read (None: not piped).
Sources = tuple[IO[bytes] | None, IO[bytes] | None]


def _devnull(after: contextlib.ExitStack) -> int:
    fd = os.open(os.devnull, os.O_RDWR)
    after.callback(os.close, fd)
    return fd


def _stream_fd(
    plan: StreamPlan, inherited: int, after: contextlib.ExitStack
) -> tuple[int, IO[bytes] | None]:
    """The descriptor a warm worker gets for one stream (closed here by ``after``), and
    the pipe's reading end when the stream is piped: what ``_open_stream`` gives Popen."""
    if plan.piped:
        read_fd, write_fd = os.pipe()
        after.callback(os.close, write_fd)
        return write_fd, os.fdopen(read_fd, "rb")
    if plan.file is not None:
        fd = os.open(plan.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        after.callback(os.close, fd)
        return fd, None
    return (inherited, None) if plan.console else (_devnull(after), None)


def _open_stream(plan: StreamPlan) -> int | IO[Any] | None:
    if plan.piped:
        return subprocess.PIPE
    if plan.file is not None:
        return open(plan.file, "ab")
    return None if plan.console else subprocess.DEVNULL


def start_cold(launch: WorkerLaunch) -> tuple[Spawned, Sources]:
    """Start ``launch`` in a new interpreter (or program)."""
    out = _open_stream(launch.logs.stdout)
    err = _open_stream(launch.logs.stderr)
    try:
        spawned = spawn(
            launch.argv,
            env=dict(launch.env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    finally:
        for stream in (out, err):
            if hasattr(stream, "close"):
                stream.close()  # type: ignore[union-attr]
    proc = spawned.process
    return spawned, (proc.stdout, proc.stderr)


@contextlib.contextmanager
def warm_claims(
    pool: WarmPool | None, launches: Sequence[WorkerLaunch], interrupted: threading.Event | None
) -> Iterator[dict[int, WarmInterpreter]]:
    """The interpreters ``pool`` gives the group ``launches`` (:meth:`WarmPool.claim`),
    by local rank; the caller pops each it hands over, and those left (a start failed
    half way) are discarded on the way out."""
    claimed = (
        pool.claim({ln.ranks.local_rank: (ln.argv, ln.env) for ln in launches}, interrupted)
        if pool is not None
        else {}
    )
    try:
        yield claimed
    finally:
        for warm in claimed.values():
            warm.discard()


def start_warm(warm: WarmInterpreter, launch: WorkerLaunch) -> tuple[Spawned, Sources] | None:
    """Start ``launch`` from ``warm``, the interpreter claimed for its local rank; None:
    it refused (start it cold)."""
    with contextlib.ExitStack() as after:
        fds: list[int] = [_devnull(after)]
        readers: list[IO[bytes] | None] = []
        for plan, inherited in ((launch.logs.stdout, 1), (launch.logs.stderr, 2)):
            fd, reader = _stream_fd(plan, inherited, after)
            fds.append(fd)
            readers.append(reader)
        spawned = hand_over(
            launch.ranks.local_rank, warm, launch.argv, launch.env, os.getcwd(),
            (fds[0], fds[1], fds[2]),
        )  # fmt: skip
        if spawned is None:
            for reader in readers:
                if reader is not None:
                    reader.close()
            return None
    return spawned, (readers[0], readers[1])
