"""Hang detection on one node: read the workers' progress, publish it, declare a hang.

The agent owns one :class:`HangWatch`. Its thread (``hang-watch``) reads the progress
file the workers write (:mod:`etcd_elastic.progress`) every
:func:`~agent.health.hang_rules.tick_seconds`,
notes on its own monotonic clock when each worker's step changed,
publishes the node's progress to etcd when it changed (at most once per
``publish_interval``) and, with ``--hang-timeout``, declares a hang when the node's
workers made no progress for that long: it reads every node's progress once, names the
node(s) that stopped first (:func:`coordinator.core.progress.who_stopped_first`) and
records the hang in the state with one compare-and-swap (at most one per round). Every
agent, this one included, learns of it from its watched state
(:attr:`EtcdRendezvousHandler.declared_hang`) and restarts its workers as a counted
restart (:meth:`HangWatch.declared`, asked by the agent's loop).

No clock of another machine is read: each node measures its own workers' silence on its
own monotonic clock, and the first node to reach the timeout declares. With a handler
that is not ours (no progress board), the hang is this node's alone: it restarts its
workers counted, and the others follow through their own rendezvous.

The loop never waits on this thread: publishing and declaring are RPCs, done here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent.health.hang_rules import (
    LocalProgress,
    Published,
    Seen,
    fold,
    hang_line,
    publish_due,
    tick_seconds,
    track,
)
from agent.workers.group import WorkerGroup
from agent.workers.state import WorkerState
from coordinator.core.errors import EtcdElasticError
from coordinator.core.hang_board import ProgressBoard
from coordinator.core.progress import NodeProgress, who_stopped_first
from coordinator.core.state import Hang
from coordinator.core.threads import ThreadDied, start_guarded
from coordinator.torch_adapter.surface import RendezvousSurface
from etcd_elastic.progress import PROGRESS_FILE_ENV, ProgressFile

__all__ = ["HangWatch", "HangWatchDied", "running_ranks"]

log = logging.getLogger(__name__)

# How long a declaration retries while the state keeps changing.
_DECLARE_TIMEOUT_S = 10.0


def running_ranks(group: WorkerGroup | None) -> frozenset[int]:
    """The local ranks of ``group`` whose workers run now (none unless it is HEALTHY):
    a worker that exited, or a group being stopped, is never judged."""
    if group is None or group.state() is not WorkerState.HEALTHY:
        return frozenset()
    exited = group.exits()
    return frozenset(
        ln.ranks.local_rank for ln in group.launches if ln.ranks.local_rank not in exited
    )


class HangWatchDied(RuntimeError):
    """The ``hang-watch`` thread died: the agent stops with this error (no silent death)."""


class HangWatch:
    """Progress publishing and hang detection of one node.

    Args:
        hang_timeout: ``--hang-timeout`` seconds, or None (off: progress is still
            published, nothing is ever declared).
        slots: local workers.
        rdzv: the rendezvous surface (ours has a progress board and declared hangs).
        running: the local ranks whose workers run now (empty: none to judge).
        wake: wakes the agent's loop (a hang was declared).
        on_hang: told of every hang this node declares (a hook for the run's events).
        on_step: told of the node's lowest step at each reading (the metrics' gauge).
        publish_interval: seconds between two writes of a changing step.
        clock_ns: monotonic ns (the workers' clock: ``time.monotonic_ns``).
        wall_ms: wall-clock ms, informational only.
    """

    def __init__(
        self,
        hang_timeout: float | None,
        slots: int,
        rdzv: RendezvousSurface,
        running: Callable[[], frozenset[int]],
        wake: Callable[[], None],
        *,
        on_hang: Callable[[Hang], None] | None = None,
        on_step: Callable[[int], None] = lambda _step: None,
        publish_interval: float = 1.0,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self._timeout_ns = None if hang_timeout is None else int(hang_timeout * 1e9)
        self._tick = tick_seconds(hang_timeout)
        self._file = ProgressFile(slots)
        self._rdzv = rdzv
        self._running = running
        self._wake = wake
        self._on_hang = on_hang
        self._on_step = on_step
        self._interval = publish_interval
        self._clock_ns = clock_ns
        self._wall_ms = wall_ms
        self._node = rdzv.node_id
        self._lock = threading.Lock()  # leaf: guards the four fields below
        self._round: int | None = None  # the round being judged; None: workers stopped
        self._published: Published | None = None
        self._declared_round: int | None = None
        self._local_hang: Hang | None = None  # a handler without a board: ours alone
        self._seen: list[Seen | None] = []  # the thread's own: per local rank
        self._fresh = False  # begin() was called: forget what the thread saw
        self._died: ThreadDied | None = None
        self._warned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def env(self) -> dict[str, str]:
        """What every worker gets in its environment (constant for the agent's life, so
        warm interpreters started ahead match it)."""
        return {PROGRESS_FILE_ENV: self._file.path}

    def begin(self, round: int) -> None:
        """A new attempt's workers are about to start in ``round``: forget the last
        attempt's progress and judge this one."""
        self._file.reset()
        with self._lock:
            self._round, self._published, self._local_hang = round, None, None
            self._fresh = True
        if self._thread is None:
            self._thread = start_guarded("hang-watch", self._run, self._died_with)

    def pause(self) -> None:
        """The workers are being stopped: judge nothing until the next :meth:`begin`."""
        with self._lock:
            self._round = None

    def declared(self) -> Hang | None:
        """The hang declared in this node's current round (by any node), or None.

        Raises:
            HangWatchDied: the thread died; hang detection no longer works.
        """
        if self._died is not None:
            raise HangWatchDied(f"hang detection stopped: {self._died}") from self._died
        with self._lock:
            local = self._local_hang
        if local is not None:
            return local
        return self._rdzv.declared_hang

    def close(self) -> None:
        """Stop the thread and remove the progress file. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._file.close()

    # -- the thread ----------------------------------------------------------------

    def _died_with(self, died: ThreadDied) -> None:
        self._died = died
        self._wake()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            with self._lock:
                round, fresh, self._fresh = self._round, self._fresh, False
            if fresh:
                self._seen = []
            if round is None:
                continue
            self._seen = track(self._seen, self._file.read(), self._clock_ns())
            local = fold(self._seen, self._running())
            if local is None:
                continue
            self._on_step(local.step)
            try:
                self._observe(round, local)
            except EtcdElasticError as exc:
                # etcd unreachable or refusing: training goes on; say it once.
                if not self._warned:
                    log.warning(
                        "node %s: progress or hang not written to etcd: %s", self._node, exc
                    )
                    self._warned = True

    def _observe(self, round: int, local: LocalProgress) -> None:
        silent_ns = self._clock_ns() - local.last_ns
        stalled = self._timeout_ns is not None and silent_ns >= self._timeout_ns
        now = self._clock_ns() / 1e9
        board = self._board()
        with self._lock:
            last = self._published
        due = board is not None and publish_due(last, local.step, stalled, now, self._interval)
        if due and board is not None and board.publish(self._record(round, local, silent_ns)):
            with self._lock:
                self._published = Published(local.step, stalled, now)
            self._warned = False
        with self._lock:
            declare = stalled and self._declared_round != round and self._round == round
            if declare:
                self._declared_round = round
        if declare:
            self._declare(board, round, local, silent_ns)

    def _board(self) -> ProgressBoard | None:
        return self._rdzv.progress_board()

    def _record(self, round: int, local: LocalProgress, silent_ns: int) -> NodeProgress:
        stalled = self._timeout_ns is not None and silent_ns >= self._timeout_ns
        age_ms = silent_ns // 1_000_000
        return NodeProgress(
            node_id=self._node,
            round=round,
            step=local.step,
            age_ms=age_ms,
            reported_at_unix_ms=self._wall_ms() - age_ms,
            workers_reporting=local.reporting,
            local_world_size=self._file.slots,
            stalled=stalled,
            hang_timeout_ms=(self._timeout_ns or 0) // 1_000_000,
        )

    def _declare(
        self, board: ProgressBoard | None, round: int, local: LocalProgress, silent_ns: int
    ) -> None:
        stalled_ms = silent_ns // 1_000_000
        if board is None:
            hang = Hang(round, (self._node,), local.step, False, self._node, stalled_ms,
                        self._wall_ms())  # fmt: skip
            with self._lock:
                self._local_hang = hang
            log.warning("node %s: %s", self._node, hang_line(hang))
        else:
            blame = who_stopped_first(self._node, local.step, board.read(), round)
            mine = Hang(round, blame.nodes, blame.step, blame.behind, self._node, stalled_ms,
                        self._wall_ms())  # fmt: skip
            held = board.declare(mine, _DECLARE_TIMEOUT_S)
            if held is None:
                return  # the round ended meanwhile: nothing hangs any more
            if held is not mine:
                log.info("node %s: the hang was declared by %s first", self._node,
                         held.declared_by)  # fmt: skip
                return
            hang = held
            log.warning(
                "node %s: workers made no progress for %.1f s at step %d: declared a hang "
                "of round %d", self._node, silent_ns / 1e9, local.step, round,
            )  # fmt: skip
        if self._on_hang is not None:
            self._on_hang(hang)
        self._wake()
