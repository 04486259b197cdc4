"""Issue 4's targets, checked against results: one line per target, met or missed by how much.

Pure: takes the result dicts the scenarios print, returns text.
"""

from __future__ import annotations

from typing import Any

__all__ = ["verdicts"]


def _entry(
    results: list[dict[str, Any]], scenario: str, system: str
) -> list[tuple[str, dict[str, Any]]]:
    return [
        (r["point"], r["systems"][system])
        for r in results
        if r["scenario"] == scenario and system in r["systems"]
    ]


def _check(label: str, value: float | None, limit: float, unit: str = "s") -> str:
    if value is None:
        return f"{label}: not measured"
    verdict = "met" if value <= limit else f"MISSED by {value - limit:.3g} {unit}"
    return f"{label}: {value:.3g} {unit} (target ≤ {limit:g} {unit}) — {verdict}"


def _nodes(point: str) -> int:
    return int(point.split("=")[1].split("+")[0].split(",")[0])


def verdicts(results: list[dict[str, Any]], ceiling: float | None, lease_ttl: int) -> list[str]:
    """Every target of issue 4 that the results can answer, as one line each."""
    lines: list[str] = []
    for point, ours in _entry(results, "formation", "etcd-v3"):
        n = _nodes(point)
        median = ours.get("median")
        if n == 32:
            lines.append(_check("formation N=32", median, 0.15))
        if n == 1000:
            lines.append(_check("formation N=1000", median, 3.0))
        ratio = ours.get("ratio_vs_torch_c10d")
        if n >= 32 and ratio is not None:
            verdict = "met" if ratio >= 10 else f"MISSED ({ratio:.3g}x, not 10x)"
            lines.append(f"formation N={n}: {ratio:.3g}x faster than c10d — {verdict}")
        figures = ours.get("figures", {})
        if "etcd_proposals" in figures:
            writes = figures["etcd_proposals"]
            lines.append(_check(f"etcd writes, N={n}", writes, 3 * n + 10, "writes"))
        if "etcd_failed_cas_estimate" in figures:
            failed = figures["etcd_failed_cas_estimate"]
            lines.append(_check(f"failed CAS, N={n}", failed, n, "txns"))
        if ceiling and median:
            lines.append(
                f"formation N={n}: {n} txns at the ceiling take {n / ceiling:.3g} s, "
                f"{100 * n / ceiling / median:.3g} % of the measured {median:.3g} s"
            )
    for _, ours in _entry(results, "scale-up", "etcd-v3"):
        lines.append(_check("scale-up", ours.get("median"), 0.5))
    for _, ours in _entry(results, "node-loss", "etcd-v3"):
        lines.append(
            _check(f"node loss (lease TTL {lease_ttl} s)", ours.get("median"), lease_ttl + 0.5)
        )
    for _, ours in _entry(results, "worker-failure", "etcd-v3"):
        lines.append(_check("worker failure", ours.get("median"), 2.0))
        ratio = ours.get("ratio_vs_torch_c10d")
        if ratio is not None:
            faster = "met" if ratio > 1 else "MISSED"
            lines.append(f"worker failure: {ratio:.3g}x torchrun's speed — {faster}")
    for _, ours in _entry(results, "idle", "etcd-v3"):
        figures = ours.get("figures", {})
        lines.append(
            _check(
                "idle CPU per node",
                figures.get("cpu_percent_of_core_per_node"),
                0.2,
                "% of a core",
            )
        )
        lines.append(
            _check(
                "idle etcd requests per node",
                figures.get("etcd_requests_per_s_per_node"),
                1.0,
                "req/s",
            )
        )
    return lines
