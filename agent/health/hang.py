"""Hang detection on one node: read the workers' progress, suspect, declare a hang.

The agent owns one :class:`HangWatch`. Its thread (``hang-watch``) reads the progress
file the workers write (:mod:`etcd_elastic.progress`) every
:func:`~agent.health.hang_rules.tick_seconds` and notes on its own monotonic clock when
each worker's step changed. With ``--hang-timeout`` it writes to etcd only when there is
something to tell: when the node's workers made no progress for most of the timeout
(:func:`~agent.health.hang_rules.suspect_after_ns`) it writes the node's progress record
(a **suspicion**), and it deletes it if they make progress again in that round. At the
timeout it **declares a hang**: it reads every suspicion once, names the node(s) that
stopped first (:func:`coordinator.core.progress.who_stopped_first`) and records the hang
in the state with one compare-and-swap (at most one per round). A declaration that fails
(etcd unreachable, the state kept changing) is tried again, with a bounded backoff, until
it lands or the round ends. So a node whose workers make progress costs etcd nothing.

Every agent, this one included, learns of a hang from its watched state
(:attr:`EtcdRendezvousHandler.declared_hang`) and restarts its workers as a counted
restart (:meth:`HangWatch.declared`, asked by the agent's loop).

No clock of another machine is read: each node measures its own workers' silence on its
own monotonic clock, and the first node to reach the timeout declares. With a handler
that is not ours (no progress board), the hang is this node's alone: it restarts its
workers counted, and the others follow through their own rendezvous.

The loop never waits on this thread: writing and declaring are RPCs, done here.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from agent.health.hang_rules import (
    LocalProgress,
    RecordOp,
    Seen,
    Suspicion,
    declare_retry_seconds,
    fold,
    hang_line,
    record_op,
    suspect_after_ns,
    suspicion,
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

# How long one declaration retries while the state keeps changing (then it is tried again
# after a backoff, as after any failure).
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
    """Hang detection of one node.

    Args:
        hang_timeout: ``--hang-timeout`` seconds, or None (off: the workers' progress is
            still read for ``on_step``; nothing is written to etcd, nothing declared).
        slots: local workers.
        rdzv: the rendezvous surface (ours has a progress board and declared hangs).
        running: the local ranks whose workers run now (empty: none to judge).
        wake: wakes the agent's loop (a hang was declared).
        on_hang: told of every hang this node declares (a hook for the run's events).
        on_step: told of the node's lowest step at each reading (the metrics' gauge).
        clock_ns: monotonic ns (the workers' clock: ``time.monotonic_ns``).
        wall_ms: wall-clock ms, informational only.
        jitter: a number in [0, 1) per retry (spreads the retries of many nodes).
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
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._timeout_ns = None if hang_timeout is None else int(hang_timeout * 1e9)
        self._suspect_ns = None if self._timeout_ns is None else suspect_after_ns(self._timeout_ns)
        self._tick = tick_seconds(hang_timeout)
        self._file = ProgressFile(slots)
        self._rdzv = rdzv
        self._running = running
        self._wake = wake
        self._on_hang = on_hang
        self._on_step = on_step
        self._clock_ns = clock_ns
        self._wall_ms = wall_ms
        self._jitter = jitter
        self._node = rdzv.node_id
        self._lock = threading.Lock()  # leaf: guards the three fields below
        self._round: int | None = None  # the round being judged; None: workers stopped
        self._local_hang: Hang | None = None  # a handler without a board: ours alone
        self._fresh = False  # begin() was called: forget what the thread saw
        # The thread's own:
        self._seen: list[Seen | None] = []  # per local rank
        self._written: Suspicion | None = None  # what this node's record in etcd says
        self._settled: int | None = None  # the round whose hang is recorded (or over)
        self._failures = 0  # etcd calls that failed in a row
        self._retry_at_ns = 0  # after a failure: no etcd call before this
        self._died: ThreadDied | None = None
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
            self._round, self._local_hang = round, None
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
            if local is not None:
                self._on_step(local.step)
            if self._timeout_ns is not None and self._clock_ns() >= self._retry_at_ns:
                self._observe(round, local)

    def _observe(self, round: int, local: LocalProgress | None) -> None:
        silent_ns = 0 if local is None else self._clock_ns() - local.last_ns
        wanted = suspicion(round, local, silent_ns, self._suspect_ns)
        op = record_op(self._written, wanted, round)
        due = self._timeout_ns is not None and silent_ns >= self._timeout_ns
        declare = local is not None and due and self._settled != round
        if op is RecordOp.KEEP and not declare:
            return  # the healthy case, every tick: nothing to tell etcd
        board = self._rdzv.progress_board()
        try:
            if board is not None and op is not RecordOp.KEEP:
                self._keep_record(board, op, wanted, round, local, silent_ns)
            if declare and local is not None:
                self._declare(board, round, local, silent_ns)
        except EtcdElasticError as exc:
            # etcd unreachable or refusing: training goes on; try again after a backoff.
            self._failures += 1
            delay = declare_retry_seconds(self._failures, self._jitter())
            self._retry_at_ns = self._clock_ns() + int(delay * 1e9)
            if self._failures == 1:
                log.warning("node %s: hang detection could not write to etcd (%s); trying "
                            "again until it does", self._node, exc)  # fmt: skip
            return
        if self._failures:
            log.info("node %s: hang detection reached etcd again after %d failed "
                     "attempt(s)", self._node, self._failures)  # fmt: skip
        self._failures = 0

    def _keep_record(
        self,
        board: ProgressBoard,
        op: RecordOp,
        wanted: Suspicion | None,
        round: int,
        local: LocalProgress | None,
        silent_ns: int,
    ) -> None:
        """Write this node's suspicion, or delete it (only on a change: ``op``)."""
        if op is RecordOp.WRITE and local is not None:
            if board.publish(self._record(round, local, silent_ns)):
                log.info("node %s: workers made no progress for %.1f s at step %d in round "
                         "%d: suspecting a hang", self._node, silent_ns / 1e9, local.step,
                         round)  # fmt: skip
                self._written = wanted
        elif op is RecordOp.DELETE:
            board.withdraw()
            log.info("node %s: workers made progress again in round %d", self._node, round)
            self._written = None

    def _record(self, round: int, local: LocalProgress, silent_ns: int) -> NodeProgress:
        age_ms = silent_ns // 1_000_000
        return NodeProgress(
            node_id=self._node,
            round=round,
            step=local.step,
            age_ms=age_ms,
            reported_at_unix_ms=self._wall_ms() - age_ms,
            workers_reporting=local.reporting,
            local_world_size=self._file.slots,
            stalled=True,
            hang_timeout_ms=(self._timeout_ns or 0) // 1_000_000,
        )

    def _declare(
        self, board: ProgressBoard | None, round: int, local: LocalProgress, silent_ns: int
    ) -> None:
        """Declare the hang of ``round``; the round is settled once a hang of it is in the
        state (ours or another node's) or it is over. Raises EtcdElasticError when the
        declaration did not land: the thread tries again."""
        with self._lock:
            if self._round != round:
                return  # the loop stopped the workers meanwhile
        stalled_ms = silent_ns // 1_000_000
        if board is None:
            hang = Hang(round, (self._node,), local.step, False, self._node, stalled_ms,
                        self._wall_ms())  # fmt: skip
            with self._lock:
                self._local_hang = hang
            self._settled = round
            log.warning("node %s: %s", self._node, hang_line(hang))
        else:
            held = self._rdzv.declared_hang  # in our view already: nothing to read
            if held is None or held.round != round:
                members = self._rdzv.last_members if self._rdzv.last_round == round else ()
                blame = who_stopped_first(self._node, local.step, board.read(), round, members)
                mine = Hang(round, blame.nodes, blame.step, blame.behind, self._node,
                            stalled_ms, self._wall_ms())  # fmt: skip
                held = board.declare(mine, _DECLARE_TIMEOUT_S)
            self._settled = round
            if held is None:
                return  # the round ended meanwhile: nothing hangs any more
            if held.declared_by != self._node:
                log.info("node %s: the hang was declared by %s first", self._node,
                         held.declared_by)  # fmt: skip
                return
            # Ours, or an earlier attempt of ours whose answer was lost: say it once.
            hang = held
            log.warning(
                "node %s: workers made no progress for %.1f s at step %d: declared a hang "
                "of round %d", self._node, silent_ns / 1e9, local.step, round,
            )  # fmt: skip
        if self._on_hang is not None:
            self._on_hang(hang)
        self._wake()
