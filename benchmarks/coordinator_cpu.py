"""The coordinator's CPU per formation, without etcd: N joins replayed through its table.

``python -m benchmarks.coordinator_cpu --nodes 1000 [--from-scratch] [--json]``

Each of N node keys arrives as one watch event (the worst case: etcd batches events
under load, and the duty decides once per batch); after each, the coordinator decides as
its loop does (``NodeTable.tally`` then ``decide_coordinator``), and the last join's
decision completes the round, whose state is then applied and encoded as the commit
would. ``--from-scratch`` passes no tally, so every decision counts all N nodes again
(what an O(N)-per-join coordinator costs). Times are this thread's CPU seconds
(``time.thread_time``): what the machine's load inflates least.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from coordinator.core.actions import apply
from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.node_table import NodeTable
from coordinator.core.state import NodeInfo, RdzvState, encode_node, encode_state
from coordinator.core.transitions import Limits, decide_coordinator

__all__ = ["main", "replay"]

_PREFIX = b"/etcd-elastic/bench/nodes/"


def _events(nodes: int) -> list[WatchEvent]:
    out = []
    for i in range(nodes):
        node = NodeInfo(
            node_id=f"host-{i}-1234-1",
            wanted_round=1,
            addr="10.0.0.1",
            hostname=f"host-{i}",
            pid=1234,
            local_world_size=8,
            lease_id=0x7F00_0000 + i,
            free_port=29500,
        )
        key = _PREFIX + node.node_id.encode()
        kv = KeyValue(key, encode_node(node), i + 2, i + 2, 1, node.lease_id)
        out.append(WatchEvent("put", kv, None))
    return out


def replay(nodes: int, from_scratch: bool = False) -> dict[str, float]:
    """Replay one formation of ``nodes``; CPU seconds of its parts.

    Returns ``table_s`` (decoding and applying the events), ``decide_s`` (every
    decision), ``commit_s`` (apply and encode the completed state), ``decisions``.

    Raises:
        RuntimeError: the replay did not complete the round at the last join.
    """
    events = _events(nodes)
    limits = Limits(nodes, nodes, 1.0)
    state = RdzvState()
    table = NodeTable()
    table.load([], 1)
    table_s = decide_s = 0.0
    decision = None
    for event in events:
        t0 = time.thread_time()
        table.apply([event])
        t1 = time.thread_time()
        tally = None if from_scratch else table.tally(state)
        decision = decide_coordinator(state, table.nodes, limits, 0.0, None, tally=tally)
        t2 = time.thread_time()
        table_s += t1 - t0
        decide_s += t2 - t1
    if decision is None or not decision.actions:
        raise RuntimeError(f"the replay of {nodes} joins did not complete the round")
    t0 = time.thread_time()
    encode_state(apply(state, decision.actions, written_by="bench", now_unix_ms=1))
    commit_s = time.thread_time() - t0
    return {"table_s": table_s, "decide_s": decide_s, "commit_s": commit_s, "decisions": nodes}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordinator_cpu")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--from-scratch", action="store_true", help="count all nodes per join")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    runs = [replay(args.nodes, args.from_scratch) for _ in range(args.repeat)]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    if args.json:
        print(json.dumps({"nodes": args.nodes, "from_scratch": args.from_scratch, "runs": runs}))
    else:
        how = "from scratch per join" if args.from_scratch else "running counts"
        print(
            f"N={args.nodes} ({how}), best of {args.repeat}: decisions {best['decide_s']:.4f} s, "
            f"table {best['table_s']:.4f} s, commit encode {best['commit_s']:.4f} s CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
