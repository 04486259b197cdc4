"""The pre-flight check's decisions (``etcdrun --health-check``), pure: which pairs of
nodes measure their link and in which order, how a node's result is written, and which
nodes are left out.

Each node of a new round runs a short check in a subprocess
(:mod:`agent.health.check_worker`): its devices answer, a small matmul, and timed
all_reduces with its two neighbours on the ring of group ranks. The nodes exchange their
:class:`NodeResult` through the round's store and every node judges them the same way
with :func:`judge`. A node **fails** when:

* its check raised, timed out or sent no result (``error``);
* its matmul took more than ``factor`` times the reference **and** more than ``floor_s``
  seconds above it (the reference is the lower median of the nodes' matmul times:
  with two nodes, the faster one);
* its **best** pair was that slow compared with the lower median of every node's best
  pair, or every pair it was in failed while others' did not. A slow link shows in both
  of its nodes; a slow node shows in *all* of its pairs, so a node is blamed only when
  even its fastest pair is slow. With two nodes there is one pair and no one to blame:
  only the matmul and errors can leave one of two out.

Why ``factor`` 3 and ``floor_s`` 0.5 s: the check's work takes milliseconds, so on a
loaded host scheduling noise alone can make one node's time several times another's;
the floor keeps that noise from quarantining a healthy node, and the factor keeps a
node that is merely busier than the others in. What the check catches is gross: a
device that does not answer, a node swapping or throttled to a crawl, a link that drops
or is an order of magnitude slow; not a 20 % slowdown.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "NodeResult",
    "NodeVerdict",
    "PairTime",
    "Thresholds",
    "Verdict",
    "decode_result",
    "encode_result",
    "judge",
    "pair_schedule",
    "pairs_of",
]


@dataclass(frozen=True)
class Thresholds:
    """How much slower than the others a node may be (see the module docstring)."""

    factor: float = 3.0
    floor_s: float = 0.5

    def slow(self, seconds: float, reference: float) -> bool:
        """Whether ``seconds`` is much slower than ``reference``."""
        return seconds > self.factor * reference and seconds - reference > self.floor_s


@dataclass(frozen=True)
class PairTime:
    """One node's measure of one pair: ``seconds`` of the timed all_reduces (None: the
    pair failed, ``error`` says how)."""

    peer: int
    seconds: float | None
    error: str = ""


@dataclass(frozen=True)
class NodeResult:
    """What one node's check found.

    Attributes:
        group_rank, node_id, addr: who (the address tells nodes of one host apart only
            with the node id, which holds the pid).
        error: why the check did not complete ("" if it did).
        devices: what answered, e.g. ``cpu`` or ``cuda x8``.
        matmul_s: seconds of the timed matmuls (None: not measured).
        pairs: this node's measure of each of its pairs.
        took_s: the whole check on this node, process start excluded.
    """

    group_rank: int
    node_id: str
    addr: str
    error: str = ""
    devices: str = ""
    matmul_s: float | None = None
    pairs: tuple[PairTime, ...] = ()
    took_s: float = 0.0


def encode_result(result: NodeResult) -> str:
    """JSON text of ``result`` (what goes through the round's store)."""
    data: dict[str, Any] = {
        "group_rank": result.group_rank,
        "node_id": result.node_id,
        "addr": result.addr,
        "error": result.error,
        "devices": result.devices,
        "matmul_s": result.matmul_s,
        "pairs": [{"peer": p.peer, "seconds": p.seconds, "error": p.error} for p in result.pairs],
        "took_s": result.took_s,
    }
    return json.dumps(data, separators=(",", ":"))


def _number(value: object, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} is not a number of seconds: {value!r}")
    return float(value)


def _text(data: Mapping[str, object], name: str) -> str:
    value = data.get(name, "")
    if not isinstance(value, str):
        raise ValueError(f"{name} is not text: {value!r}")
    return value


def decode_result(key: str, raw: bytes) -> NodeResult:
    """Parse a result written by :func:`encode_result`; nothing in it is executed.

    Raises:
        ValueError: not what an agent writes (names ``key``).
    """
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object: {data!r}")
        rank = data.get("group_rank")
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ValueError(f"group_rank is not a whole number: {rank!r}")
        pairs = []
        for item in data.get("pairs") or []:
            if not isinstance(item, dict) or not isinstance(item.get("peer"), int):
                raise ValueError(f"a pair is not {{peer, seconds, error}}: {item!r}")
            pairs.append(
                PairTime(item["peer"], _number(item.get("seconds"), "a pair"), _text(item, "error"))
            )
        return NodeResult(
            group_rank=rank,
            node_id=_text(data, "node_id"),
            addr=_text(data, "addr"),
            error=_text(data, "error"),
            devices=_text(data, "devices"),
            matmul_s=_number(data.get("matmul_s"), "matmul_s"),
            pairs=tuple(pairs),
            took_s=_number(data.get("took_s"), "took_s") or 0.0,
        )
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"store key {key!r}: not a health-check result ({exc})") from exc


def pair_schedule(n: int) -> list[list[tuple[int, int]]]:
    """The ring pairs ``(i, i+1 mod n)`` of ``n`` nodes, in phases of disjoint pairs: two
    phases (three when ``n`` is odd), so the whole check takes a few pair times at any
    ``n``. Two nodes make one pair; one node none."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    ring = [(i, (i + 1) % n) for i in range(n)]
    last = ring.pop() if n % 2 else None  # (n-1, 0) shares a node with both neighbours
    phases = [ring[0::2], ring[1::2]]
    if last is not None:
        phases.append([last])
    return phases


def pairs_of(n: int, rank: int) -> list[tuple[int, int]]:
    """The pairs ``rank`` is in, in the order it takes them (phase order)."""
    return [pair for phase in pair_schedule(n) for pair in phase if rank in pair]


@dataclass(frozen=True)
class NodeVerdict:
    """One node's outcome: ``passed``, else ``reason`` (one line)."""

    group_rank: int
    node_id: str
    addr: str
    passed: bool
    reason: str = ""
    result: NodeResult | None = None
    best_pair_s: float | None = None

    def line(self) -> str:
        """The node's log line: who, what it measured, the outcome."""
        r = self.result
        measured = "no result"
        if r is not None:
            pairs = " ".join(f"{r.group_rank}-{p.peer}={_seconds(p.seconds)}" for p in r.pairs)
            measured = (
                f"devices {r.devices or '?'}, matmul {_seconds(r.matmul_s)}, "
                f"pairs [{pairs}], check {r.took_s:.2f} s"
            )
        outcome = "passed" if self.passed else f"FAILED: {self.reason}"
        return f"node {self.group_rank} {self.node_id} ({self.addr or '?'}): {measured}; {outcome}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


@dataclass(frozen=True)
class Verdict:
    """Every node's outcome and the references it was judged by."""

    nodes: tuple[NodeVerdict, ...]
    matmul_ref_s: float | None = None
    pair_ref_s: float | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)

    @property
    def failed(self) -> tuple[NodeVerdict, ...]:
        return tuple(n for n in self.nodes if not n.passed)

    def summary(self) -> str:
        """One line for the run's timeline: how many passed, who failed and why."""
        failed = self.failed
        if not failed:
            return f"{len(self.nodes)} node(s) passed"
        names = "; ".join(f"{n.node_id} ({n.reason})" for n in failed)
        return (
            f"{len(self.nodes) - len(failed)} of {len(self.nodes)} node(s) passed; failed: {names}"
        )

    def events(self) -> list[dict[str, Any]]:
        """One record per node for a timeline (JSON-ready)."""
        out = []
        for n in self.nodes:
            r = n.result
            out.append(
                {
                    "group_rank": n.group_rank,
                    "node_id": n.node_id,
                    "addr": n.addr,
                    "passed": n.passed,
                    "reason": n.reason,
                    "devices": r.devices if r else "",
                    "matmul_s": r.matmul_s if r else None,
                    "best_pair_s": n.best_pair_s,
                    "check_s": r.took_s if r else None,
                }
            )
        return out


def _median_low(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def _pair_seconds(results: Mapping[int, NodeResult]) -> dict[tuple[int, int], float]:
    """Each pair's time: the slower of its two sides' measures (inf: a side failed or
    did not report)."""
    seen: dict[tuple[int, int], list[float]] = {}
    for rank, result in results.items():
        for p in result.pairs:
            key = (min(rank, p.peer), max(rank, p.peer))
            seen.setdefault(key, []).append(math.inf if p.seconds is None else p.seconds)
    return {k: max(v) for k, v in seen.items()}


def judge(
    members: Sequence[tuple[str, str]],
    results: Mapping[int, NodeResult],
    thresholds: Thresholds = Thresholds(),
    *,
    missing: str = "no result",
) -> Verdict:
    """Decide which nodes of a round pass (see the module docstring).

    Args:
        members: (node id, address) by group rank, every node of the round.
        results: the results that arrived, by group rank.
        thresholds: how much slower is too slow.
        missing: the reason given to a node whose result never arrived.
    """
    n = len(members)
    ok = {r: res for r, res in results.items() if 0 <= r < n and not res.error}
    matmuls = [res.matmul_s for res in ok.values() if res.matmul_s is not None]
    matmul_ref = _median_low(matmuls)
    pair_time = _pair_seconds(ok)
    best: dict[int, float] = {}
    for rank in ok:
        mine = [t for (a, b), t in pair_time.items() if rank in (a, b)]
        if mine:
            best[rank] = min(mine)
    finite = [t for t in best.values() if math.isfinite(t)]
    pair_ref = _median_low(finite) if len(finite) * 2 > len(best) else None
    verdicts = []
    for rank, (node_id, addr) in enumerate(members):
        result = results.get(rank)
        reason = _reason(rank, result, ok, best, matmul_ref, pair_ref, thresholds, missing)
        verdicts.append(
            NodeVerdict(
                rank, node_id, result.addr if result and result.addr else addr,
                passed=not reason, reason=reason, result=result,
                best_pair_s=best.get(rank) if math.isfinite(best.get(rank, math.inf)) else None,
            )
        )  # fmt: skip
    return Verdict(tuple(verdicts), matmul_ref, pair_ref, thresholds)


def _reason(
    rank: int,
    result: NodeResult | None,
    ok: Mapping[int, NodeResult],
    best: Mapping[int, float],
    matmul_ref: float | None,
    pair_ref: float | None,
    th: Thresholds,
    missing: str,
) -> str:
    if result is None:
        return missing
    if rank not in ok:
        return result.error
    t = result.matmul_s
    if t is not None and matmul_ref is not None and th.slow(t, matmul_ref):
        return (
            f"matmul {t:.3f} s, {t / max(matmul_ref, 1e-9):.0f}x the median {matmul_ref:.3f} s"
            f"; limit {th.factor:g}x and +{th.floor_s:g} s"
        )
    mine = best.get(rank)
    if mine is None or pair_ref is None:
        return ""  # no pairs, or no majority of working pairs to compare with
    if not math.isfinite(mine):
        errors = "; ".join(p.error for p in result.pairs if p.error)
        return f"every all_reduce with its neighbours failed ({errors or 'no time reported'})"
    if th.slow(mine, pair_ref):
        return (
            f"all_reduce with its neighbours {mine:.3f} s at best, "
            f"{mine / max(pair_ref, 1e-9):.0f}x the median {pair_ref:.3f} s"
            f"; limit {th.factor:g}x and +{th.floor_s:g} s"
        )
    return ""
