"""The agent journal: what each agent (and, if it wants, each worker) did, one JSON
object per line, appended to a local file.

An observability hook (``docs/journal.md``): set ``ETCD_ELASTIC_JOURNAL=/path/file.jsonl``
and every agent of the machine appends its rounds, worker starts and stops, pre-flight
results and exit to that file; an audit, a post-mortem or a test reads it back with
:func:`read_journal`. It is local and costs etcd nothing. The fault-injection suite
(``tests/chaos/``) is its first reader: its harness and workers append to the same file
and its checker verifies named invariants on it. Without the variable nothing is
written and :meth:`JournalWriter.record` costs one attribute test.

Every line has these keys, then the event's own fields::

    t      time.time() when recorded (for people; never compared across processes)
    mono   time.monotonic(): CLOCK_MONOTONIC is one clock for every process of a Linux
           machine, so the checker orders and compares events of all processes by it
    src    "agent" | "worker" | "harness"
    pid    the recording process
    event  the event's name

Agent events (``src="agent"``; written by the agent when ``ETCD_ELASTIC_JOURNAL`` is set):

``round`` {node, round, group_rank, group_world, members, run}
    A rendezvous round completed with this agent: ``node`` its node id, ``round`` the
    round number, ``group_rank``/``group_world`` its group rank and the number of nodes,
    ``members`` the node ids in group-rank order, ``run`` the run id.
``workers_started`` {node, round, pids, restart_count}
    The agent started its worker group for ``round``; ``pids`` by local rank.
``workers_stopped`` {node, round, reason}
    The agent stopped (or found stopped) its worker group of ``round``; ``reason`` is
    ``failure`` (a worker failed: a counted restart), ``membership`` (a node joined or
    left), ``stop`` (a signal), ``success``, ``lease`` (this node's lease was lost),
    ``closed`` (the run was closed), ``hang`` (a hang was declared in the round: a
    counted restart) or another word the agent documents.
``health_check`` {node, round, took_s, nodes}
    The pre-flight check of ``round`` (``--health-check``) as this agent judged it:
    ``took_s`` from its start to the verdict on this agent, ``nodes`` one record per node
    (group_rank, node_id, addr, passed, reason, devices, matmul_s, best_pair_s, check_s).
``agent_exit`` {node, code}
    The agent is about to exit with ``code``.

Worker environment (set by the agent for each worker): ``ETCD_ELASTIC_ROUND`` (the round
number), ``ETCD_ELASTIC_NODE_ID`` (the agent's node id), ``ETCD_ELASTIC_JOURNAL`` (this
file). Worker and harness events are documented where they are written
(``tests/chaos/worker.py``, ``tests/chaos/events.py``).

Lines are written with one ``os.write`` on a descriptor opened with ``O_APPEND``: the
kernel positions and writes each such call as a whole, so lines of many processes never
interleave (lines are kept well under a page). A process killed at any moment leaves
whole lines only; :func:`read_journal` still drops a torn last line (a full disk, a
copy taken mid-write).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "JOURNAL_ENV",
    "NODE_ENV",
    "RESERVED_KEYS",
    "ROUND_ENV",
    "JournalError",
    "JournalWriter",
    "read_journal",
]

log = logging.getLogger(__name__)

JOURNAL_ENV: Final = "ETCD_ELASTIC_JOURNAL"
ROUND_ENV: Final = "ETCD_ELASTIC_ROUND"
NODE_ENV: Final = "ETCD_ELASTIC_NODE_ID"
RESERVED_KEYS: Final = frozenset({"t", "mono", "src", "pid", "event"})
_SOURCES: Final = frozenset({"agent", "worker", "harness"})


class JournalError(ValueError):
    """A history file has a damaged line before its last one."""


class JournalWriter:
    """Appends events to a history file shared by many processes.

    Thread-safe and fork-safe in the ways that matter here: each line is one system call,
    the pid is read at each call, and the descriptor is close-on-exec (workers open the
    file themselves). A write error is logged once and the event is lost: the history
    serves the tests and must never stop an agent.
    """

    def __init__(self, path: str | None, src: str = "agent") -> None:
        """
        Args:
            path: the history file (created if missing), or None to record nothing.
            src: ``agent``, ``worker`` or ``harness``.

        Raises:
            ValueError: ``src`` is none of those.
            OSError: the file cannot be opened.
        """
        if src not in _SOURCES:
            raise ValueError(f"history source {src!r} is not one of {sorted(_SOURCES)}")
        self._src = src
        self._warned = False
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @classmethod
    def from_env(cls, src: str, env: Mapping[str, str] | None = None) -> JournalWriter:
        """A writer to ``$ETCD_ELASTIC_JOURNAL``, or a no-op writer when it is unset."""
        values = os.environ if env is None else env
        return cls(values.get(JOURNAL_ENV) or None, src)

    @property
    def enabled(self) -> bool:
        """Whether :meth:`record` writes anything."""
        return self._fd is not None

    def record(self, event: str, **fields: Any) -> None:
        """Append one event with ``fields`` (JSON-serialisable; others become strings).

        Raises:
            TypeError: a field uses a reserved key (t, mono, src, pid, event).
        """
        fd = self._fd
        if fd is None:
            return
        clash = RESERVED_KEYS.intersection(fields)
        if clash:
            raise TypeError(f"history event {event!r}: fields {sorted(clash)} are reserved")
        line: dict[str, Any] = {
            "t": time.time(),
            "mono": time.monotonic(),
            "src": self._src,
            "pid": os.getpid(),
            "event": event,
        }
        line.update(fields)
        data = (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()
        try:
            written = os.write(fd, data)
            if written < len(data):
                # Only a full disk or a signal does this to a regular file; the rest still
                # goes out (the line may then interleave, and the reader says where).
                os.write(fd, data[written:])
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("history: cannot append to the history file: %s", exc)

    def close(self) -> None:
        """Close the file; later :meth:`record` calls do nothing. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_journal(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a history file, in file order (a missing file has none).

    A last line without its newline or not valid JSON (a torn write) is dropped.

    Raises:
        JournalError: an earlier line is not a JSON object; the message names the line.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    # After the last newline: empty, or a line whose writer did not finish.
    complete, tail = lines[:-1], lines[-1]
    events: list[dict[str, Any]] = []
    for number, raw in enumerate(complete, start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except ValueError as exc:
            if number == len(complete) and not tail:
                break  # torn last line that happens to end in a newline byte
            raise JournalError(f"{path}: line {number} is not JSON ({exc}): {raw[:200]!r}") from exc
        if not isinstance(value, dict):
            raise JournalError(f"{path}: line {number} is not a JSON object: {raw[:200]!r}")
        events.append(value)
    return events
