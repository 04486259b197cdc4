"""The agent's side of the pre-flight check (``etcdrun --health-check``).

After a round formed and its ranks and master are agreed, before any worker starts,
every node runs its check (:mod:`agent.health.check_worker`, a subprocess started ahead
so that torch is imported by the time the round forms) and exchanges its result
(:mod:`agent.health.exchange`, bounded by ``--health-check-timeout`` and by membership,
as the rank exchange is): group rank 0 gathers the results, judges them with
:func:`agent.health.verdict.judge` and publishes the verdict, which every node reads;
through the workers' bootstrap store where group rank 0's agent hosts it (no etcd
write), else through the round's store.
Group rank 0 logs one line per node; the others log their own and each failed node's.
When a node failed, group rank 0 quarantines it in the rendezvous state for
``--quarantine-seconds`` (:mod:`coordinator.core.quarantine`; one write) and every node
re-forms without it: :class:`HealthCheckFailed` is a membership change, not a counted
restart (nobody's worker failed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError

from agent.errors import MembershipChanged
from agent.health.exchange import (
    CONNECT_TIMEOUT_S,
    exchange_on_bootstrap,
    exchange_results,
    round_prefix,
)
from agent.health.verdict import NodeResult, Thresholds, Verdict, decode_result
from agent.store import Store
from agent.workers.group import without_secrets
from coordinator.core.lifeline import Spawned, spawn
from coordinator.core.state import Quarantine

__all__ = ["CheckProcess", "HealthCheckFailed", "Preflight"]

log = logging.getLogger(__name__)

# Results come within the check's timeout of each other (the nodes start together); this
# much more covers the store round trips.
_EXCHANGE_GRACE_S = 10.0
# How long a check process may take to import torch before it counts as failed: not part
# of --health-check-timeout (on a loaded host the import alone can take tens of seconds,
# and that is no fault of the node's devices or links).
IMPORT_TIMEOUT_S = 120.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


class HealthCheckFailed(MembershipChanged):
    """Nodes of the round failed the pre-flight check: the round re-forms without them."""


class CheckProcess:
    """One check subprocess, started ahead; used once.

    Args:
        env: its environment (the workers' base environment: same devices, same paths),
            less the etcd password, as a worker's (:func:`without_secrets`).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self._spawned: Spawned = spawn(
            [sys.executable, "-u", "-m", "agent.health.check_worker"],
            env=without_secrets(env),
            # Our package first on sys.path, whatever the job's working directory holds.
            cwd=_PACKAGE_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            start_new_session=True,
        )
        self._lock = threading.Lock()
        self.import_wait_s = 0.0
        """How long :meth:`run` waited for the process to finish importing torch."""

    @property
    def pid(self) -> int:
        return self._spawned.process.pid

    def _line(self, timeout: float) -> bytes | None:
        """The next line of its output (b"": it ended), None after ``timeout`` seconds."""
        stdout = self._spawned.process.stdout
        if stdout is None:  # started with stdout=PIPE: never; said as the check's failure
            raise OSError("the check process has no output pipe")
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([stdout], [], [], left)[0]:
                chunk = stdout.readline()
                if not chunk:
                    return line
                line += chunk
        return line

    def run(
        self, params: Mapping[str, Any], timeout: float, import_timeout: float = IMPORT_TIMEOUT_S
    ) -> tuple[dict[str, Any] | None, str]:
        """Wait up to ``import_timeout`` for it to be ready, send ``params``, wait up to
        ``timeout`` seconds for the result line.

        Returns:
            (the result data, "") or (None, why there is none). The process is killed
            and reaped either way.
        """
        proc = self._spawned.process
        try:
            if proc.stdin is None:  # started with stdin=PIPE: never; said as the failure
                raise OSError("the check process has no input pipe")
            self._spawned.confirm()
            waiting = time.monotonic()
            ready = self._line(import_timeout)
            self.import_wait_s = time.monotonic() - waiting
            if ready is None:
                return None, f"the check process did not start within {import_timeout:g} s"
            proc.stdin.write((json.dumps(dict(params)) + "\n").encode())
            proc.stdin.flush()
            line = self._line(timeout)
            if line is None:
                return None, f"timed out after {timeout:g} s (--health-check-timeout)"
            if not line:
                code = proc.wait()
                return None, f"the check process exited with code {code} and no result"
            data = json.loads(line)
            if not isinstance(data, dict):
                return None, "the check process wrote no result"
            return data, ""
        except (OSError, ValueError) as exc:
            return None, f"the check process failed: {' '.join(str(exc).split())}"
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill and reap it (idempotent, from any thread)."""
        with self._lock:
            proc = self._spawned.process
            self._spawned.abandon()
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


class Preflight:
    """Runs the check of each new round for one agent.

    Args:
        timeout: ``--health-check-timeout`` (seconds): how long this node's check may take.
        quarantine_s: ``--quarantine-seconds``.
        env: the check process's environment.
        node_id, addr: this node, as the results name it.
        quarantine: writes quarantine entries to the rendezvous state (ours:
            ``handler.quarantine``); None: the backend cannot (the failed nodes are only
            named in the log).
        thresholds: what counts as much slower.
        wall: wall clock (seconds), for the quarantines' end time.
    """

    def __init__(
        self,
        *,
        timeout: float,
        quarantine_s: float,
        env: Mapping[str, str],
        node_id: str,
        addr: str | None,
        quarantine: Callable[[Sequence[Quarantine]], bool] | None,
        thresholds: Thresholds | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.timeout = timeout
        self.quarantine_s = quarantine_s
        self._env = dict(env)
        self._node_id = node_id
        self._addr = addr or socket.getfqdn()
        self._quarantine = quarantine
        self._thresholds = thresholds or Thresholds()
        self._wall = wall
        self._next: CheckProcess | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.last: Verdict | None = None
        """The verdict of the last check this node completed (for a timeline)."""
        self.last_judged = False
        """Whether this node judged that check (group rank 0: it holds every result)."""
        self.last_took_s = 0.0
        """Seconds from the start of that check to its verdict on this node."""
        self.last_import_wait_s = 0.0
        """Of those, how long this node's check process was still importing torch."""
        self.connect_s = CONNECT_TIMEOUT_S
        """How long this node tries to reach the bootstrap store for the exchange."""

    @property
    def _exchange_s(self) -> float:
        # A node's check ends within its import bound and the timeout; a result still
        # missing after that is a failure (a node that leaves ends the wait earlier: the
        # phase is abandoned).
        return IMPORT_TIMEOUT_S + self.timeout + _EXCHANGE_GRACE_S

    def prepare(self) -> None:
        """Start the next check's process now, so its imports overlap the rendezvous."""
        with self._lock:
            if self._next is None and not self._closed:
                self._next = CheckProcess(self._env)

    def _take(self) -> CheckProcess:
        with self._lock:
            proc, self._next = self._next, None
        return proc if proc is not None else CheckProcess(self._env)

    def close(self) -> None:
        """Kill the process started ahead, if any; none is started after this."""
        with self._lock:
            proc, self._next, self._closed = self._next, None, True
        if proc is not None:
            proc.kill()

    def check(
        self,
        store: Store,
        *,
        round_id: int,
        group_rank: int,
        world_size: int,
        members: Sequence[str],
        master: tuple[str, int] | None,
        on_abandon: Callable[[Callable[[], None]], None],
        exchange_at: tuple[str, int] | None = None,
    ) -> Verdict:
        """Run this node's check, exchange results, judge; quarantine the failed nodes.

        Args:
            store: the round's store (the agents').
            round_id: the round (keys of the check's pair groups are per round).
            group_rank, world_size: this node's, and the number of nodes.
            members: node ids by group rank (empty: unknown; the results name them).
            master: the workers' bootstrap store (its TCPStore carries the pair groups);
                None: no pairs are measured.
            on_abandon: told how to end the check at once (a membership change).
            exchange_at: the bootstrap store to exchange the results through (one that
                group rank 0's agent hosts for this round only): no etcd write; None:
                through ``store``.

        Raises:
            HealthCheckFailed: a node failed; the round re-forms without it.
            DistStoreError: the exchange failed, or the check was abandoned meanwhile.
            BootstrapStoreError: ``exchange_at`` cannot be reached.
        """
        started = time.monotonic()
        world = max(world_size, 1)
        if len(members) != world:
            members = ()
        proc = self._take()
        on_abandon(proc.kill)
        # A wait on the bootstrap store cannot be aborted: one that ends after the abandon
        # must not log or quarantine for a round the loop left.
        abandoned = threading.Event()
        on_abandon(abandoned.set)
        params = {
            "rank": group_rank, "world_size": world, "node_id": self._node_id, "addr": self._addr,
            "size": 256, "repeats": 8, "numel": 1 << 16,
            "pairs": master is not None and world > 1,
            "store_addr": master[0] if master else "", "store_port": master[1] if master else 0,
            "prefix": round_prefix(round_id),
            "pair_timeout_s": max(1.0, self.timeout / 4),
        }  # fmt: skip
        data, why = proc.run(params, self.timeout)
        self.last_import_wait_s = proc.import_wait_s
        mine = _result(data, why, group_rank, self._node_id, self._addr)
        self.prepare()  # the next round's process imports while this round goes on
        if exchange_at is None:
            verdict, judged = exchange_results(
                store, mine, world, members, self._thresholds, self._exchange_s
            )
        else:
            verdict, judged = exchange_on_bootstrap(
                exchange_at, round_id, mine, world, members, self._thresholds,
                self._exchange_s, self.connect_s,
            )  # fmt: skip
        if abandoned.is_set():
            raise DistStoreError("the membership changed: this node no longer waits on this round")
        self.last, self.last_took_s = verdict, time.monotonic() - started
        self.last_judged = judged
        for node in verdict.nodes:
            if judged or not node.passed or node.group_rank == group_rank:
                (log.info if node.passed else log.warning)("pre-flight check: %s", node.line())
        failed = verdict.failed
        if not failed:
            log.info(
                "pre-flight check of round %d: %d node(s) passed in %.2f s (%.2f s of it "
                "waiting for this node's check process to import torch)",
                round_id, world, self.last_took_s, self.last_import_wait_s,
            )  # fmt: skip
            return verdict
        self._leave_out(verdict, round_id, write=judged)
        names = ", ".join(f"node {n.group_rank} {n.node_id} ({n.reason})" for n in failed)
        raise HealthCheckFailed(f"the pre-flight check of round {round_id} left out {names}")

    def _leave_out(self, verdict: Verdict, round_id: int, *, write: bool) -> None:
        """Say who is left out; the judge (``write``) also quarantines them."""
        failed = verdict.failed
        until = int((self._wall() + self.quarantine_s) * 1000)
        entries = [Quarantine(n.node_id, n.reason, until, n.addr) for n in failed]
        left = len(verdict.nodes) - len(failed)
        if any(n.node_id == self._node_id for n in failed):
            log.warning(
                "pre-flight check of round %d: this node failed; it is quarantined for %g s "
                "(--quarantine-seconds) and waits outside the rounds, then asks to join again",
                round_id, self.quarantine_s,
            )  # fmt: skip
        else:
            log.warning(
                "pre-flight check of round %d: %d node(s) failed; quarantined for %g s, the "
                "other %d re-form without them (not a counted restart)",
                round_id, len(failed), self.quarantine_s, left,
            )  # fmt: skip
        if not write:
            return  # group rank 0 writes the quarantine: one write, not one per node
        if self._quarantine is None:
            log.warning("the rendezvous backend cannot quarantine nodes; they are only named")
            return
        try:
            self._quarantine(entries)
        except Exception as exc:
            # The round re-forms anyway; its check will find the node again.
            log.warning("could not quarantine %s: %s", ", ".join(e.node_id for e in entries), exc)


def _result(
    data: dict[str, Any] | None, why: str, rank: int, node_id: str, addr: str
) -> NodeResult:
    """This node's result from the process's data (or the reason it has none)."""
    if data is None:
        return NodeResult(rank, node_id, addr, error=why)
    try:
        result = decode_result("check process output", json.dumps(data).encode())
    except ValueError as exc:
        return NodeResult(rank, node_id, addr, error=str(exc))
    return result if result.group_rank == rank else NodeResult(rank, node_id, addr, error=why)
