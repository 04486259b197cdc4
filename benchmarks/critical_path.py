"""Where a formation's time goes: the critical path, from stamps the node processes take.

A formation of N nodes is three stretches end to end: every node writes its key (a lease
grant, then a put), the coordinator hears the last join and commits the round, and every
node hears the commit and returns. The node processes stamp each of these
(``time.monotonic()``, system-wide on Linux) with :class:`StampingClient`, our etcd
client with the three calls timed; the harness asks each process for its stamps after
the measured step (:func:`process_report`) and puts them together (:func:`combine`).

It also reports the CPU seconds of the coordinator's thread in the measured step (the
one that committed: the most of any ``rdzv-coordinator`` thread) and of the watch
dispatcher of its process (which decodes every node key the coordinator hears of): the
coordinator's work per formation, which the machine's load inflates much less than the
wall time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.core.etcd_client import EtcdClient, TxnResult

__all__ = [
    "StampingClient",
    "combine",
    "describe",
    "path_of",
    "process_report",
    "thread_cpu_by_id",
]

_lock = threading.Lock()
_stamps: dict[str, list[tuple[float, float]]] = {}


def _record(kind: str, start: float) -> None:
    end = time.monotonic()
    with _lock:
        _stamps.setdefault(kind, []).append((start, end))


class StampingClient(EtcdClient):
    """Our etcd client, stamping the start and end of lease grants, node-key puts and
    state commits (process-wide: every simulated node of a process shares the record)."""

    def lease_grant_at(self, ttl: int) -> tuple[int, int]:
        start = time.monotonic()
        granted = super().lease_grant_at(ttl)
        _record("lease_grant", start)
        return granted

    def put_created(self, *args: Any, **kwargs: Any) -> int:
        start = time.monotonic()
        revision = super().put_created(*args, **kwargs)
        _record("node_key", start)
        return revision

    def put_if_mod_revision(self, *args: Any, **kwargs: Any) -> TxnResult:
        start = time.monotonic()
        result = super().put_if_mod_revision(*args, **kwargs)
        _record("commit" if result.succeeded else "failed_commit", start)
        return result


def thread_cpu_by_id() -> dict[int, tuple[str, float]]:
    """CPU seconds of each live thread of this process, with its name (from the
    scheduler's nanosecond count, ``/proc/self/task/TID/schedstat``: a thread that ran
    for a few milliseconds shows, which the 10 ms clock ticks of ``stat`` would not)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, tuple[str, float]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            ran_ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        tid = int(task.name)
        out[tid] = (names.get(tid, "other"), ran_ns / 1e9)
    return out


def process_report(since: float, cpu_before: dict[int, tuple[str, float]]) -> dict[str, Any]:
    """This process's stamps at or after ``since`` and its threads' CPU since ``cpu_before``.

    Returns a JSON-able dict: per kind, ``count``, ``first_start``, ``last_end`` (and for
    ``commit`` every ``[start, end]``); ``coordinator_cpu_s`` (the busiest
    ``rdzv-coordinator`` thread), ``watch_cpu_s`` (the ``etcd-watch`` threads).
    """
    with _lock:
        stamps = {k: [s for s in v if s[0] >= since] for k, v in _stamps.items()}
    report: dict[str, Any] = {}
    for kind, spans in stamps.items():
        if spans:
            report[kind] = {
                "count": len(spans),
                "first_start": min(s for s, _ in spans),
                "last_end": max(e for _, e in spans),
            }
    if stamps.get("commit"):
        report["commit"]["spans"] = sorted(stamps["commit"])
    coordinator, watch = 0.0, 0.0
    for tid, (name, cpu) in thread_cpu_by_id().items():
        delta = cpu - cpu_before.get(tid, (name, 0.0))[1]
        if name == "rdzv-coordinator":
            coordinator = max(coordinator, delta)
        elif name == "etcd-watch":
            watch += delta
    report["coordinator_cpu_s"] = coordinator
    report["watch_cpu_s"] = watch
    return report


def combine(
    at: float, t_ends: Sequence[float], reports: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """The critical path of one formation, in seconds after the common start ``at``.

    ``cp_last_key_s``: the last node key written (its put answered); ``cp_commit_s``: the
    round's commit answered (``cp_commit_sent_s``: sent), the last commit if there were
    several; ``cp_first_return_s`` / ``cp_last_return_s``: nodes returning from
    ``next_rendezvous()``; ``cp_last_lease_s``: the last lease granted. CPU of the
    committing process's coordinator and watch threads as ``coordinator_cpu_s`` and
    ``coordinator_watch_cpu_s``. Stamps that no process took are left out.
    """
    out: dict[str, float] = {}

    def latest(kind: str) -> float | None:
        ends = [r[kind]["last_end"] for r in reports if kind in r]
        return max(ends) - at if ends else None

    for kind, name in (("lease_grant", "cp_last_lease_s"), ("node_key", "cp_last_key_s")):
        value = latest(kind)
        if value is not None:
            out[name] = value
    commits = [(s, e, r) for r in reports if "commit" in r for s, e in r["commit"]["spans"]]
    if commits:
        start, end, leader = max(commits, key=lambda c: c[1])
        out["cp_commit_sent_s"] = start - at
        out["cp_commit_s"] = end - at
        out["commits"] = float(len(commits))
        out["coordinator_cpu_s"] = float(leader["coordinator_cpu_s"])
        out["coordinator_watch_cpu_s"] = float(leader["watch_cpu_s"])
    failed = sum(r["failed_commit"]["count"] for r in reports if "failed_commit" in r)
    if failed:
        out["failed_commits"] = float(failed)
    if t_ends:
        out["cp_first_return_s"] = min(t_ends) - at
        out["cp_last_return_s"] = max(t_ends) - at
    return out


_PATH_KEYS = (
    "cp_last_lease_s",
    "cp_last_key_s",
    "cp_commit_sent_s",
    "cp_commit_s",
    "cp_first_return_s",
    "cp_last_return_s",
    "coordinator_cpu_s",
    "coordinator_watch_cpu_s",
    "commits",
    "failed_commits",
)


def path_of(figures: dict[str, float]) -> dict[str, float]:
    """The critical-path part of one run's figures (rounded to 0.1 ms)."""
    return {k: round(figures[k], 4) for k in _PATH_KEYS if k in figures}


def describe(path: dict[str, float]) -> str:
    """One line for the text output: ``last key 1.20 s → commit 1.25 s → ...``."""

    def at(key: str) -> str:
        return f"{path[key]:.3f} s" if key in path else "-"

    line = (
        f"last key {at('cp_last_key_s')} -> commit {at('cp_commit_s')} "
        f"(sent {at('cp_commit_sent_s')}) -> last node back {at('cp_last_return_s')} "
        f"(first {at('cp_first_return_s')})"
    )
    if "coordinator_cpu_s" in path:
        line += (
            f"; coordinator thread CPU {path['coordinator_cpu_s']:.3f} s, its process's "
            f"watch thread {path.get('coordinator_watch_cpu_s', 0.0):.3f} s"
        )
    return line
