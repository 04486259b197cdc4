"""The recovery scenario's result as a Markdown table (what ``python -m benchmarks
recovery`` prints without ``--json``, and what docs/performance.md shows). Pure."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown"]

_COLUMNS = (
    ("detect", "detect"),
    ("rendezvous", "rendezvous"),
    ("spawn", "spawn"),
    ("import", "import"),
    ("process_group", "process group"),
    ("checkpoint", "checkpoint"),
    ("first_step", "first step"),
)


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _row(key: str, entry: dict[str, Any]) -> str:
    if entry["median"] is None:
        error = entry["errors"][0].splitlines()[0] if entry["errors"] else "no run"
        return f"| ({key}) | {entry['name']} | {error} |" + " |" * (len(_COLUMNS) + 2)
    parts = entry["breakdown"]
    spread = f"{_s(entry['median'])} ({_s(entry['min'])}-{_s(entry['max'])})"
    if "detect_rendezvous_spawn" in parts:
        cells = [f"{_s(parts['detect_rendezvous_spawn'])} (all three)", "", ""]
        cells += [_s(parts.get(name)) for name, _ in _COLUMNS[3:]]
    else:
        cells = [_s(parts.get(name)) for name, _ in _COLUMNS]
    restarts = ",".join(str(r) for r in entry["restarts"])
    failed = f"; {len(entry['errors'])} failed" if entry["errors"] else ""
    return (
        f"| ({key}) | {entry['name']} | {spread} | "
        + " | ".join(cells)
        + f" | {restarts}{failed} |"
    )


def markdown(result: dict[str, Any]) -> str:
    """Per case: each system's median total (min-max), the median breakdown and restarts,
    then a line per case with the target and whether ours met it."""
    header = (
        "| case | system | failure → first step, s (min-max) | "
        + " | ".join(title for _, title in _COLUMNS)
        + " | restarts |"
    )
    lines = [header, "|" + "---|" * (len(_COLUMNS) + 4)]
    verdicts: list[str] = []
    for key, case in result["cases"].items():
        for entry in case["systems"].values():
            lines.append(_row(key, entry))
        target = case["target"]
        ours = case["systems"].get("etcd-v3", {})
        speedup = ours.get("ratio_vs_torch_c10d")
        faster = "" if speedup is None else f"; {speedup:.1f}x faster than torchrun"
        verdict = {True: "met", False: f"MISSED: {target['missed_by']}", None: "not measured"}
        verdicts.append(
            f"- ({key}) {case['title']}: target {target['target']}; ours "
            f"{_s(ours.get('median'))} s{faster}: {verdict[target['met']]}"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(verdicts)
