"""One warm interpreter (:mod:`agent.workers.warm`'s pool keeps them): which commands and
environments it may take, how it says it is ready, when its import counts as stuck, and
how a worker is handed over to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.workers.adopt import AdoptedProcess, adopting
from coordinator.core.lifeline import Spawned, spawn

__all__ = [
    "LATE_KEYS",
    "ImportBounds",
    "NotForked",
    "WarmInterpreter",
    "WarmTarget",
    "counted",
    "cpu_ticks",
    "env_compatible",
    "fits",
    "ready_fit",
    "warm_target",
]

# torchrun's per-attempt variables (and ours): set for each attempt, read by the worker's
# code (init_process_group, the error handler), never while torch is imported.
LATE_KEYS = frozenset(
    {
        "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
        "ETCD_ELASTIC_ROUND",
    }
)  # fmt: skip
_PROGRAM = str(Path(__file__).with_name("warm_process.py"))
_HANDOVER_TIMEOUT = 5.0  # seconds for a ready process to confirm it took the request
_FORK_TIMEOUT = 10.0  # seconds for a ready process's forked copy to say it is ready


@dataclass(frozen=True)
class NotForked:
    """Why :meth:`WarmInterpreter.fork` gave no copy. ``source_at_fault``: the ready
    process did not answer as one does (stopped, hung, a wrong answer): drop it, another
    may fork. Otherwise (the subreaper mark refused, the copy failed) the next fork would
    fail alike."""

    reason: str
    source_at_fault: bool


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first).

    Raises:
        OSError: no such process.
    """
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a tracer): it would not answer a request."""
    try:
        return _stat(pid)[0] in ("T", "t")
    except OSError:
        return False


@dataclass(frozen=True)
class ImportBounds:
    """When an importing interpreter counts as stuck. An import that hangs (on a lock, a
    network file system, a stopped process) uses no CPU; one that is only slow, its
    cores shared with others, keeps getting some. So the rule is the interpreter's CPU
    time, read from ``/proc`` every ``check_s`` while it imports, not how long the import
    takes (that depends on the machine's load).

    Overdue (no CPU for ``overdue_idle_s``): another interpreter starts importing beside
    it, and no worker start waits for it (a start waits for an import only because it
    is ahead of a cold start). Given up (no CPU for ``kill_idle_s``, or importing for
    ``kill_s`` in all): killed, and counted as a death (three in a row turn warm starts
    off). On a machine so loaded that a runnable process gets no tick of CPU in
    ``overdue_idle_s`` the worst case is one extra import.
    """

    check_s: float = 1.0
    overdue_idle_s: float = 5.0
    kill_idle_s: float = 30.0
    kill_s: float = 300.0


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of process ``pid`` so far, in clock ticks.

    Raises:
        OSError: no such process.
    """
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12])  # utime and stime (fields 14 and 15)


@dataclass(frozen=True)
class WarmTarget:
    """What a cold ``python -u`` would run: ``mode`` is script, module or code."""

    python: str
    mode: str
    target: str
    args: tuple[str, ...]


def warm_target(argv: Sequence[str]) -> WarmTarget | None:
    """The warm form of a worker's command line, or None if only a cold start will do
    (not ``<python> -u ...``: ``--no-python``, or an interpreter with other flags)."""
    if len(argv) < 3 or argv[1] != "-u" or not Path(argv[0]).name.startswith("python"):
        return None
    python, first, rest = argv[0], argv[2], tuple(argv[3:])
    if first in ("-m", "-c"):
        if not rest:
            return None
        return WarmTarget(python, "module" if first == "-m" else "code", rest[0], rest[1:])
    if first.startswith("-"):
        return None  # another interpreter flag: a cold start keeps its meaning
    return WarmTarget(python, "script", first, rest)


def env_compatible(started_with: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    """Whether a process started with ``started_with`` may become a worker whose
    environment is ``wanted``: equal but for :data:`LATE_KEYS`."""
    keys = (started_with.keys() | wanted.keys()) - LATE_KEYS
    return all(started_with.get(k) == wanted.get(k) for k in keys)


class WarmInterpreter:
    """One started warm process and this end of its control socket."""

    def __init__(self, spawned: Spawned, sock: socket.socket, python: str, env: dict[str, str]):
        self.spawned = spawned
        self.sock = sock
        self.python = python
        self.env = env
        self.ready = threading.Event()
        self.failed: str | None = None
        self.reported = False  # the program said why it failed (deterministic: an import)
        self.started = time.monotonic()
        self.overdue = False  # importing for longer than it should (see ImportBounds)
        self.stuck = False  # given up: killed while still importing
        self.forked = False  # a copy of a ready process (it never imported)
        self._talk = threading.Lock()  # one request at a time on the control socket

    @classmethod
    def start(cls, python: str, env: dict[str, str], modules: str) -> WarmInterpreter:
        """Start ``python`` on :mod:`agent.workers.warm_process` with ``env``, to import
        ``modules`` (comma-separated), through the lifeline, in a session of its own.

        Raises:
            OSError: it could not be started.
        """
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            spawned = spawn(
                [python, "-u", _PROGRAM, str(theirs.fileno()), modules], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        except OSError:
            mine.close()
            raise
        finally:
            theirs.close()
        return cls(spawned, mine, python, env)

    def wait_ready(self, bounds: ImportBounds, on_overdue: Callable[[], None]) -> None:
        """Block until the process reports (run on the pool's starter thread). An import
        that uses no CPU for ``bounds.overdue_idle_s`` is marked overdue (then
        ``on_overdue``); one given up (see :class:`ImportBounds`) is failed without a
        report, for the caller to kill."""
        try:
            self.spawned.confirm()
            report = self._report(bounds, on_overdue)
        except OSError as exc:
            report = f"failed {exc}".encode()
        if report is None:
            self.stuck = True
        else:
            text = report.decode(errors="replace")
            if text != "ready":
                self.reported = text.startswith("failed ")
                self.failed = text.removeprefix("failed ").strip() or "it exited while starting"
        self.ready.set()

    def _report(self, bounds: ImportBounds, on_overdue: Callable[[], None]) -> bytes | None:
        """What the process sent, or None once it is given up (``failed`` says why)."""
        pid = self.spawned.process.pid
        ticks, moved = -1, time.monotonic()
        while True:
            left = self.started + bounds.kill_s - time.monotonic()
            self.sock.settimeout(max(1e-3, min(bounds.check_s, left)))
            try:
                return self.sock.recv(4096)
            except TimeoutError:
                pass
            now = time.monotonic()
            try:
                seen = cpu_ticks(pid)
            except OSError:
                continue  # it exited: the socket says so next
            if seen != ticks:
                ticks, moved = seen, now
            idle = now - moved
            if not self.overdue and idle >= bounds.overdue_idle_s:
                self.overdue = True
                on_overdue()
            if idle >= bounds.kill_idle_s:
                self.failed = f"its import used no CPU for {idle:.0f} s"
                return None
            if now - self.started >= bounds.kill_s:
                self.failed = f"it did not finish importing within {bounds.kill_s:.0f} s"
                return None

    def hand_over(
        self, target: WarmTarget, argv: Sequence[str], env: Mapping[str, str], cwd: str,
        streams: tuple[int, int, int],
    ) -> str | None:  # fmt: skip
        """Ask the process to become the worker ``argv`` (``target``) with ``env`` in
        ``cwd`` on ``streams`` (descriptors the caller still closes). None once it
        confirmed; else why not (then it is of no use: discard it)."""
        with self._talk:
            return self._hand_over(target, argv, env, cwd, streams)

    def _hand_over(
        self, target: WarmTarget, argv: Sequence[str], env: Mapping[str, str], cwd: str,
        streams: tuple[int, int, int],
    ) -> str | None:  # fmt: skip
        request = {
            "mode": target.mode,
            "target": target.target,
            "args": list(target.args),
            "env": dict(env),
            "cwd": cwd,
            "argv": list(argv),
        }
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], list(streams))
            self.sock.settimeout(_HANDOVER_TIMEOUT)
            answer = self.sock.recv(64)
        except OSError as exc:
            answer = f"error {exc}".encode()
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()
        if answer == b"started":
            return None
        return answer.decode(errors="replace") or "it exited"

    def fork(self) -> WarmInterpreter | NotForked:
        """A ready copy of this ready process, adopted by this one as its child (see
        :mod:`agent.workers.adopt`): milliseconds, where a new interpreter imports for
        seconds. Else why not (this process died or is stopped, or the copy did not
        come). A stopped process is not asked: it would hold the caller for the timeout."""
        if _stopped(self.spawned.process.pid):
            return NotForked("it is stopped (SIGSTOP?) and would not answer", True)
        with self._talk, contextlib.ExitStack() as window:
            try:
                window.enter_context(adopting())
            except OSError as exc:
                return NotForked(f"{type(exc).__name__}: {exc}", False)
            try:
                self.sock.settimeout(_FORK_TIMEOUT)
                self.sock.send(b'{"fork": 1}')
                answer, fds, _, _ = socket.recv_fds(self.sock, 64, 1)
            except OSError as exc:
                return NotForked(f"{type(exc).__name__}: {exc}", True)
            what, _, number = answer.decode(errors="replace").partition(" ")
            if what != "forked" or not number.isdigit() or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                return NotForked(f"it answered {answer!r}" if answer else "it exited", True)
            process = AdoptedProcess(int(number), self.spawned.argv)
            copy = socket.socket(fileno=fds[0])
            try:
                copy.settimeout(_FORK_TIMEOUT)
                report = copy.recv(64)
            except OSError as exc:
                report = f"{type(exc).__name__}: {exc}".encode()
        if report != f"ready {process.pid}".encode():
            copy.close()
            _kill_and_reap(process)
            return NotForked(f"the copy said {report!r}" if report else "the copy exited", False)
        sibling = WarmInterpreter(Spawned(process, self.spawned.argv), copy, self.python, self.env)
        sibling.forked = True
        sibling.ready.set()
        return sibling

    def discard(self) -> None:
        """Stop and reap an unused process."""
        with contextlib.suppress(OSError):
            self.sock.close()
        _kill_and_reap(self.spawned.process)


def _kill_and_reap(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the session ``process`` leads, and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(process.pid, signal.SIGKILL)  # a copy that died before leading one
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def counted(slot: Sequence[WarmInterpreter]) -> list[WarmInterpreter]:
    """The processes of a slot that count towards its depth: all but overdue imports."""
    return [w for w in slot if w.ready.is_set() or not w.overdue]


def fits(warm: WarmInterpreter, target: WarmTarget, env: Mapping[str, str]) -> bool:
    """Whether ``warm`` may become a worker running ``target`` with ``env``."""
    return warm.failed is None and warm.python == target.python and env_compatible(warm.env, env)


def ready_fit(warm: WarmInterpreter, target: WarmTarget, env: Mapping[str, str]) -> bool:
    """Whether ``warm`` is ready and fit for ``target``/``env``: one to hand a worker
    over to, or to fork (one that died meanwhile fails either, and is dropped)."""
    return fits(warm, target, env) and warm.ready.is_set()
