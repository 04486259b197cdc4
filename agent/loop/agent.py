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

The loop keeps the wake-ups and the worker group; each step it takes has its module: a
round formed (:mod:`agent.loop.formation`), a restart decided and counted
(:mod:`agent.loop.restarts`), each way the run ends and its exit code
(:mod:`agent.loop.exits`), the warm pool before the first join (:mod:`agent.loop.warmup`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
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
from agent.health.preflight import Preflight
from agent.loop.ending import collect_failures
from agent.loop.exits import Exits
from agent.loop.formation import Formation
from agent.loop.launches import build_launches, warm_templates
from agent.loop.phase import PhaseWaiter
from agent.loop.policy import Step
from agent.loop.restarts import Restarts
from agent.loop.warmup import prepare_warm_pool, refill_after_start
from agent.observe.journal import NODE_ENV
from agent.observe.metrics import RunMetrics, running_workers
from agent.observe.recording import RoundRecorder
from agent.observe.timeline import quarantine_recorded, record_faults
from agent.store import Store
from agent.workers.errorfile import Failure
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

__all__ = ["Agent"]

log = logging.getLogger(__name__)


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
        self._metrics = metrics or RunMetrics()
        self._restarts = Restarts(config, self._rdzv, self._metrics)
        self._metrics.watch_workers(lambda: running_workers(self._group))
        self._attempt = -1
        self._group_rank = -1
        self._group_world_size = 0
        self._store: Store | None = None
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
        self._formation = Formation(
            handler, self._rdzv, config, self._preflight, self._phases, self.wake, self._history
        )
        self._exits = Exits(
            config, handler, self._rdzv, self._phases, self._stop_group, self.wake,
            console_err, socket.gethostname(),
        )  # fmt: skip
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
        return self._restarts.used

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
            templates = warm_templates(
                self._config, {**self._base_env, NODE_ENV: self._history.node}
            )
            prepare_warm_pool(self._warm, templates, self._rdzv, self._wake, self._ctx())
            if self._preflight is not None:
                self._preflight.prepare()
            ended = self._loop()
            if ended is not None:
                code = ended
            else:
                code = self._exits.on_signal(self._stop_signal or signal.SIGTERM, self._ctx())
            return code
        finally:
            self._stop_group(reason="exit")
            self._hang.close()
            self._warm.close()
            if self._preflight is not None:
                self._preflight.close()
            self._formation.release()
            if unsubscribe is not None:
                unsubscribe()
            self._history.exited(code)

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
            if self._rdzv.drain_requested:  # ours only (rdzvctl drain): from the view
                return self._exits.drain(self._ctx())
            group = self._group
            state = group.state() if group is not None else WorkerState.UNKNOWN
            hang = self._hang.declared() if state is WorkerState.HEALTHY else None
            if hang is not None:
                state = WorkerState.UNHEALTHY  # stuck workers: a counted restart
            if self._exits.must_stop_for_closed_run(state, watch=self._push_events):
                self._collect_failures()
                self._exits.stop_for_closed_run(state, self._failures, self._ctx())
            else:
                changed = state is WorkerState.HEALTHY and self._handler.num_nodes_waiting() > 0
                step = self._restarts.step(state, changed)
                if step is Step.CONTINUE:
                    continue
                if step is Step.SUCCEED:
                    return self._exits.succeed(
                        self._store, self._group_world_size, self._ctx(), watch=self._push_events
                    )
                if step is Step.FAIL:
                    if hang is not None:
                        self._failures = {}  # none failed: they were stuck
                        return self._give_up(f"no restart left: {hang_line(hang)}")
                    self._collect_failures()
                    return self._give_up(None)
                self._before_restart(step, state, hang)
            if not self._start_round():
                break
        return None

    def _collect_failures(self) -> None:
        # The last attempt's failures, kept when this one has none (already reaped).
        self._failures = collect_failures(self._group) or self._failures

    def _before_restart(self, step: Step, state: WorkerState, hang: Hang | None) -> None:
        """Count (or not) the restart ``step`` asks for, say why, and stop the workers."""
        if hang is None and step is Step.RESTART_COUNTED:
            self._collect_failures()
        ctx = self._ctx()
        self._restarts.begin(step, state, hang, self._failures, self._group_world_size, ctx)
        counted = "hang" if hang is not None else "failure"
        self._stop_group(reason=counted if step is Step.RESTART_COUNTED else "membership")

    def _give_up(self, reason: str | None, *, close: bool = True) -> int:
        self._report = self._exits.give_up(
            reason, self._failures, self.restart_count, self._store, self._group_rank,
            self._ctx(), close=close,
        )  # fmt: skip
        return 1

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

    def _start_round(self) -> bool:
        """Rendezvous, agree on ranks and master, start the workers; False if stopped."""
        config = self._config
        if self._stop_signal is not None:
            return False
        asked = time.monotonic()
        formed = self._formation.form(self._ctx(), watch=self._push_events)
        if formed is None or self._stop_signal is not None:
            return False
        self._metrics.round_formed(
            self._rdzv.last_round,
            formed.info.world_size,
            time.monotonic() - asked,
        )
        group_rank, group_world_size = formed.info.rank, formed.info.world_size
        self._store, self._group_rank = formed.store, group_rank
        self._restarts.settle(group_world_size, self._ctx())
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
        refill_after_start(self._warm, launches)
        self._history.started(self._group.pids, self.restart_count)
        return True
