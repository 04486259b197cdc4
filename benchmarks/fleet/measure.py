"""One measured phase: etcd's counters before and after, where the CPU went, and a
poller of etcd's lease expiries (when did etcd revoke the last lease of the dead?).

Where the CPU went says who limited a phase on this machine: the hosts (the simulated
agents: the harness itself), etcd, or something else on the machine (other work: the
machine is shared). ``bound`` names the first when the machine was busy for at least
90 % of the window on every core; else ``waits`` (nobody was short of CPU: the phase
waited on timers, leases, fsync).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.fleet.etcd_metrics import Reading, change, scrape
from benchmarks.fleet.fleet import Fleet
from coordinator.etcd_server import EtcdCluster

__all__ = [
    "ExpiryPoller",
    "Measurer",
    "PhaseResult",
    "cpu_bound",
    "machine_ticks",
    "quiesce",
    "training_seconds",
]


@dataclass
class PhaseResult:
    """One phase: etcd's counts, the times measured, where the CPU went."""

    phase: str
    nodes: int
    window_s: float
    etcd: dict[str, float]
    times: dict[str, float] = field(default_factory=dict)
    harness: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    began: float = 0.0
    """``time.monotonic()`` at the first reading (not in the JSON)."""
    ended: float = 0.0
    """``time.monotonic()`` at the last reading (not in the JSON)."""

    def as_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "nodes": self.nodes,
            "window_s": round(self.window_s, 4),
            "etcd": {k: round(v, 4) for k, v in sorted(self.etcd.items())},
            "times": {k: round(v, 4) for k, v in sorted(self.times.items())},
            "harness": self.harness,
            "notes": self.notes,
        }


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return total - idle, total


def cpu_bound(
    window_s: float, cores: int, busy_cores: float, hosts_cores: float, etcd_cores: float
) -> str:
    """Who limited the phase: ``hosts`` (the harness), ``etcd``, ``other`` (the rest of
    the machine), or ``waits`` when the machine was not busy (see the module docstring)."""
    if window_s <= 0 or busy_cores < 0.9 * cores:
        return "waits"
    other = max(0.0, busy_cores - hosts_cores - etcd_cores)
    shares = {"hosts": hosts_cores, "etcd": etcd_cores, "other": other}
    return max(shares, key=lambda k: shares[k])


def training_seconds(
    starts: Sequence[float], stops: Sequence[float], dead_at: float | None, t0: float, t1: float
) -> float:
    """Seconds within ``[t0, t1]`` that one agent's workers ran: each start runs until the
    next stop after it, the agent's death (``dead_at``), or ``t1``."""
    total = 0.0
    ordered_stops = sorted(stops)
    for start in sorted(starts):
        end = next((s for s in ordered_stops if s >= start), t1)
        if dead_at is not None:
            end = min(end, dead_at)
        total += max(0.0, min(end, t1) - max(start, t0))
    return total


@dataclass(frozen=True)
class _Open:
    reading: Reading
    hosts_cpu: float
    ticks: tuple[int, int]
    t: float


class Measurer:
    """Opens and closes the window of each phase of one fleet on one cluster."""

    def __init__(self, cluster: EtcdCluster, fleet: Fleet) -> None:
        self._cluster = cluster
        self._fleet = fleet
        self._cores = max(1, _cores())

    def begin(self) -> _Open:
        return _Open(
            scrape(self._cluster), self._fleet.cpu_seconds(), machine_ticks(), time.monotonic()
        )

    def end(
        self,
        opened: _Open,
        phase: str,
        nodes: int,
        times: Mapping[str, float],
        notes: Sequence[str] = (),
        *,
        hosts_cpu_lost: float = 0.0,
    ) -> PhaseResult:
        """Close the window opened by :meth:`begin`. ``hosts_cpu_lost``: CPU of hosts
        killed during the window that the first reading counted (they left /proc)."""
        after = scrape(self._cluster)
        t = time.monotonic()
        busy, total = machine_ticks()
        window = t - opened.t
        etcd = change(opened.reading, after)
        hosts = max(0.0, self._fleet.cpu_seconds() - opened.hosts_cpu + hosts_cpu_lost)
        ticks = total - opened.ticks[1]
        busy_cores = self._cores * (busy - opened.ticks[0]) / ticks if ticks > 0 else 0.0
        etcd_cores = etcd.get("etcd_cpu_s", 0.0) / window if window > 0 else 0.0
        hosts_cores = hosts / window if window > 0 else 0.0
        harness = {
            "hosts_cpu_s": round(hosts, 3),
            "hosts_cores": round(hosts_cores, 3),
            "etcd_cores": round(etcd_cores, 3),
            "machine_busy_cores": round(busy_cores, 3),
            "cores": self._cores,
            "bound": cpu_bound(window, self._cores, busy_cores, hosts_cores, etcd_cores),
            "host_threads": self._fleet.threads(),
        }
        return PhaseResult(
            phase, nodes, window, etcd, dict(times), harness, list(notes), began=opened.t, ended=t
        )


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_EXPIRED = "etcd_debugging_server_lease_expired_total"
_WRITES = "etcd_server_proposals_committed_total"


def _leader_writes(cluster: EtcdCluster) -> float:
    reading = scrape(cluster)
    return reading.at_leader(_WRITES)


def quiesce(
    cluster: EtcdCluster, quiet_s: float = 2.0, bound_s: float = 120.0, poll_s: float = 0.5
) -> tuple[float, float]:
    """Wait until etcd commits nothing for ``quiet_s`` (at most ``bound_s``), so that
    what a job does after its end lands in no later window; returns (seconds waited,
    writes committed meanwhile). Reads ``/metrics`` only."""
    started = time.monotonic()
    first = last = _leader_writes(cluster)
    still_since = started
    while time.monotonic() - started < bound_s:
        time.sleep(poll_s)  # etcd's counters move on etcd's clock: nothing to wait on
        now = _leader_writes(cluster)
        if now != last:
            last, still_since = now, time.monotonic()
        elif time.monotonic() - still_since >= quiet_s:
            break
    return time.monotonic() - started, last - first


class ExpiryPoller:
    """Reads the leader's count of expired leases every ``interval`` seconds, so that
    the moment etcd revoked the last lease of a loss is known to within one interval.

    Reads ``/metrics`` (HTTP): no gRPC request, nothing in any count.
    """

    def __init__(self, cluster: EtcdCluster, interval: float = 0.1) -> None:
        leader = scrape(cluster).leader
        self._url = f"{cluster.members[leader].probe_url}/metrics"
        self._interval = interval
        self._samples: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expiry-poller", daemon=True)

    def __enter__(self) -> ExpiryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _read(self) -> float | None:
        try:
            with urllib.request.urlopen(self._url, timeout=2.0) as rsp:
                text = rsp.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(_EXPIRED + " "):
                return float(line.split()[1])
        return None

    def _run(self) -> None:
        while True:
            value = self._read()
            if value is not None:
                with self._lock:
                    self._samples.append((time.monotonic(), value))
            if self._stop.wait(self._interval):
                return

    def expired_since_start(self) -> float:
        with self._lock:
            if not self._samples:
                return 0.0
            return self._samples[-1][1] - self._samples[0][1]

    def last_expiry(self) -> float | None:
        """The moment of the last expiry seen (the last sample before the count reached
        its latest value: the expiry happened after it, within one interval), or None."""
        with self._lock:
            samples = list(self._samples)
        if not samples or samples[-1][1] == samples[0][1]:
            return None
        final = samples[-1][1]
        before = [t for t, v in samples if v < final]
        return before[-1] if before else samples[0][0]
