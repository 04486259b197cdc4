"""``python -m benchmarks.retention``: what a shared etcd keeps of the jobs that ran on it.

Runs ``--jobs`` jobs (default 200) one after another on a fresh single-member etcd, each
with its own run id, as a scheduler does: ``--nodes`` real handlers (threads of this
process, one etcd client each) form ``--rounds`` rounds, use each round's Store as the
agent does (rank exchange, an exit-barrier counter), record a restart on the timeline,
close the run and leave. ``--parallel`` jobs run at a time. Then it waits until the
retention of the last job passed (plus 10 s) and reports:

* keys and leases left under the key prefix 10 s after the last retention ended
  (target: 0 and 0; leases are counted with ``etcdctl lease list`` when it is there);
* etcd's database size (after compaction at the head revision and a defragmentation)
  before the first job, while the ended jobs are kept, and after their retention
  passed (target: back within 1 MB of the start);
* what one job cost etcd, from etcd's own counters: proposals (raft writes), puts,
  deletes, leases granted and revoked, and ``grpc_messages`` (keep-alives included).

``--retention 0`` measures the old behaviour (everything kept until ``rdzvctl gc``).
Prints JSON. Simulated nodes are threads; no worker process is started (a real job's
workers write nothing to etcd).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import etcd3
from torch.distributed.elastic.rendezvous import RendezvousParameters

from benchmarks.stats import etcd_activity, parse_prometheus
from benchmarks.systems import benchmark_etcd_binary
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.events import Event
from coordinator.etcd_server import EtcdCluster, etcd_version
from coordinator.torch_adapter.handler import EtcdRendezvousHandler, create_handler

__all__ = ["main"]

PREFIX = "/etcd-elastic"


def _job(endpoint: str, run_id: str, nodes: int, rounds: int, retention: float) -> None:
    handlers: list[EtcdRendezvousHandler] = []
    try:
        for _ in range(nodes):
            params = RendezvousParameters(
                "etcd-v3", endpoint, run_id, nodes, nodes,
                last_call_timeout=0.5, join_timeout=60, lease_ttl=1, retention=retention,
            )  # fmt: skip
            handlers.append(create_handler(params, local_world_size=8, role="trainer"))
        for _ in range(rounds):
            with ThreadPoolExecutor(nodes) as joins:
                infos = list(joins.map(lambda h: h.next_rendezvous(), handlers, timeout=120))
            for info in infos:
                # What the agent writes in a round: its role info, its ranks, the barrier.
                store, rank = info.store, info.rank
                store.set(f"etcd_elastic/role_info/{rank}", json.dumps({"group_rank": rank}))
                store.set(f"etcd_elastic/assigned_ranks/{rank}", json.dumps({"base": rank * 8}))
                store.add("etcd_elastic/exit_barrier", 1)
        handlers[0].record_event(
            Event("restarted", node_id=handlers[0].node_id, restart_count=1, summary="rank 0")
        )
        handlers[0].set_closed("the job finished")
    finally:
        for h in handlers:
            h.leave()


def _db_size(raw: Any) -> int:
    """The database size after compaction at the head revision and a defragmentation."""
    revision = int(raw.put("/retention-bench/compact-marker", b"x").header.revision)
    raw.compact(revision, physical=True)
    raw.defragment()
    raw.delete("/retention-bench/compact-marker")
    return int(raw.status().db_size)


def _leases(etcd_binary: Path, endpoint: str) -> int | None:
    etcdctl = etcd_binary.parent / "etcdctl"
    path = str(etcdctl) if etcdctl.exists() else shutil.which("etcdctl")
    if path is None:
        return None
    done = subprocess.run(
        [path, f"--endpoints={endpoint}", "lease", "list", "-w", "json"],
        capture_output=True, text=True, timeout=30, check=True,
        env={"ETCDCTL_API": "3"},
    )  # fmt: skip
    return len(json.loads(done.stdout).get("leases") or [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retention")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--retention", type=float, default=2.0)
    args = parser.parse_args(argv)
    binary = benchmark_etcd_binary()
    out: dict[str, Any] = {
        "etcd": etcd_version(binary),
        "jobs": args.jobs, "nodes": args.nodes, "rounds": args.rounds,
        "retention_s": args.retention,
    }  # fmt: skip
    with EtcdCluster(1, binary=binary) as etcd:
        endpoint = etcd.endpoint_list
        host, port = etcd.endpoints[0].rsplit(":", 1)
        raw = etcd3.client(host=host, port=int(port))
        client = EtcdClient(EtcdConfig(tuple(etcd.endpoints)))
        try:
            out["db_bytes_at_start"] = _db_size(raw)
            before = parse_prometheus(etcd.members[0].metrics())
            started = time.monotonic()
            with ThreadPoolExecutor(args.parallel) as pool:
                done = pool.map(
                    lambda i: _job(endpoint, f"job-{i}", args.nodes, args.rounds, args.retention),
                    range(args.jobs),
                )
                list(done)
            ended = time.monotonic()
            out["jobs_took_s"] = round(ended - started, 1)
            activity = etcd_activity(before, parse_prometheus(etcd.members[0].metrics()))
            out["per_job"] = {k: round(v / args.jobs, 1) for k, v in activity.items() if v}
            out["keys_right_after"] = client.count_prefix(f"{PREFIX}/".encode())[0]
            out["db_bytes_right_after"] = _db_size(raw)
            deadline = ended + args.retention + 10
            while time.monotonic() < deadline:
                if client.count_prefix(f"{PREFIX}/".encode())[0] == 0:
                    out.setdefault("all_keys_gone_after_s", round(time.monotonic() - ended, 1))
                time.sleep(0.5)
            out["keys_left_10s_after_retention"] = client.count_prefix(f"{PREFIX}/".encode())[0]
            out["leases_left_10s_after_retention"] = _leases(binary, endpoint)
            out["db_bytes_after_retention"] = _db_size(raw)
            grown = out["db_bytes_after_retention"] - out["db_bytes_at_start"]
            out["db_growth_bytes"] = grown
            out["db_within_1mb_of_start"] = grown <= 1 << 20
        finally:
            client.close()
            raw.close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
