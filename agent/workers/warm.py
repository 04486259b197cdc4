"""Warm restarts: per local worker, an interpreter started ahead with torch imported.

A restart's largest cost in a real job is the new interpreter importing torch (1-1.5 s
of CPU here, per worker, all at once). The pool keeps, for each local rank, processes
of :mod:`agent.workers.warm_process` that have already done that and wait; a worker is
started by handing one the worker's command, environment, directory and standard
streams, and the pool replaces it by forking another that is still ready (no import:
milliseconds; the copy is adopted as this process's child, :mod:`agent.workers.adopt`).
A rank imports again only when none is left ready: at the agent's start, after its
processes died, or when the worker's environment changed.

A warm process is used only when the result is the same as a cold ``python -u``:

- the command is ``<python> -u <script|-m module|-c code> ...`` with the interpreter the
  warm process runs (not ``--no-python``: another program);
- the worker's environment equals the one the warm process was started with, except
  torchrun's per-attempt variables (:data:`LATE_KEYS`), which nothing reads at import.
  Anything else (a user variable read at start-up, ``OMP_NUM_THREADS`` read by OpenMP
  when it loads, ``PYTHONHASHSEED``...) must match, or the worker starts cold.

Otherwise the worker starts cold, and so it does when no process of its local rank
exists. One still importing is waited for (it started before the worker was asked for,
so it is ahead of a cold start on the same cores), up to 30 s or until the agent's loop
is woken. Warm processes are started through :func:`coordinator.core.lifeline.spawn`
in a session of their own, so they die with the agent and are stopped as workers are.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from agent.workers.warm_interpreter import (
    LATE_KEYS,
    ImportBounds,
    NotForked,
    WarmInterpreter,
    WarmTarget,
    counted,
    env_compatible,
    fits,
    ready_fit,
    warm_target,
)
from coordinator.core.lifeline import Spawned

__all__ = [
    "LATE_KEYS",
    "ImportBounds",
    "WarmPool",
    "WarmTarget",
    "env_compatible",
    "hand_over",
    "warm_target",
]

log = logging.getLogger(__name__)

# How long a worker waits for its warm interpreter still importing (it started before
# the worker was asked for: ahead of any cold start); after it, or interrupted: cold.
_READY_WAIT = 30.0
# Interpreters in a row that may die while importing without a report (killed from
# outside, or given up as stuck) before warm starts are turned off; a reported failure
# (an import error) turns them off at once, since the next one would fail the same way.
_MAX_DEATHS = 3


class WarmPool:
    """Per local rank, up to ``depth`` warm processes, refilled in the background.

    Two by default: the one a restart takes is replaced by forking the other, so there
    is always one to fork (a rank with none left must import for seconds).
    """

    def __init__(
        self,
        modules: Sequence[str] = ("torch",),
        *,
        enabled: bool = True,
        depth: int = 2,
        bounds: ImportBounds | None = None,
    ) -> None:
        self._modules = ",".join(dict.fromkeys(m for m in modules if m))
        self._enabled = enabled and depth > 0
        self._depth = depth
        self._bounds = bounds or ImportBounds()
        self._lock = threading.Lock()
        self._slots: dict[int, list[WarmInterpreter]] = {}  # oldest first
        self._templates: dict[int, tuple[WarmTarget, dict[str, str]]] = {}
        self._top_up_lock = threading.Lock()
        self._closed = False
        self._disabled_why: str | None = None
        self._deaths = 0  # interpreters in a row that died importing without a report
        self._forks = True  # refills fork a ready interpreter (off once a live one would not)
        self._changed = threading.Condition(self._lock)  # a process became ready, or a poke

    @property
    def enabled(self) -> bool:
        return self._enabled and self._disabled_why is None

    @property
    def depth(self) -> int:
        """Interpreters kept per local rank."""
        return self._depth

    def ready_count(self, local_rank: int) -> int:
        """How many processes of ``local_rank`` are ready now."""
        with self._lock:
            slot = self._slots.get(local_rank, [])
            return sum(1 for w in slot if w.ready.is_set() and w.failed is None)

    def refill(self, templates: Mapping[int, tuple[Sequence[str], Mapping[str, str]]]) -> None:
        """Keep each local rank topped up to ``depth`` processes fit for a worker like
        ``templates[local_rank]`` = (argv, env), discarding those that no longer fit.

        A rank that still has a ready process is topped up by forking it
        (:meth:`WarmInterpreter.fork`: milliseconds, no import), so a burst of restarts
        always finds one ready and no refill competes with the new workers for the
        cores. A rank with none imports in one new interpreter (one per local rank at a
        time: never more of the cores than a cold start of the same workers), then forks
        it for the rest. Returns after the forks; an import goes on in the background."""
        if not self.enabled:
            return
        for local_rank, (argv, env) in templates.items():
            target = warm_target(argv)
            if target is None:
                continue
            if not self._retarget(local_rank, target, env):
                return  # closed
            self._top_up(local_rank)

    def _retarget(self, local_rank: int, target: WarmTarget, env: Mapping[str, str]) -> bool:
        """Make ``target``/``env`` the template of ``local_rank``, discarding its
        processes that no longer fit; False once the pool is closed."""
        with self._lock:
            if self._closed:
                return False
            self._templates[local_rank] = (target, dict(env))
            slot = self._slots.setdefault(local_rank, [])
            stale = [w for w in slot if not fits(w, target, env)]
            slot[:] = [w for w in slot if w not in stale]
        for warm in stale:
            warm.discard()
        return True

    def _top_up(self, local_rank: int) -> None:
        """Fork a ready process of ``local_rank`` until the rank has ``depth``; with none
        to fork, start one import unless one is under way."""
        with self._top_up_lock:  # check and start as one step: one import at a time
            while True:
                self._drop_dead(local_rank)
                with self._lock:
                    template = self._templates.get(local_rank)
                    kept = counted(self._slots.get(local_rank, []))
                    if self._closed or template is None or len(kept) >= self._depth:
                        return
                    target, env = template
                    source = next((w for w in kept if ready_fit(w, target, env)), None)
                    importing = any(not w.ready.is_set() for w in kept)
                if source is None or not self._forks:
                    if not importing:
                        self._start(local_rank, target.python, env)
                    return
                self._fork(local_rank, source)

    def _drop(self, local_rank: int, warm: WarmInterpreter, why: str) -> None:
        """Take ``warm`` out of its rank's slot and stop it, saying ``why``."""
        with self._lock:
            slot = self._slots.get(local_rank, [])
            slot[:] = [w for w in slot if w is not warm]
        log.warning("warm start: local rank %d: a warm interpreter %s; dropping it",
                    local_rank, why)  # fmt: skip
        warm.discard()

    def _drop_dead(self, local_rank: int) -> None:
        """Drop the ready processes of ``local_rank`` that died while they waited (the
        OOM killer, an operator): they count for nothing, and the rank must import."""
        with self._lock:
            dead = [
                w for w in self._slots.get(local_rank, [])
                if w.ready.is_set() and not w.failed and w.spawned.process.poll() is not None
            ]  # fmt: skip
        for warm in dead:
            code = warm.spawned.process.returncode
            self._drop(local_rank, warm, f"died while it waited (exit code {code})")

    def _fork(self, local_rank: int, source: WarmInterpreter) -> None:
        copy = source.fork()
        if isinstance(copy, NotForked):
            if source.spawned.process.poll() is not None:
                return  # it died: dropped next (_drop_dead)
            if copy.source_at_fault:  # stopped, hung, confused: no spare; the next may fork
                self._drop(local_rank, source, f"did not fork ({copy.reason})")
                return
            # It lives, and could not be forked (no subreaper mark, no fork): the next
            # would fail alike. Refills import, as before forks.
            log.warning(
                "warm start: local rank %d: a warm interpreter could not be forked "
                "(%s); refills import new interpreters from now on", local_rank, copy.reason,
            )  # fmt: skip
            self._forks = False
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._slots.setdefault(local_rank, []).append(copy)
        if closed:
            copy.discard()
        self.poke()

    def _start(self, local_rank: int, python: str, env: dict[str, str]) -> None:
        """Start a process for ``local_rank`` and a thread that waits for its import."""
        try:
            warm = WarmInterpreter.start(python, env, self._modules)
        except OSError as exc:
            log.warning("warm start: cannot start a warm interpreter (%s); starting cold", exc)
            return
        with self._lock:
            if self._closed:
                warm.discard()
                return
            self._slots.setdefault(local_rank, []).append(warm)
        threading.Thread(
            target=self._await, args=(local_rank, warm), name=f"warm start {local_rank}",
            daemon=True,
        ).start()  # fmt: skip

    def wait_ready(
        self, timeout: float, interrupted: threading.Event | None = None, *, every: int = 1
    ) -> bool:
        """Block until every local rank refilled has ``every`` ready processes (or the
        pool is off), at most ``timeout`` seconds or until ``interrupted`` is set (then
        :meth:`poke`). True if every one has."""

        def full() -> bool:
            if not self.enabled or self._closed:
                return True
            return all(
                sum(1 for w in self._slots.get(rank, []) if w.ready.is_set() and not w.failed)
                >= every
                for rank in self._templates
            )

        with self._changed:
            self._changed.wait_for(
                lambda: full() or (interrupted is not None and interrupted.is_set()),
                timeout=timeout,
            )
            return full()

    def poke(self) -> None:
        """Wake a :meth:`claim` waiting for a process to be ready, to check its
        ``interrupted`` event again (thread-safe)."""
        with self._changed:
            self._changed.notify_all()

    def _await(self, local_rank: int, warm: WarmInterpreter) -> None:
        """Wait for ``warm``'s import (on its own thread), then start the next one, or
        another after a death, or turn warm starts off."""
        warm.wait_ready(self._bounds, lambda: self._overdue(local_rank))
        self.poke()
        if warm.failed is None:
            with self._lock:
                self._deaths = 0
            self._top_up(local_rank)  # the next one imports now
            return
        if not warm.reported and self._died_again(local_rank, warm):
            self._top_up(local_rank)  # killed from outside (OOM killer, ...), or stuck
            return
        self._turn_off(warm)

    def _overdue(self, local_rank: int) -> None:
        log.warning(
            "warm start: local rank %d: a warm interpreter's import used no CPU for "
            "%.0f s; starting another beside it, and no worker start waits for it",
            local_rank, self._bounds.overdue_idle_s,
        )  # fmt: skip
        self.poke()  # a start waiting for it stops waiting
        self._top_up(local_rank)

    def _turn_off(self, warm: WarmInterpreter) -> None:
        """``warm`` failed as the next one would (it said why, or died too often): warm
        starts are off for this agent, and every process is discarded."""
        with self._lock:
            first = self._disabled_why is None
            self._disabled_why = warm.failed
            stopped = [w for slot in self._slots.values() for w in slot]
            self._slots = {}
        if first:
            log.info("warm start: off for this agent, workers start cold (%s)", warm.failed)
        for other in {id(w): w for w in [warm, *stopped]}.values():
            other.discard()

    def _died_again(self, local_rank: int, warm: WarmInterpreter) -> bool:
        """An interpreter died while importing without saying why: drop it, and say
        whether to start another (fewer than ``_MAX_DEATHS`` such deaths in a row)."""
        with self._lock:
            self._deaths += 1
            again = self._deaths < _MAX_DEATHS and not self._closed
            if again:
                slot = self._slots.get(local_rank, [])
                slot[:] = [w for w in slot if w is not warm]
        if again:
            warm.discard()
            if warm.stuck:
                log.warning(
                    "warm start: local rank %d: a warm interpreter was killed: %s; "
                    "starting another", local_rank, warm.failed,
                )  # fmt: skip
            else:
                log.warning(
                    "warm start: local rank %d: a warm interpreter died while importing "
                    "(%s, exit code %s); starting another", local_rank, warm.failed,
                    warm.spawned.process.returncode,
                )  # fmt: skip
        return again

    def claim(
        self,
        wanted: Mapping[int, tuple[Sequence[str], Mapping[str, str]]],
        interrupted: threading.Event | None = None,
    ) -> dict[int, WarmInterpreter]:
        """Take out of the pool, for each local rank of one worker group's ``wanted``
        (argv, env), a ready process that fits; a rank without one is left out (its
        worker starts cold). Hand each over with :func:`hand_over`, or discard it.

        While a fitting process of some rank is still importing, every rank waits for it
        (it is ahead of a cold start), up to 30 s; one importing for longer than it should
        (:class:`ImportBounds`) is not waited for. When ``interrupted`` is set (then
        :meth:`poke`) during that wait, none is taken: the loop was woken because the
        round is over (a membership change, a stop), its workers start cold and are
        stopped at once, and the ready processes stay for the next round. Taken one rank
        at a time, the ranks ready first were spent on workers that never trained, and
        the next round, seconds later, waited for their imports again.
        """
        targets = {
            rank: (target, env)
            for rank, (argv, env) in wanted.items()
            if (target := warm_target(argv)) is not None
        }
        with self._changed:

            def ready(rank: int) -> WarmInterpreter | None:
                target, env = targets[rank]
                slot = self._slots.get(rank, [])
                return next((w for w in slot if ready_fit(w, target, env)), None)

            def waiting() -> bool:  # a rank with none ready and a fitting one importing
                return any(
                    ready(rank) is None
                    and any(
                        fits(w, target, env) and not w.ready.is_set() and not w.overdue
                        for w in self._slots.get(rank, [])
                    )
                    for rank, (target, env) in targets.items()
                )

            def woken() -> bool:
                return interrupted is not None and interrupted.is_set()

            if waiting():
                self._changed.wait_for(lambda: not waiting() or woken(), timeout=_READY_WAIT)
                if waiting() and woken():
                    return {}
            taken = {rank: warm for rank in targets if (warm := ready(rank)) is not None}
            for rank, warm in taken.items():
                self._slots[rank].remove(warm)
            return taken

    def close(self) -> None:
        """Stop every unused warm process. Idempotent."""
        with self._lock:
            self._closed = True
            unused = [w for slot in self._slots.values() for w in slot]
            self._slots = {}
        for warm in unused:
            warm.discard()


def hand_over(
    local_rank: int, warm: WarmInterpreter, argv: Sequence[str], env: Mapping[str, str],
    cwd: str, streams: tuple[int, int, int],
) -> Spawned | None:  # fmt: skip
    """Start the worker ``argv``/``env``/``cwd`` on ``streams`` (stdin, stdout, stderr
    descriptors, which the caller still closes) from ``warm``, which
    :meth:`WarmPool.claim` took for ``local_rank``; None if it refused (it is
    discarded: start the worker cold)."""
    target = warm_target(argv)
    refused = (
        "no warm command" if target is None else warm.hand_over(target, argv, env, cwd, streams)
    )
    if refused is not None:
        log.warning(
            "warm start: local rank %d: the warm interpreter did not take the worker "
            "(%s); starting it cold", local_rank, refused,
        )  # fmt: skip
        warm.discard()
        return None
    return Spawned(warm.spawned.process, tuple(argv))
