"""Pure helpers of the benchmarks: summaries, ratios, Prometheus counters, rank checks.

Nothing here does I/O or reads a clock, so every function is unit-tested without a server.
"""

from __future__ import annotations

import contextlib
import re
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence

__all__ = [
    "ETCD_COUNTERS",
    "Summary",
    "counter_delta",
    "counter_where",
    "etcd_activity",
    "parse_prometheus",
    "rank_problem",
    "ratio",
    "samples",
    "summarize",
]

Summary = dict[str, float | int | None]

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

# The etcd counters the benchmarks read, and what each one means for us:
# - proposals committed: every request that changes state goes through raft and is
#   fsynced (puts, deletes, transactions whether or not their compare held, lease grants
#   and revokes, v2 writes); this is the "etcd writes" figure, what costs disk.
# - current revision: one per transaction that changed a key (successful writes only).
# - events: watch events etcd sent to watchers.
# - messages received: gRPC unary requests plus every message on a stream (keep-alives,
#   watch creations); the "requests" figure of the idle scenario.
ETCD_COUNTERS = {
    "proposals": "etcd_server_proposals_committed_total",
    "revision": "etcd_debugging_mvcc_current_revision",
    "puts": "etcd_mvcc_put_total",
    "deletes": "etcd_mvcc_delete_total",
    "watch_events": "etcd_debugging_mvcc_events_total",
    "grpc_messages": "grpc_server_msg_received_total",
    "v2_writes": "etcd_debugging_store_writes_total",
    "v2_reads": "etcd_debugging_store_reads_total",
    "v2_watch_requests": "etcd_debugging_store_watch_requests_total",
    "lease_grants": "etcd_debugging_lease_granted_total",
    "lease_revokes": "etcd_debugging_lease_revoked_total",
}


def summarize(samples: Sequence[float]) -> Summary:
    """Return ``min``, ``median``, ``max`` and ``n`` of ``samples`` (``None`` when empty)."""
    if not samples:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {
        "min": min(samples),
        "median": statistics.median(samples),
        "max": max(samples),
        "n": len(samples),
    }


def ratio(torch_median: float | None, ours_median: float | None) -> float | None:
    """Torch's median over ours (> 1 means ours is faster); ``None`` if either is missing."""
    if torch_median is None or ours_median is None or ours_median <= 0:
        return None
    return torch_median / ours_median


def samples(text: str) -> Iterator[tuple[str, str, float]]:
    """Every sample of a Prometheus text page: its name, its labels' text (``""``
    without) and its value; lines that are comments or do not parse are skipped."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        yield match.group(1), (match.group(2) or "").strip("{}"), value


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum each metric of a Prometheus text page over its labels.

    Histogram and summary series keep their suffixed names (``_bucket``, ``_sum``,
    ``_count``); lines that are comments or do not parse are skipped.
    """
    totals: dict[str, float] = {}
    for name, _, value in samples(text):
        totals[name] = totals.get(name, 0.0) + value
    return totals


def counter_where(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in a Prometheus text page whose labels include
    ``labels`` (e.g. ``grpc_method="LeaseKeepAlive"``); 0 if there is none."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        found = dict(_LABEL.findall(match.group(2) or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            with contextlib.suppress(ValueError):
                total += float(match.group(3))
    return total


def counter_delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    """``after[name] - before[name]``, a missing counter counting as 0."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def etcd_activity(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """The change of every counter in :data:`ETCD_COUNTERS` between two scrapes.

    Adds ``failed_cas_estimate``: v3 proposals that changed no key and were no lease
    grant or revoke, i.e. write transactions whose compare failed (v3 only; etcd has no
    counter of its own for them).
    """
    activity = {
        key: round(counter_delta(before, after, metric)) for key, metric in ETCD_COUNTERS.items()
    }
    if activity["v2_writes"] == 0:
        activity["failed_cas_estimate"] = max(
            0,
            activity["proposals"]
            - activity["revision"]
            - activity["lease_grants"]
            - activity["lease_revokes"],
        )
    return activity


def rank_problem(ranks: Iterable[int], world_sizes: Iterable[int], expected: int) -> str | None:
    """Describe what is wrong with the ranks of a formed group, or ``None`` if nothing.

    A group of ``expected`` nodes is right when every node got ``world_size == expected``
    and the ranks are a permutation of ``0..expected-1``.
    """
    rank_list = sorted(ranks)
    sizes = sorted(set(world_sizes))
    if sizes != [expected]:
        return f"world sizes {sizes} reported, expected only {expected}"
    if rank_list != list(range(expected)):
        missing = sorted(set(range(expected)) - set(rank_list))
        dupes = sorted({r for r in rank_list if rank_list.count(r) > 1})
        return (
            f"ranks are not a permutation of 0..{expected - 1}: "
            f"{len(rank_list)} ranks, missing {missing[:10]}, duplicated {dupes[:10]}"
        )
    return None
