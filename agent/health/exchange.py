"""The pre-flight check's result exchange (``etcdrun --health-check``): O(N) per round,
and nothing of it in etcd where group rank 0's agent hosts the workers' bootstrap store.

Every node writes its :class:`~agent.health.verdict.NodeResult` to a store (one key each).
Group rank 0 gathers them (:func:`agent.store.gather`), judges them with
:func:`~agent.health.verdict.judge` and publishes the verdict (one key); every other node
waits for that key and reads it. So a round costs N + 1 keys, O(N) requests in all and
O(1) per node, in whichever store it runs on:

* the workers' bootstrap ``TCPStore`` (:func:`exchange_on_bootstrap`), where group rank
  0's agent hosts it (:class:`~agent.workers.bootstrap.BootstrapHost`, a new server per
  round, which the check's pairs already use): **0 etcd writes and 0 etcd requests**.
  Only the judge's quarantine write and the timeline events reach etcd. Keys under
  :func:`round_prefix` (per round, should a host outlive its round);
* the round's store (:func:`exchange_results` with :data:`PREFIX`), where nothing of
  ours hosts one (torch's c10d handler serves the workers from its own store, which
  outlives rounds and whose round our loop does not know): on ours, N + 1 etcd writes,
  rank 0's one range read (and while some are missing one watch of their prefix whose
  events reach rank 0 only), and the others' read or watch of the verdict.

Before, every node read every node's result one get at a time from etcd (3N² reads).

Why one judge and not every node reading every result with one range read: that would
also be O(N) requests, but O(N²) bytes and, worse, every node woken by every result (N²
watch events). The verdict carries only what the others need: the references it was
judged by, and the nodes that failed with their results and reasons (so every node logs
the same line for each of them); a passed node appears in every node's verdict, without
its measures, which group rank 0 logs. Every node reaches the verdict group rank 0
reached: judging is pure, and the judge is one node.
"""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import DistError, DistStoreError

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
from agent.workers.bootstrap import connect_bootstrap_store

__all__ = [
    "CONNECT_TIMEOUT_S",
    "PREFIX",
    "READ_WAIT_S",
    "decode_verdict",
    "encode_verdict",
    "exchange_on_bootstrap",
    "exchange_results",
    "round_prefix",
]

PREFIX = "etcd_elastic/preflight/"
"""Where the exchange keeps its keys in the round's own store (scoped to the round):
``<prefix>result/<group rank>`` and ``<prefix>verdict``."""
CONNECT_TIMEOUT_S = 30.0
"""How long a node tries to reach the bootstrap store (it listens before the round's
master address is published, so only an unreachable address takes this long)."""
READ_WAIT_S = 30.0
"""How long the judge of a failed check keeps the bootstrap store's verdict for the
others (they wait on it already, so they read it within milliseconds)."""


def round_prefix(round_id: int) -> str:
    """The keys of round ``round_id``'s check in the bootstrap store: its pairs'
    (``pair/<a>-<b>/``, by the check process) and the results and verdict."""
    return f"etcd_elastic/health/{round_id}/"


def exchange_results(
    store: Store,
    mine: NodeResult,
    world: int,
    members: Sequence[str],
    thresholds: Thresholds,
    wait_s: float,
    prefix: str = PREFIX,
) -> tuple[Verdict, bool]:
    """Publish this node's result and get the round's verdict, through ``store``.

    Args:
        mine: this node's result (its group rank says whether it judges).
        world: the number of nodes of the round.
        members: node ids by group rank (empty: unknown; the results name them).
        wait_s: how long group rank 0 waits for the results (a result missing after it
            fails its node); the others wait twice as long for the verdict.
        prefix: of the exchange's keys in ``store``.

    Returns:
        The verdict, and whether this node judged (group rank 0).

    Raises:
        ValueError: a value in the store is not what an agent writes (names the key).
        DistStoreError: no verdict within twice ``wait_s`` (group rank 0 alive but
            silent), or the wait was aborted (the membership changed).
    """
    results_at, verdict_at = f"{prefix}result/", f"{prefix}verdict"
    store.set(f"{results_at}{mine.group_rank}", encode_result(mine))
    if mine.group_rank != 0:
        store.wait([verdict_at], timedelta(seconds=2 * wait_s))
        raw = store.get(verdict_at)
        return decode_verdict(verdict_at, raw, mine, world, members), False
    raws = gather(store, results_at, world, timedelta(seconds=wait_s))
    results = {r: decode_result(f"{results_at}{r}", raw) for r, raw in raws.items()}
    ids = list(members) or [results[r].node_id if r in results else "?" for r in range(world)]
    verdict = judge(
        [(node, results[r].addr if r in results else "") for r, node in enumerate(ids)],
        results,
        thresholds,
        missing=f"no result within {wait_s:g} s",
    )
    store.set(verdict_at, encode_verdict(verdict))
    return verdict, True


def exchange_on_bootstrap(
    master: tuple[str, int],
    round_id: int,
    mine: NodeResult,
    world: int,
    members: Sequence[str],
    thresholds: Thresholds,
    wait_s: float,
    connect_s: float = CONNECT_TIMEOUT_S,
) -> tuple[Verdict, bool]:
    """:func:`exchange_results` through the round's bootstrap store at ``master``, with a
    client of this exchange's own (dropped after it), under :func:`round_prefix`.

    Its waits cannot be aborted from another thread: an abandoned exchange ends when
    group rank 0's agent releases the server (its next formation, or its exit: every wait
    fails at once), else at its timeout (twice ``wait_s``, and ``connect_s``).

    Raises:
        BootstrapStoreError: the store cannot be reached within ``connect_s``.
        DistStoreError: it failed during the exchange (names the address), or no verdict
            came in time.
        ValueError: a value in it is not what an agent writes.
    """
    addr, port = master
    client = connect_bootstrap_store(
        addr, port, timedelta(seconds=2 * wait_s + connect_s), timedelta(seconds=connect_s)
    )
    prefix = f"{round_prefix(round_id)}preflight/"
    try:
        verdict, judged = exchange_results(client, mine, world, members, thresholds, wait_s, prefix)
        if verdict.failed:
            _keep_for_readers(client, prefix, verdict, mine.group_rank)
        return verdict, judged
    except DistError as exc:  # the connection broke, or a wait timed out
        traceback.clear_frames(exc.__traceback__)  # they hold the client: let it go now
        text = " ".join(str(exc).split())
        raise DistStoreError(
            f"the workers' bootstrap store at {addr}:{port} failed during the exchange: {text}"
        ) from exc
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        del client  # the last reference: disconnects now, not with the phase's thread


def _keep_for_readers(store: Store, prefix: str, verdict: Verdict, rank: int) -> None:
    """A failed check sends group rank 0's agent straight to the next formation, which
    releases the server: so every other node says it read the verdict, and the judge waits
    for those that sent a result (at most :data:`READ_WAIT_S`; one gone fails its own
    wait, and the round re-forms anyway)."""
    if rank != 0:
        store.set(f"{prefix}read/{rank}", "")
        return
    readers = [
        f"{prefix}read/{n.group_rank}"
        for n in verdict.nodes
        if n.group_rank != 0 and n.result is not None
    ]
    if readers:
        with contextlib.suppress(DistError):
            store.wait(readers, timedelta(seconds=READ_WAIT_S))


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
