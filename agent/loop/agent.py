"""The elastic agent's loop: rendezvous, assign ranks, start workers, react to events.

Like torch's ``LocalElasticAgent`` without its fixed sleep: the loop blocks on one
``threading.Event`` that is set the moment a worker exits (a waiter thread per worker),
the rendezvous reports a change (``handler.subscribe``, when the handler has it), or a
stop is requested; ``monitor_interval`` only bounds the wait. Each wake-up is turned into
a step by the pure :func:`agent.loop.policy.next_step`.

Where it departs from torch's agent: a node that gives up closes the run with its root
cause as the reason (mode ``failed``) before stopping its workers, and a node whose run
is closed that way stops its workers at once and prints the reason in one line (a
``drain`` close lets the attempt finish); a node stopped by a signal passes it to its
workers first and leaves the rendezvous while they stop (etcd may not answer for a
while; the workers' grace must not wait for it); a rendezvous error ends the agent with one
``etcdrun: error:`` line and never closes the run; ``--max-restarts`` is the job's budget
with our rendezvous, counted once per round whichever nodes see the failure
(:mod:`agent.loop.budget`), and a counted restart is given back when the next round has
fewer nodes (:func:`coordinator.core.restart_budget.restart_refunded`).

The loop never blocks inside library code: rendezvous, rank exchange and the exit
barrier run as phases (:mod:`agent.loop.rounds`) while the loop waits on its event, so a stop
request (a signal is only a flag, :mod:`agent.loop.stopping`) and a membership change end any
wait without an exception raised into an RPC.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
)

from agent.config import LaunchConfig
from agent.health.hang import HangWatch, HangWatchDied, running_ranks
from agent.health.hang_rules import hang_line
from agent.health.preflight import HealthCheckFailed, Preflight
from agent.loop.budget import DepartureHold, restart_budget
from agent.loop.ending import (
    close_reason,
    close_rendezvous,
    collect_failures,
    give_up_report,
    leave,
    release_exit_barrier,
)
from agent.loop.launches import build_launches, warm_templates
from agent.loop.phase import MembershipChanged, Phase, PhaseWaiter
from agent.loop.policy import Step, next_step, restart_cause, stop_for_closed_run
from agent.loop.rounds import Formed, barrier_changed, barrier_phase, form_round, formation_changed
from agent.observe.journal import NODE_ENV
from agent.observe.metrics import RunMetrics, running_workers
from agent.observe.recording import RoundRecorder
from agent.observe.timeline import quarantine_recorded, record_faults, record_restart
from agent.store import Store
from agent.workers.bootstrap import BootstrapHost, BootstrapTicket
from agent.workers.errorfile import Failure, root_cause
from agent.workers.group import (
    WorkerGroup,
    WorkerLauncher,
    WorkerStartError,
    omp_num_threads,
)
from agent.workers.logs import LogSpec, RunLogDir
from agent.workers.state import WorkerState
from agent.workers.warm import WarmPool
from coordinator.core.state import Hang
from coordinator.torch_adapter.surface import surface_of

__all__ = ["Agent", "signal_exit_code"]

# How long a starting agent lets its warm interpreters import before it joins anyway.
_WARM_BEFORE_JOIN_S = 60.0
# After a start from the pool, how long the imports that replace the interpreters taken
# wait while another one is still ready: the new workers load their checkpoint and take
# their first step without a torch import competing for the same cores.
_REFILL_DEFER_S = 5.0

log = logging.getLogger(__name__)


def signal_exit_code(signum: int) -> int:
    """The shell convention for "ended by signal N": 128 + N (143 for SIGTERM)."""
    return 128 + signum


class Agent:
    """Runs one node of a job until it succeeds, fails for good, or is stopped."""

    def __init__(
        self,
        config: LaunchConfig,
        handler: RendezvousHandler,
        *,
        base_env: Mapping[str, str] | None = None,
        console_out: TextIO | None = None,
        console_err: TextIO | None = None,
        metrics: RunMetrics | None = None,
        launcher: WorkerLauncher = WorkerGroup,
    ) -> None:
        """
        Args:
            config: the validated launch configuration.
            handler: the rendezvous (ours, or any torch ``RendezvousHandler``).
            base_env: the environment workers inherit (default: this process's).
            console_out, console_err: where tee'd worker lines and the failure report go
                (default: sys.stdout / sys.stderr at the time of writing).
            metrics: hears of rounds, restarts and workers (default: nothing measured).
            launcher: makes each attempt's worker group (default: :class:`WorkerGroup`,
                processes; the fleet harness passes threads that stand in for them).
        """
        self._config = config
        self._handler = handler
        self._rdzv = surface_of(handler)
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._console_out = console_out
        self._console_err = console_err
        self._wake = threading.Event()
        self._phases = PhaseWaiter(self._wake, lambda: self._stop_signal is not None)
        self._push_events = False
        self._stop_signal: int | None = None
        self._budget = restart_budget(config.max_restarts, self._rdzv)
        self._hold = DepartureHold(self._rdzv)
        self._metrics = metrics or RunMetrics()
        self._metrics.restarts_left(self._budget.left)
        self._metrics.watch_workers(lambda: running_workers(self._group))
        self._attempt = -1
        self._group_rank = -1
        self._group_world_size = 0
        self._store: Store | None = None
        # The workers' bootstrap store (group rank 0): one server at a time, released
        # before each formation so a fixed --master-port is free for the next round.
        self._bootstrap = BootstrapHost()
        self._group: WorkerGroup | None = None
        self._launcher = launcher
        self._warm = WarmPool(
            config.warm_modules, enabled=config.warm_start, depth=config.warm_pool_size
        )
        self._preflight = (
            Preflight(
                timeout=config.health_check_timeout,
                quarantine_s=config.quarantine_seconds,
                env=self._base_env,
                node_id=self._rdzv.node_id,
                addr=config.local_addr,
                quarantine=quarantine_recorded(self._rdzv),
            )
            if config.health_check
            else None
        )
        self._failures: dict[int, Failure] = {}
        self._report: str | None = None
        self._hostname = socket.gethostname()
        # Every worker gets the path of the node's progress file (etcd_elastic.progress).
        self._hang = HangWatch(
            config.hang_timeout, config.nproc_per_node, self._rdzv,
            lambda: running_ranks(self._group), self.wake,
            on_step=self._metrics.progress_step,
            on_hang=lambda hang: record_faults(
                self._rdzv, hang.nodes, "hung", hang.round, hang_line(hang)
            ),
        )  # fmt: skip
        self._base_env.update(self._hang.env)
        self._history = RoundRecorder(self._rdzv, handler.get_run_id(), self._base_env)
        self._logdir = RunLogDir(config.log_dir, handler.get_run_id())
        self._logspec = LogSpec(
            log_dir=config.log_dir,
            redirects=config.redirects,
            tee=config.tee,
            local_ranks_filter=config.local_ranks_filter,
            prefix_template=self._base_env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        )
        if omp_num_threads(self._base_env, config.nproc_per_node) is not None:
            log.warning(
                "Setting OMP_NUM_THREADS environment variable for each process to be 1 by "
                "default, to avoid your system being overloaded; tune it for your "
                "application as needed."
            )

    # -- public --------------------------------------------------------------------

    @property
    def restart_count(self) -> int:
        """Counted restarts used so far (the job's, with our rendezvous)."""
        return self._budget.used

    @property
    def attempt(self) -> int:
        """How many times this agent started its worker group, minus one."""
        return self._attempt

    @property
    def failures(self) -> dict[int, Failure]:
        """global rank -> failure, from the last attempt that had failures."""
        return dict(self._failures)

    @property
    def report(self) -> str | None:
        """The root-cause report printed when the agent gave up, else None."""
        return self._report

    @property
    def worker_group(self) -> WorkerGroup | None:
        """The current (or last) worker group."""
        return self._group

    @property
    def stop_signal(self) -> int | None:
        """The signal a stop was requested with, or None."""
        return self._stop_signal

    def request_stop(self, signum: int) -> None:
        """Ask the loop to stop the workers and return ``128 + signum``.

        Thread-safe, and what a signal turns into (:func:`agent.loop.stopping.stop_requests`):
        the loop, wherever it waits, wakes and stops cooperatively.
        """
        if self._stop_signal is None:
            self._stop_signal = signum
        self.wake()

    def wake(self) -> None:
        """Wake the loop now (thread-safe); used by worker waiters and the rendezvous."""
        self._wake.set()
        self._warm.poke()  # a worker start waiting for a warm interpreter gives up

    def run(self) -> int:
        """Run until done. Returns 0 (success), 1 (failed for good), or 128+signal."""
        unsubscribe = self._rdzv.subscribe(self.wake)
        self._push_events = unsubscribe is not None
        code = 1
        try:
            self._prepare_warm_pool()
            if self._preflight is not None:
                self._preflight.prepare()
            ended = self._loop()
            if ended is not None:
                code = ended
            else:
                signum = self._stop_signal or signal.SIGTERM
                log.warning("%s: stopping workers on signal %d", self._ctx(), signum)
                # Pass the signal on, as torch does: a script may treat SIGINT apart (or
                # the early warning, when one is configured).
                first = self._config.drain_signal or signal.Signals(signum)
                self._signal_then_leave(first)
                code = signal_exit_code(signum)
            return code
        finally:
            self._stop_group(reason="exit")
            self._hang.close()
            self._warm.close()
            if self._preflight is not None:
                self._preflight.close()
            self._bootstrap.release()
            if unsubscribe is not None:
                unsubscribe()
            self._history.exited(code)

    def _signal_then_leave(self, first: signal.Signals) -> None:
        """Signal the workers first, and leave the run (ours: revoke the lease) while
        they stop. Leaving flushes events, records the departure and revokes the lease:
        20 s and more while etcd does not answer, which under a scheduler's 30 s grace
        would come out of the workers' time to checkpoint. With etcd up the revoke
        (milliseconds) still lands before the workers are gone, so the other nodes
        re-form for a membership change; a counted restart they see is refunded when
        their next round is smaller (:func:`agent.loop.policy.restart_refunded`)."""
        leaving = threading.Thread(
            target=leave, args=(self._rdzv, self._ctx()), name="agent-leave", daemon=True
        )
        self._stop_group(first, reason="stop", then=leaving.start)
        leaving.join()

    def _prepare_warm_pool(self) -> None:
        """Start the whole warm pool (every interpreter of every local worker at once: no
        worker runs yet) and let it import before this node joins: a node that joins a
        running job makes every other node restart, and they would then wait for this
        node's workers to import torch; and a worker that crashes in its first seconds
        finds a spare ready, as a late crash does. The wait is at most
        ``_WARM_BEFORE_JOIN_S``; a stop request or a membership event ends it. A run that
        trained and now lacks nodes (fewer than ``min_nodes`` alive) is not kept waiting:
        this node joins at once and its first workers take the interpreters as they
        become ready."""
        templates = warm_templates(self._config, {**self._base_env, NODE_ENV: self._history.node})
        if self._warm.enabled and self._rdzv.needs_nodes():
            # One import per worker first, as a refill does: the spares importing beside
            # them would slow the imports the first workers wait for.
            self._warm.refill(templates)
            log.info(
                "%s: the run waits for nodes to reach min_nodes: joining at once, before the "
                "warm interpreters are ready", self._ctx(),
            )  # fmt: skip
            return
        self._warm.refill(templates, at_once=True)
        if not self._warm.enabled:
            return
        started = time.monotonic()
        full = self._warm.wait_ready(_WARM_BEFORE_JOIN_S, self._wake, every=self._warm.depth)
        log.info(
            "%s: warm interpreters %s after %.1f s",
            self._ctx(), "ready" if full else "not all ready", time.monotonic() - started,
        )  # fmt: skip

    # -- the loop ------------------------------------------------------------------

    def _ctx(self) -> str:
        node = str(self._group_rank) if self._group_rank >= 0 else "?"
        return f"run {self._handler.get_run_id()} node {node} attempt {self._attempt}"

    def _loop(self) -> int | None:
        try:
            return self._monitor()
        except (WorkerStartError, HangWatchDied) as exc:
            return self._give_up(str(exc))
        except RendezvousGracefulExitError as exc:
            # The job ended while this node waited outside its round (a spare, on the wait
            # list): it did its part, as torch's agent says with exit code 0.
            log.info("%s: %s; exiting 0", self._ctx(), " ".join(str(exc).split()))
            return 0
        except RendezvousError as exc:
            # Closed, join timeout, etcd unreachable, unreadable state: nothing this node
            # can fix by restarting, and none of them is a reason to close the run for
            # the others (a closed run is closed already). Our handler's messages name
            # the run, the endpoints or the key; torch's may span lines.
            text = " ".join(str(exc).split()) or f"the rendezvous failed ({type(exc).__name__})"
            # This node's own failures, if any, are consequences here (its peers went
            # away), so they are not reported as the root cause; the line says it all.
            self._failures = {}
            return self._give_up(f"etcdrun: error: {text}", close=False)

    def _monitor(self) -> int | None:
        """Start a round, then react to each wake-up; an exit code, or None when stopped."""
        if not self._start_round():
            return None
        while self._stop_signal is None:
            self._wake.wait(self._config.monitor_interval)
            self._wake.clear()
            if self._stop_signal is not None:
                break
            if self._drain_requested():
                return self._drain()
            group = self._group
            state = group.state() if group is not None else WorkerState.UNKNOWN
            hang = self._hang.declared() if state is WorkerState.HEALTHY else None
            if hang is not None:
                state = WorkerState.UNHEALTHY  # stuck workers: a counted restart
            if self._must_stop_for_closed_run(state):
                self._stop_for_closed_run(state)
            else:
                changed = state is WorkerState.HEALTHY and self._handler.num_nodes_waiting() > 0
                step = next_step(state, self._budget.left_for_failure, changed)
                step = self._hold.judge(step, state)  # a departure may yet explain it
                if step is Step.CONTINUE:
                    continue
                if step is Step.SUCCEED:
                    return self._succeed()
                if step is Step.FAIL:
                    if hang is not None:
                        self._failures = {}  # none failed: they were stuck
                        return self._give_up(f"no restart left: {hang_line(hang)}")
                    self._failures = collect_failures(self._group) or self._failures
                    return self._give_up(None)
                self._before_restart(step, state, hang)
            if not self._start_round():
                break
        return None

    def _drain_requested(self) -> bool:
        # Ours only (rdzvctl drain): answered from the watched view, no round trip.
        return self._rdzv.drain_requested

    def _drain(self) -> int:
        """An operator asked this node to leave (``rdzvctl drain``): leave the run first
        (the lease is revoked, so the others re-form at once, not a counted restart), give
        the workers the early warning and the grace, exit 0."""
        first = self._config.drain_signal or signal.SIGTERM
        log.warning(
            "%s: drained by an operator: leaving the run; workers get %s and %.0f s before SIGKILL",
            self._ctx(),
            first.name,
            self._config.stop_grace_period,
        )
        leave(self._rdzv, self._ctx())
        self._stop_group(first, reason="drain")
        return 0

    def _stop_for_closed_run(self, state: WorkerState) -> None:
        # The next rendezvous raises the handler's closed error, which carries the closer's
        # reason (its root cause), and the agent ends with that line.
        self._failures = collect_failures(self._group) or self._failures
        first = root_cause(self._failures) if self._failures else None
        log.warning(
            "%s: the run was closed by another node; stopping the workers%s",
            self._ctx(),
            f" (one had failed: rank {first.global_rank}: {first.message})"
            if state is WorkerState.FAILED and first is not None
            else "",
        )
        self._stop_group(reason="closed")

    def _succeed(self) -> int:
        log.info("%s: all workers succeeded; waiting for the other nodes", self._ctx())
        self._stop_group(reason="success")  # reaps them and their leftovers
        self._exit_barrier()
        close_rendezvous(
            self._handler, "the job finished: every worker succeeded", self._ctx(), failed=False
        )
        return 0

    def _before_restart(self, step: Step, state: WorkerState, hang: Hang | None) -> None:
        """Count (or not) the restart ``step`` asks for, say why, and stop the workers."""
        self._metrics.restarted("hang" if hang is not None else restart_cause(step, state))
        if hang is not None:
            self._restart_for_hang(hang)
        elif step is Step.RESTART_COUNTED:
            self._failures = collect_failures(self._group) or self._failures
            self._budget.charge(self._group_world_size)
            self._metrics.restarts_left(self._budget.left)
            first = root_cause(self._failures) if self._failures else None
            record_restart(self._rdzv, self.restart_count, first)
            log.warning(
                "%s: worker group %s (root cause: rank %s: %s); restarting, %d of %d restarts left",
                self._ctx(),
                state.value,
                first and first.global_rank,
                first and first.message,
                self._budget.left,
                self._config.max_restarts,
            )
        else:
            log.info("%s: membership changed; restarting (not counted)", self._ctx())
        counted = "hang" if hang is not None else "failure"
        self._stop_group(reason=counted if step is Step.RESTART_COUNTED else "membership")

    def _restart_for_hang(self, hang: Hang) -> None:
        """A hang was declared in this node's round (by this node or another): count the
        restart on this node, as every participant does, and say who stopped first.
        The one place every node handles a hang (the declaring node also calls
        ``HangWatch``'s ``on_hang``)."""
        self._budget.charge(self._group_world_size)
        self._metrics.restarts_left(self._budget.left)
        record_restart(self._rdzv, self.restart_count, None, why=hang_line(hang))
        log.warning(
            "%s: %s; restarting the workers, %d of %d restarts left",
            self._ctx(), hang_line(hang), self._budget.left, self._config.max_restarts,
        )  # fmt: skip

    def _must_stop_for_closed_run(self, state: WorkerState) -> bool:
        # Only a handler that pushes events (ours) is asked: it answers from memory,
        # where torch's c10d handler would make a store round trip every tick.
        if not self._push_events or state not in (WorkerState.HEALTHY, WorkerState.FAILED):
            return False
        closed = self._handler.is_closed()
        return stop_for_closed_run(state, closed, self._rdzv.close_mode if closed else "")

    def _give_up(self, reason: str | None, *, close: bool = True) -> int:
        who = f"node {self._group_rank} ({self._hostname})"
        if close:
            # Close before stopping: the other nodes learn the root cause (and stop their
            # workers) while ours are still being stopped.
            why = close_reason(who, self._failures, self.restart_count, reason)
            close_rendezvous(self._handler, why, self._ctx(), failed=True)
        if self._store is not None:
            # Nodes of the last round already at its exit barrier stop waiting for us.
            release_exit_barrier(self._store, who, self._ctx())
        self._stop_group(reason="failure")
        self._report = give_up_report(reason, self._failures, self._name(), self._hostname)
        # The report goes to stderr once, below; logging it too would print it twice.
        log.error("%s: giving up", self._ctx())
        err = self._console_err or sys.stderr
        err.write(self._report + "\n")
        err.flush()
        return 1

    def _name(self) -> str:
        return self._config.entrypoint

    def _stop_group(
        self,
        sig: signal.Signals = signal.SIGTERM,
        *,
        reason: str,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Stop the workers; ``then`` runs once they were signalled (at once if none run)."""
        self._hang.pause()  # stopped workers make no progress: judge none
        group = self._group
        if group is not None and group.state() is not WorkerState.STOPPED:
            group.stop(self._config.stop_grace_period, sig, then=then)
            self._history.stopped(reason)
        elif then is not None:
            then()

    def _form(self) -> Formed | None:
        """Rendezvous until a round forms whose ranks this node agreed; None if stopped."""
        while True:
            log.info("%s: joining the next rendezvous round", self._ctx())
            # The last round's workers are stopped: its server goes, and only this
            # formation may host the next one.
            ticket = self._bootstrap.next_formation()
            phase: Phase[Formed] = Phase(
                "rendezvous",
                functools.partial(self._form_body, ticket=ticket),
                self.wake,
            )
            changed = formation_changed(self._handler, self._rdzv) if self._push_events else None
            try:
                formed = self._phases.run(phase, changed)
                if formed is None:
                    self._bootstrap.release()  # stopped: nothing abandoned may bind now
                return formed
            except MembershipChanged as exc:
                where = "" if isinstance(exc, HealthCheckFailed) else " during the rank exchange"
                log.info("%s: %s%s; joining the next round (not counted)", self._ctx(), exc, where)
            finally:
                self._history.health(self._preflight)

    def _form_body(self, phase: Phase[Formed], *, ticket: BootstrapTicket) -> Formed:
        return form_round(self._handler, self._rdzv, self._config, phase, ticket, self._preflight)

    def _start_round(self) -> bool:
        """Rendezvous, agree on ranks and master, start the workers; False if stopped."""
        config = self._config
        if self._stop_signal is not None:
            return False
        asked = time.monotonic()
        formed = self._form()
        if formed is None or self._stop_signal is not None:
            return False
        self._metrics.round_formed(
            self._rdzv.last_round,
            formed.info.world_size,
            time.monotonic() - asked,
        )
        group_rank, group_world_size = formed.info.rank, formed.info.world_size
        self._store, self._group_rank = formed.store, group_rank
        if self._budget.settle(group_world_size):
            log.info(
                "%s: the group shrank to %d nodes: the worker failure followed a node's "
                "departure, so that restart is not counted (%d of %d restarts left)",
                self._ctx(), group_world_size, self._budget.left, config.max_restarts,
            )  # fmt: skip
        self._metrics.restarts_left(self._budget.left)
        self._group_world_size = group_world_size
        self._attempt += 1
        group = formed.group_info(config, self.restart_count, self._handler.get_run_id())
        env = {**self._base_env, **self._history.formed(group_rank, group_world_size)}
        attempt_dir = self._logdir.attempt(self._attempt, range(config.nproc_per_node))
        launches = build_launches(config, group, formed.assignment, self._logspec, attempt_dir, env)
        log.info(
            "%s: round complete: group %d of %d, master %s:%d, global ranks %s, "
            "restart count %d, logs in %s",
            self._ctx(),
            group_rank,
            group_world_size,
            formed.master_addr,
            formed.master_port,
            [launch.ranks.global_rank for launch in launches],
            self.restart_count,
            attempt_dir,
        )
        self._wake.clear()
        self._hang.begin(self._rdzv.last_round if self._rdzv.last_round >= 0 else self._attempt)
        self._group = self._launcher(
            launches, self.wake, console_out=self._console_out, console_err=self._console_err,
            warm=self._warm, interrupted=self._wake,
        )  # fmt: skip
        self._group.start()
        self._warm.refill(
            {ln.ranks.local_rank: (ln.argv, ln.env) for ln in launches}, defer=_REFILL_DEFER_S
        )
        self._history.started(self._group.pids, self.restart_count)
        return True

    def _exit_barrier(self) -> None:
        store = self._store
        if store is None:
            return
        ctx = self._ctx()
        phase = barrier_phase(
            store, self._group_world_size, self._config.exit_barrier_timeout, ctx, self.wake
        )
        try:
            changed = barrier_changed(self._handler, self._rdzv) if self._push_events else None
            self._phases.run(phase, changed)
        except MembershipChanged as exc:
            log.warning("%s: exit barrier: %s; closing anyway", ctx, exc)
