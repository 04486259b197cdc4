"""Stand-ins for what a simulated agent would start as processes: its workers and its
pre-flight check.

A :class:`StandInGroup` is a :class:`~agent.workers.group.WorkerGroup` whose workers are
entries in one :class:`Trainer` per fleet process instead of processes: the real agent
loop starts, watches and stops it through the same methods (:class:`StandInLauncher` is
what ``Agent(launcher=...)`` takes). The trainer "trains" every live stand-in worker of
its process: each ``step_s`` it writes the worker's step into the node's real progress
file (:mod:`etcd_elastic.progress`'s layout, through :class:`ProgressSlot`), so the
agent's hang detection reads, publishes and judges real reports. A worker exits when
the harness says so (a failure: code 1; the job's end: 0) or stops reporting (a hang).

What a stand-in worker skips: everything a real one does besides reporting progress
(no process start, no torch import, no collective): the harness measures what the
agents cost etcd, and none of that touches etcd.

:class:`StandInCheck` replaces the pre-flight check's subprocess (which imports torch:
a thousand of them do not fit on two cores): it answers at once with a passing result,
and the agents still exchange and judge the results through the round's store, which is
the check's whole cost to etcd.
"""

from __future__ import annotations

import contextlib
import mmap
import signal
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from agent.workers.group import Exited, WorkerGroup
from agent.workers.launch import WorkerLaunch
from agent.workers.state import WorkerState
from agent.workers.warm import WarmPool
from etcd_elastic.progress import PROGRESS_FILE_ENV

__all__ = [
    "ProgressSlot",
    "StandInCheck",
    "StandInGroup",
    "StandInLauncher",
    "Trainer",
]

# etcd_elastic.progress's layout, as its module docstring states it (a unit test checks
# that the agent's own reader, ProgressFile.read, sees what this writes).
_MAGIC = b"EEPROG2\0"
_HEADER = struct.Struct("<8sI")
_HEADER_SIZE = 64
_SLOT_SIZE = 64


class ProgressSlot:
    """One worker's slot in its node's progress file, written as ``report_progress``
    writes it: the step, then the number of calls so far."""

    def __init__(self, path: str, local_rank: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        magic, slots = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC or not 0 <= local_rank < slots:
            self._map.close()
            raise ValueError(f"{path}: not a progress file with a slot for local rank {local_rank}")
        self._words = memoryview(self._map).cast("q")
        self._index = (_HEADER_SIZE + local_rank * _SLOT_SIZE) // 8
        self._calls = 0

    def report(self, step: int) -> None:
        self._calls += 1
        self._words[self._index] = step
        self._words[self._index + 1] = self._calls

    def close(self) -> None:
        if not self._map.closed:
            self._words.release()
            self._map.close()


class _Worker:
    """One stand-in worker: its slot, whether it reports, and its exit once it exited."""

    def __init__(self, launch: WorkerLaunch, slot: ProgressSlot | None) -> None:
        self.launch = launch
        self.slot = slot
        self.stalled = False
        self.exited: Exited | None = None


class Trainer:
    """Every live stand-in worker of this process, stepped by one thread.

    The step is the same on every worker of every process at a given moment (it is
    counted from ``epoch``, a ``time.monotonic()`` stamp, which is system-wide on Linux):
    the workers of a job train in lockstep, as data-parallel ranks do.

    Args:
        step_s: seconds per training step; 0: the workers never report progress (nothing
            for hang detection to publish or judge).
        epoch: when step 0 was (``time.monotonic()``).
    """

    def __init__(self, step_s: float, epoch: float) -> None:
        self._step_s = step_s
        self._epoch = epoch
        self._lock = threading.Lock()  # leaf: guards the set below
        self._workers: set[_Worker] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stand-in-trainer", daemon=True)
        if step_s > 0:
            self._thread.start()

    def step_now(self) -> int:
        return int((time.monotonic() - self._epoch) / self._step_s) if self._step_s > 0 else 0

    def add(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.add(worker)

    def remove(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._step_s):
            step = self.step_now()
            with self._lock:
                workers = [w for w in self._workers if not w.stalled and w.slot is not None]
            for worker in workers:
                with contextlib.suppress(ValueError):  # the slot was closed meanwhile
                    worker.slot.report(step)  # type: ignore[union-attr]


class StandInGroup(WorkerGroup):
    """One attempt's stand-in workers, with :class:`WorkerGroup`'s surface.

    Args:
        launches, wake: as :class:`WorkerGroup` takes them.
        trainer: steps the workers while they run.
        on_start, on_stop: told of the group once its workers run, and once the agent
            stopped them (the fleet process reports both).
        over: whether the training is over: workers started after that exit 0 at once,
            as a training script that finds its last checkpoint does (an agent that
            re-formed after the harness's ``finish`` would otherwise train for ever).
    """

    def __init__(
        self,
        launches: Sequence[WorkerLaunch],
        wake: Callable[[], None],
        trainer: Trainer,
        on_start: Callable[[StandInGroup], None],
        on_stop: Callable[[StandInGroup], None],
        over: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(launches, wake)
        self._trainer = trainer
        self._over = over
        self._on_start = on_start
        self._on_stop = on_stop
        self._notify = wake
        self._state_lock = threading.Lock()  # leaf: guards the fields below
        self._standins: list[_Worker] = []
        self._begun = False
        self._ended = False
        self.started_at = 0.0
        """``time.monotonic()`` when the workers started."""
        self.stopped_at = 0.0
        """``time.monotonic()`` when the agent stopped them (0: not yet)."""

    def start(self) -> None:
        with self._state_lock:
            if self._begun:
                raise RuntimeError("StandInGroup.start: already started; make a new group")
            self._begun = True
            for launch in self.launches:
                path = launch.env.get(PROGRESS_FILE_ENV)
                slot = ProgressSlot(path, launch.ranks.local_rank) if path else None
                self._standins.append(_Worker(launch, slot))
            self.started_at = time.monotonic()
        for worker in self._standins:
            self._trainer.add(worker)
        self._on_start(self)
        if self._over():
            self.exit_all(0)

    @property
    def pids(self) -> dict[int, int]:
        # No process: a stand-in's "pid" is its local rank, negative (never a real pid).
        with self._state_lock:
            return {
                w.launch.ranks.local_rank: -1 - w.launch.ranks.local_rank for w in self._standins
            }

    def exits(self) -> dict[int, Exited]:
        with self._state_lock:
            return {
                w.launch.ranks.local_rank: w.exited for w in self._standins if w.exited is not None
            }

    def state(self) -> WorkerState:
        with self._state_lock:
            if not self._begun:
                return WorkerState.INIT
            if self._ended:
                return WorkerState.STOPPED
            codes = [w.exited.returncode for w in self._standins if w.exited is not None]
            total = len(self._standins)
        if any(code != 0 for code in codes):
            return WorkerState.FAILED
        return WorkerState.SUCCEEDED if len(codes) == total else WorkerState.HEALTHY

    def stop(
        self,
        grace: float,
        sig: signal.Signals = signal.SIGTERM,
        *,
        then: Callable[[], None] | None = None,
    ) -> None:
        with self._state_lock:
            first = not self._ended
            self._ended = True
            workers = list(self._standins)
        for worker in workers:
            self._exit(worker, -int(sig), wake=False)
            if worker.slot is not None:
                worker.slot.close()
        if then is not None:
            then()  # the agent leaves the run while its workers stop (as WorkerGroup does)
        if first and self._begun:
            self.stopped_at = time.monotonic()
            self._on_stop(self)

    # -- what the harness does to the workers ------------------------------------------

    def exit_worker(self, local_rank: int, code: int) -> None:
        """Worker ``local_rank`` exits with ``code`` (the agent is woken, as by a waiter)."""
        for worker in list(self._standins):
            if worker.launch.ranks.local_rank == local_rank:
                self._exit(worker, code, wake=True)

    def exit_all(self, code: int) -> None:
        """Every worker exits with ``code`` (0: the training finished)."""
        for worker in list(self._standins):
            self._exit(worker, code, wake=False)
        self._notify()

    def stall(self) -> None:
        """Every worker stops reporting progress (a hang) but keeps running."""
        for worker in list(self._standins):
            worker.stalled = True

    def _exit(self, worker: _Worker, code: int, *, wake: bool) -> None:
        with self._state_lock:
            if worker.exited is not None:
                return
            worker.exited = Exited(
                worker.launch.ranks.local_rank,
                -1 - worker.launch.ranks.local_rank,
                code,
                time.time(),
                time.monotonic(),
            )
        self._trainer.remove(worker)
        if wake:
            self._notify()


class StandInLauncher:
    """What ``Agent(launcher=...)`` takes: makes a :class:`StandInGroup` per attempt and
    keeps the latest, which the harness acts on."""

    def __init__(
        self,
        trainer: Trainer,
        on_start: Callable[[StandInGroup], None],
        on_stop: Callable[[StandInGroup], None],
    ) -> None:
        self._trainer = trainer
        self._on_start = on_start
        self._on_stop = on_stop
        self.group: StandInGroup | None = None
        self.finished = False
        """The training is over (the harness's ``finish``): later groups exit 0 at once."""

    def __call__(
        self,
        launches: Sequence[WorkerLaunch],
        wake: Callable[[], None],
        *,
        console_out: TextIO | None,
        console_err: TextIO | None,
        warm: WarmPool | None,
        interrupted: threading.Event | None,
    ) -> WorkerGroup:
        self.group = StandInGroup(
            launches, wake, self._trainer, self._on_start, self._on_stop,
            over=lambda: self.finished,
        )  # fmt: skip
        return self.group


class StandInCheck:
    """The pre-flight check process's surface (``agent.health.preflight.CheckProcess``),
    answering at once with a passing result; see the module docstring."""

    pid = -1
    import_wait_s = 0.0

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    def run(
        self, params: Mapping[str, Any], timeout: float, import_timeout: float = 0.0
    ) -> tuple[dict[str, Any] | None, str]:
        return {
            "group_rank": int(params["rank"]),
            "node_id": str(params.get("node_id", "")),
            "addr": str(params.get("addr", "")),
            "error": "",
            "devices": "stand-in",
            "matmul_s": 0.01,
            "pairs": [],
            "took_s": 0.0,
        }, ""

    def kill(self) -> None:
        return None
