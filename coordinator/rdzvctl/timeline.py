"""``rdzvctl timeline RUN -o run.png``: a run's events as a picture.

Nodes on the y axis against time: each node's membership as a bar (joined -> departed),
each completed round as a shaded band with its number, each node's rank written where a
round starts, and faults marked (a worker failure's restart, a lease that expired, a
drain, a hang, a quarantine). :func:`prepare` turns the events into that picture's data
(pure, tested); :func:`draw` renders it with matplotlib, imported only here and only when
the command runs, so the rest of ``rdzvctl`` starts without it.

Time is the writers' wall clocks (each event's ``unix_ms``), relative to the first event:
good to a clock's skew between machines, which is why the order of ``rdzvctl events``
comes from etcd revisions instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.core.events import Event

__all__ = [
    "MARKS",
    "Band",
    "Mark",
    "Rank",
    "Span",
    "TimelineData",
    "draw",
    "prepare",
]

# Mark kinds, in legend order: (label, marker, colour).
MARKS: dict[str, tuple[str, str, str]] = {
    "restart": ("worker failure (counted restart)", "X", "#d62728"),
    "lease_expired": ("lease expired (node lost)", "o", "#000000"),
    "drain_requested": ("drain requested", ">", "#2ca02c"),
    "drained": ("drained (left)", "D", "#2ca02c"),
    "hung": ("hung", "v", "#9467bd"),
    "quarantined": ("quarantined", "s", "#8c564b"),
    "left": ("left", "|", "#7f7f7f"),
    "fault": ("fault", "*", "#ff7f0e"),
}


@dataclass(frozen=True)
class Span:
    """A node's membership: from its join to its departure (None: still there at the end)."""

    node: str
    start: float
    end: float | None


@dataclass(frozen=True)
class Band:
    """A completed round, from its completion to the next one's (or the close, or the end)."""

    round: int
    start: float
    end: float
    members: tuple[str, ...]


@dataclass(frozen=True)
class Mark:
    """A fault or departure on a node's row (``kind``: a key of :data:`MARKS`)."""

    node: str
    at: float
    kind: str
    label: str


@dataclass(frozen=True)
class Rank:
    """A node's group rank in a round, written where the round starts."""

    node: str
    at: float
    round: int
    rank: int


@dataclass(frozen=True)
class TimelineData:
    """What the picture shows; times are seconds after ``t0_ms``.

    Attributes:
        nodes: y axis, top to bottom, in the order they first joined (or appeared).
        end: the right edge (the last event, or the close).
        closed_at: when the run was closed (None: open).
        close_label: the close's mode and reason.
    """

    run_id: str
    t0_ms: int
    nodes: tuple[str, ...]
    spans: tuple[Span, ...]
    bands: tuple[Band, ...]
    marks: tuple[Mark, ...]
    ranks: tuple[Rank, ...]
    end: float
    closed_at: float | None
    close_label: str


def _mark_kind(event: Event) -> str | None:
    if event.kind == "restarted":
        return "restart"
    if event.kind == "drain_requested":
        return "drain_requested"
    if event.kind == "departed":
        return event.cause if event.cause in MARKS else "left"
    if event.kind == "fault":
        return event.cause if event.cause in MARKS else "fault"
    return None


def prepare(run_id: str, events: Sequence[Event]) -> TimelineData:
    """The picture's data from ``events`` in timeline order (pure).

    Raises:
        ValueError: ``events`` is empty, or none has a wall time.
    """
    timed = [e for e in events if e.unix_ms > 0]
    if not timed:
        raise ValueError(f"run {run_id!r} has no events with a time to draw")
    t0 = min(e.unix_ms for e in timed)

    def at(event: Event) -> float:
        return (event.unix_ms - t0) / 1000

    end = max(at(e) for e in timed)
    nodes: list[str] = []
    open_since: dict[str, float] = {}
    spans: list[Span] = []
    marks: list[Mark] = []
    ranks: list[Rank] = []
    rounds: list[tuple[int, float, tuple[str, ...]]] = []
    closed_at: float | None = None
    close_label = ""

    def appear(node: str, when: float) -> None:
        if node not in nodes:
            nodes.append(node)
        open_since.setdefault(node, when)

    for event in timed:
        when = at(event)
        if event.kind == "joined":
            appear(event.node_id, when)
        elif event.kind == "round_completed":
            rounds.append((event.round, when, event.members))
            for rank, node in enumerate(event.members):
                appear(node, when)
                ranks.append(Rank(node, when, event.round, rank))
        elif event.kind == "closed":
            closed_at = when if closed_at is None else closed_at
            close_label = f"closed ({event.close_mode})"
        if event.node_id and event.kind in ("restarted", "drain_requested", "fault"):
            appear(event.node_id, when)
        kind = _mark_kind(event)
        if kind is not None:
            label = event.summary or event.cause or event.kind
            marks.append(Mark(event.node_id, when, kind, label))
        if event.kind == "departed":
            start = open_since.pop(event.node_id, None)
            if event.node_id not in nodes:
                nodes.append(event.node_id)
            spans.append(Span(event.node_id, when if start is None else start, when))
    spans.extend(Span(node, start, None) for node, start in open_since.items())
    bands = []
    for i, (number, start, members) in enumerate(rounds):
        stop = rounds[i + 1][1] if i + 1 < len(rounds) else (closed_at or end)
        bands.append(Band(number, start, max(stop, start), members))
    return TimelineData(
        run_id=run_id,
        t0_ms=t0,
        nodes=tuple(nodes),
        spans=tuple(spans),
        bands=tuple(bands),
        marks=tuple(marks),
        ranks=tuple(ranks),
        end=end,
        closed_at=closed_at,
        close_label=close_label,
    )


def _spaced(ranks: Sequence[Rank], gap: float) -> list[Rank]:
    """The rank labels to write: on each row, one that the next label on the same row
    would overlap (rounds a moment apart) gives way to it."""
    kept: list[Rank] = []
    for i, rank in enumerate(ranks):
        later = (r for r in ranks[i + 1 :] if r.node == rank.node)
        following = next(later, None)
        if following is None or following.at - rank.at >= gap:
            kept.append(rank)
    return kept


def draw(data: TimelineData, path: str) -> None:
    """Render ``data`` to ``path`` (.png, .svg or .pdf).

    Raises:
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = {node: i for i, node in enumerate(data.nodes)}
    right = max(data.end, 1.0) * 1.03
    height = 1.4 + 0.6 * max(len(data.nodes), 1)
    fig, ax = plt.subplots(figsize=(12, height))
    shades = ("#dbe9f6", "#ececec")
    top = -1.0  # the row above the nodes holds the round numbers
    for i, band in enumerate(data.bands):
        ax.axvspan(band.start, band.end, color=shades[i % 2], zorder=0)
        wide = band.end - band.start > right * 0.07
        ax.text(
            (band.start + band.end) / 2, top + 0.3,
            f"round {band.round}" if wide else str(band.round),
            ha="center", va="center", fontsize=9, color="#333333",
        )  # fmt: skip
    for span in data.spans:
        stop = right if span.end is None else span.end
        ax.barh(
            rows[span.node], max(stop - span.start, right / 400), left=span.start,
            height=0.36, color="#4c78a8", zorder=2,
        )  # fmt: skip
    for rank in _spaced(data.ranks, right * 0.06):
        ax.text(
            rank.at + right / 300, rows[rank.node] + 0.21, f"rank {rank.rank}",
            fontsize=7, color="#1f3b5c", va="top", zorder=4,
        )  # fmt: skip
    used: list[str] = []
    for mark in data.marks:
        if mark.node not in rows:
            continue
        label, marker, colour = MARKS[mark.kind]
        # A request is drawn just above its node's bar: the departure it leads to often
        # lands within the same second, on the bar itself.
        where = ([mark.at], [rows[mark.node] - (0.3 if mark.kind == "drain_requested" else 0)])
        if marker == "|":
            ax.scatter(*where, marker=marker, s=200, color=colour, zorder=5)
        else:
            ax.scatter(
                *where, marker=marker, s=110, color=colour, edgecolors="white",
                linewidths=0.8, zorder=5,
            )  # fmt: skip
        if mark.kind not in used:
            used.append(mark.kind)
    bottom = len(data.nodes) - 0.35
    if data.closed_at is not None:
        ax.axvline(data.closed_at, color="#000000", linestyle="--", linewidth=1, zorder=3)
        ax.text(
            data.closed_at - right / 300, bottom - 0.05, data.close_label,
            fontsize=8, va="bottom", ha="right",
        )  # fmt: skip
    ax.set_yticks(range(len(data.nodes)), labels=list(data.nodes), fontsize=8)
    ax.set_ylim(bottom, top)
    ax.set_xlim(0, right)
    ax.set_xlabel("seconds since the first event (writers' wall clocks)")
    ax.set_title(f"run {data.run_id}: membership, rounds and faults", fontsize=11)
    ax.grid(axis="x", color="#cccccc", linewidth=0.5, zorder=1)
    handles: list[Line2D | Patch] = [
        Patch(color="#4c78a8", label="node in the run (joined → departed)"),
        Patch(color=shades[0], label="completed round (shades alternate)"),
    ]
    for kind in (k for k in MARKS if k in used):
        label, marker, colour = MARKS[kind]
        handles.append(
            Line2D([], [], marker=marker, color=colour, linestyle="", markersize=9, label=label)
        )
    if data.closed_at is not None:
        handles.append(Line2D([], [], color="#000000", linestyle="--", label="run closed"))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.4 / height),
        ncol=3, fontsize=8, frameon=False,
    )  # fmt: skip
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
