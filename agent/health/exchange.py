"""The pre-flight check's result exchange (``etcdrun --health-check``), O(N) per round.

Every node writes its :class:`~agent.health.verdict.NodeResult` to the round's store (one
key each). Group rank 0 gathers them (:func:`agent.store.gather`: on our store one range
read, and while some are missing one watch of their prefix whose events reach rank 0
only), judges them with :func:`~agent.health.verdict.judge` and publishes the verdict
(one key); every other node reads that key (one read, or a watch of that one key). So a
round costs N + 1 writes and O(N) requests and watch events in all, and O(1) requests per
node. Before, every node read every node's result one get at a time (3N² reads).

Why one judge and not every node reading every result with one range read: that would
also be O(N) requests, but O(N²) bytes and, worse, every node woken by every result (N²
watch events). The verdict carries only what the others need: the references it was
judged by, and the nodes that failed with their results and reasons (so every node logs
the same line for each of them); a passed node appears in every node's verdict, without
its measures, which group rank 0 logs. Every node reaches the verdict group rank 0
reached: judging is pure, and the judge is one node.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from agent.health.verdict import (
    NodeResult,
    NodeVerdict,
    Thresholds,
    Verdict,
    decode_result,
    encode_result,
    judge,
)
from agent.store import Store, gather

__all__ = ["RESULT", "VERDICT", "decode_verdict", "encode_verdict", "exchange_results"]

RESULT = "etcd_elastic/preflight/result/"
"""Prefix of the nodes' results in the round's store (``<prefix><group rank>``)."""
VERDICT = "etcd_elastic/preflight/verdict"
"""The key group rank 0 publishes its verdict at."""


def exchange_results(
    store: Store,
    mine: NodeResult,
    world: int,
    members: Sequence[str],
    thresholds: Thresholds,
    wait_s: float,
) -> tuple[Verdict, bool]:
    """Publish this node's result and get the round's verdict.

    Args:
        mine: this node's result (its group rank says whether it judges).
        world: the number of nodes of the round.
        members: node ids by group rank (empty: unknown; the results name them).
        wait_s: how long group rank 0 waits for the results (a result missing after it
            fails its node); the others wait twice as long for the verdict.

    Returns:
        The verdict, and whether this node judged (group rank 0).

    Raises:
        ValueError: a value in the store is not what an agent writes (names the key).
        DistStoreError: no verdict within twice ``wait_s`` (group rank 0 alive but
            silent), or the wait was aborted (the membership changed).
    """
    store.set(f"{RESULT}{mine.group_rank}", encode_result(mine))
    if mine.group_rank != 0:
        store.wait([VERDICT], timedelta(seconds=2 * wait_s))
        return decode_verdict(VERDICT, store.get(VERDICT), mine, world, members), False
    raws = gather(store, RESULT, world, timedelta(seconds=wait_s))
    results = {rank: decode_result(f"{RESULT}{rank}", raw) for rank, raw in raws.items()}
    ids = list(members) or [results[r].node_id if r in results else "?" for r in range(world)]
    verdict = judge(
        [(node, results[r].addr if r in results else "") for r, node in enumerate(ids)],
        results,
        thresholds,
        missing=f"no result within {wait_s:g} s",
    )
    store.set(VERDICT, encode_verdict(verdict))
    return verdict, True


def encode_verdict(verdict: Verdict) -> str:
    """JSON text of what the other nodes need of ``verdict``: O(failed nodes), not O(N)."""
    failed = [
        {
            "group_rank": n.group_rank,
            "node_id": n.node_id,
            "addr": n.addr,
            "reason": n.reason,
            "best_pair_s": n.best_pair_s,
            "result": None if n.result is None else json.loads(encode_result(n.result)),
        }
        for n in verdict.failed
    ]
    data = {
        "world": len(verdict.nodes),
        "matmul_ref_s": verdict.matmul_ref_s,
        "pair_ref_s": verdict.pair_ref_s,
        "factor": verdict.thresholds.factor,
        "floor_s": verdict.thresholds.floor_s,
        "failed": failed,
    }
    return json.dumps(data, separators=(",", ":"))


def _number(data: dict[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} is not a number: {value!r}")
    return float(value)


def decode_verdict(
    key: str, raw: bytes, mine: NodeResult, world: int, members: Sequence[str]
) -> Verdict:
    """The round's verdict as this node knows it: every node, failed ones with their
    result and reason, this node with its own result; nothing in it is executed.

    Raises:
        ValueError: not what :func:`encode_verdict` writes for ``world`` nodes (names
            ``key``).
    """
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or data.get("world") != world:
            raise ValueError(f"not a verdict of {world} node(s)")
        failed: dict[int, NodeVerdict] = {}
        for item in data.get("failed") or []:
            rank = item.get("group_rank") if isinstance(item, dict) else None
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
                raise ValueError(f"a failed node is not {{group_rank, ...}}: {item!r}")
            result = item.get("result")
            failed[rank] = NodeVerdict(
                rank, str(item.get("node_id", "")), str(item.get("addr", "")), passed=False,
                reason=str(item.get("reason", "")), best_pair_s=_number(item, "best_pair_s"),
                result=None if result is None else decode_result(key, json.dumps(result).encode()),
            )  # fmt: skip
        factor, floor_s = _number(data, "factor"), _number(data, "floor_s")
        thresholds = Thresholds(
            Thresholds.factor if factor is None else factor,
            Thresholds.floor_s if floor_s is None else floor_s,
        )
        refs = (_number(data, "matmul_ref_s"), _number(data, "pair_ref_s"))
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, ValueError) as exc:
        raise ValueError(f"store key {key!r}: not a pre-flight verdict ({exc})") from exc
    ids = list(members) if len(members) == world else ["?"] * world
    nodes = []
    for rank in range(world):
        if rank in failed:
            nodes.append(failed[rank])
        elif rank == mine.group_rank:
            nodes.append(NodeVerdict(rank, mine.node_id, mine.addr, passed=True, result=mine))
        else:
            nodes.append(NodeVerdict(rank, ids[rank], "", passed=True))
    return Verdict(tuple(nodes), refs[0], refs[1], thresholds)
