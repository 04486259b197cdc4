"""The cost model: per phase, etcd's requests and bytes as formulas in N, fitted to the
fleet's measured points, projected to 10,000 agents, and the lease TTL to use by size.

Pure: takes the runs' JSON data, returns numbers and text.

**A phase's own cost.** A phase's window also holds the training that goes on meanwhile
(the survivors of a node loss train until they hear of it). That part is taken out: the
steady window of the same size gives each figure's rate per node-second of training, and
each phase's figure minus that rate times the phase's ``training_node_s`` (the seconds
each agent's workers ran in the window, summed) is the phase's own cost. Lease renewals
are only background (every live lease, whatever happens): they are modelled from the
steady window alone.

A phase in which leases of live agents expired (:func:`disturbed`: the simulated agents'
host starved their keep-alives) is not fitted.

A run whose stand-in workers report no progress (``step_s`` 0: what fits a thousand
agents on two cores today) gives no point for the steady window's writes and bytes,
which are the agents' progress records.

**The fit.** A figure whose cost per node more than doubles from the smallest size to the
largest (N grew tenfold or more) is superlinear: it is fitted as ``a + b·N + c·N²``
through the smallest, a middle and the largest size (``b·N + c·N²`` through both when
only two were measured), which says how fast it grows between the sizes measured, not
why. Every other figure is fitted as ``a + b·N`` by least squares weighted by the points'
size (each point counts for its relative error, so N = 10 weighs as much as N = 1000);
``miss`` is the largest relative distance of a point from its fit (noise, for the small
counts).

Lease renewals are fitted per TTL: ``k·N`` renewals per TTL, so ``k·N / TTL`` a second.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FIGURES",
    "PHASES",
    "Fit",
    "disturbed",
    "fit",
    "phase_points",
    "project",
    "renewals_per_ttl",
    "ttl_advice",
]

PHASES = (
    "formation",
    "steady",
    "worker-failure",
    "hang",
    "node-loss",
    "half-lost",
    "job-lost",
    "job-end",
    "formation-preflight",
)
# figure -> what it is, in the tables.
FIGURES = {
    "writes": "writes (raft proposals)",
    "rpc_Range": "range reads",
    "rpc_Txn": "transactions",
    "watch_events": "watch events",
    "bytes_put": "bytes put",
    "keepalives": "lease renewals",
}
_BACKGROUND = ("writes", "rpc_Range", "rpc_Txn", "watch_events", "bytes_put")
_SUPERLINEAR_GROWTH = 2.0  # cost per node, largest size over smallest


@dataclass(frozen=True)
class Fit:
    """``a + b·N + c·N²`` (``c`` is 0 for a line), and the largest relative miss."""

    a: float
    b: float
    c: float
    miss: float

    def at(self, n: float) -> float:
        """The cost at ``n`` (a count: never below 0)."""
        return max(0.0, self.a + self.b * n + self.c * n * n)

    @property
    def superlinear(self) -> bool:
        return self.c != 0.0

    def formula(self) -> str:
        terms = []
        if self.c:
            terms.append(f"{_num(self.c)}·N²")
        if self.b:
            terms.append(f"{_num(self.b)}·N")
        if self.a or not terms:
            terms.append(_num(self.a))
        return " + ".join(terms).replace("+ -", "- ")


def _num(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.3g}"
    return f"{value:.2g}"


def _weighted_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    weights = [1.0 / max(abs(v), 1.0) ** 2 for _, v in points]
    sw = sum(weights)
    sx = sum(w * n for w, (n, _) in zip(weights, points, strict=True))
    sy = sum(w * v for w, (_, v) in zip(weights, points, strict=True))
    sxx = sum(w * n * n for w, (n, _) in zip(weights, points, strict=True))
    sxy = sum(w * n * v for w, (n, v) in zip(weights, points, strict=True))
    det = sw * sxx - sx * sx
    if det == 0:
        return sy / sw, 0.0
    b = (sw * sxy - sx * sy) / det
    return (sy - b * sx) / sw, b


def _miss(points: Sequence[tuple[float, float]], a: float, b: float, c: float) -> float:
    misses = [abs(a + b * n + c * n * n - v) / max(abs(v), 1.0) for n, v in points]
    return max(misses, default=0.0)


def _by_size(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    sizes = sorted({n for n, _ in points})
    return [(n, statistics.fmean(v for m, v in points if m == n)) for n in sizes]


def _superlinear(sized: Sequence[tuple[float, float]]) -> bool:
    (n0, v0), (n1, v1) = sized[0], sized[-1]
    if n0 <= 0 or n1 < 10 * n0 or v1 <= 0:
        return False
    return (v1 / n1) > _SUPERLINEAR_GROWTH * max(v0 / n0, 1e-9)


def fit(points: Sequence[tuple[float, float]]) -> Fit:
    """The model of one figure from its ``(N, value)`` points (see the module docstring)."""
    if not points:
        return Fit(0.0, 0.0, 0.0, 0.0)
    sized = _by_size(points)
    if len(sized) == 1:
        n, v = sized[0]
        return Fit(0.0, v / n if n else 0.0, 0.0, 0.0)
    if _superlinear(sized):
        if len(sized) == 2:
            (x0, y0), (x1, y1) = sized
            c = (y1 / x1 - y0 / x0) / (x1 - x0)
            b = y0 / x0 - c * x0
            return Fit(0.0, b, c, _miss(points, 0.0, b, c))
        (x0, y0), (x1, y1), (x2, y2) = sized[0], sized[len(sized) // 2], sized[-1]
        d1 = (y1 - y0) / (x1 - x0)
        d2 = (y2 - y1) / (x2 - x1)
        c = (d2 - d1) / (x2 - x0)
        if c > 0:
            b = d1 - c * (x0 + x1)
            a = y0 - b * x0 - c * x0 * x0
            return Fit(a, b, c, _miss(points, a, b, c))
    a, b = _weighted_line(points)
    return Fit(a, b, 0.0, _miss(points, a, b, 0.0))


def _steady_rates(run: Mapping[str, Any]) -> dict[str, float]:
    """Each figure per node-second of training, from the run's steady window."""
    for phase in run["phases"]:
        if phase["phase"] == "steady":
            node_s = phase["times"].get("training_node_s") or phase["nodes"] * phase["window_s"]
            return {k: phase["etcd"].get(k, 0.0) / node_s for k in (*_BACKGROUND, "keepalives")}
    return {}


def disturbed(phase: Mapping[str, Any]) -> int:
    """How many leases of live agents expired in the phase (0: none): the agents whose
    host starved their keep-alives lost their lease and joined again, so the phase
    measured the harness's overload as much as the protocol; such a phase is shown but
    not fitted."""
    expired = int(phase["etcd"].get("lease_expired", 0))
    if phase["phase"] == "job-lost":
        return max(0, expired - int(phase["nodes"]))
    return max(0, expired - int(phase["times"].get("killed", 0)))


def own_cost(phase: Mapping[str, Any], rates: Mapping[str, float], figure: str) -> float:
    """The phase's own cost of ``figure`` (see the module docstring); the steady window
    is given per second."""
    raw = float(phase["etcd"].get(figure, 0.0))
    if phase["phase"] == "steady":
        return raw / float(phase["window_s"])
    if figure not in _BACKGROUND:
        return raw
    training = float(phase["times"].get("training_node_s", 0.0))
    return max(0.0, raw - rates.get(figure, 0.0) * training)


def phase_points(
    runs: Sequence[Mapping[str, Any]],
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """phase -> figure -> ``(N, own cost)`` points: one per run, phase and size of the
    job at the phase's start (a phase measured several times at one size, such as
    formation, gives the median)."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for run in runs:
        rates = _steady_rates(run)
        groups: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
        for phase in run["phases"]:
            if not disturbed(phase):
                groups.setdefault((phase["phase"], int(phase["nodes"])), []).append(phase)
        silent = float(run["options"].get("step_s", 1.0)) <= 0
        ttl = float(run["options"]["lease_ttl"])
        for (name, n), phases in groups.items():
            for figure in FIGURES:
                if figure == "keepalives" and name != "steady":
                    continue
                if silent and name == "steady" and figure in ("writes", "bytes_put"):
                    continue  # its workers reported no progress: nothing to publish
                value = statistics.median(own_cost(p, rates, figure) for p in phases)
                if figure == "keepalives":
                    value *= ttl  # renewals per TTL: the same at every TTL
                out.setdefault(name, {}).setdefault(figure, []).append((float(n), value))
    return out


def renewals_per_ttl(runs: Sequence[Mapping[str, Any]]) -> float:
    """Lease renewals per lease per TTL (3 for a renewal every TTL/3), the median over
    the runs' steady windows (0 without one): a node renews ``k / TTL`` times a second."""
    measured = [
        phase["etcd"].get("keepalives", 0.0)
        / phase["window_s"]
        / phase["nodes"]
        * float(run["options"]["lease_ttl"])
        for run in runs
        for phase in run["phases"]
        if phase["phase"] == "steady" and phase["nodes"]
    ]
    return statistics.median(measured) if measured else 0.0


def project(
    fits: Mapping[str, Mapping[str, Fit]],
    renewal: float,
    nodes: int,
    ttls: Sequence[int],
    ceiling: float | None,
) -> list[dict[str, Any]]:
    """Rows of the projection to ``nodes`` agents at each lease TTL: renewals per second,
    the time to notice a lost node, etcd's own time to revoke a whole job's leases (at its
    limit of about 1,000 a second; 750 after a leader change), and each phase's writes
    and the time they take at the measured ceiling (``ceiling`` txn/s)."""
    rows = []
    for ttl in ttls:
        renewals = renewal / ttl * nodes
        row: dict[str, Any] = {
            "ttl_s": ttl,
            "renewals_per_s": renewals,
            "vs_1500": renewals / 1500.0,
            "lost_node_noticed_s": float(ttl),
            "whole_job_revoked_s": nodes / 1000.0,
            "after_leader_change_s": nodes / 750.0,
        }
        rows.append(row)
    for row in rows:
        for phase, figures in fits.items():
            if "writes" in figures:
                writes = figures["writes"].at(nodes)
                row[f"{phase}_writes"] = writes
                if ceiling:
                    row[f"{phase}_writes_at_ceiling_s"] = writes / ceiling
    return rows


def ttl_advice(
    renewal: float, budget: float = 1000.0, ttls: Sequence[int] = (5, 10, 15)
) -> list[tuple[int, int]]:
    """(TTL, the most nodes on one etcd that keep renewals at or under ``budget`` a
    second), from the measured renewals per lease per TTL (:func:`renewals_per_ttl`)."""
    out = []
    for ttl in ttls:
        rate = renewal / ttl
        out.append((ttl, int(budget / rate) if rate > 0 else 0))
    return out
