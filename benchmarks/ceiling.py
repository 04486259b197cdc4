"""The etcd-ceiling scenario: how many single-key transactions per second this etcd takes.

A fresh one-member etcd on disk (fsync on, as in every scenario). Clients are threads in
two client processes, each thread with its own key doing compare-and-swap transactions
(compare the key's ``mod_revision``, put on success, read on failure: the shape of a
rendezvous join) back to back through etcd's gRPC stubs directly, so the figure is the
server's limit, not our client's. The sample is committed transactions per second at the
best of a few concurrency levels. Formation can then be put as a fraction of the
physical limit: N transactions / ceiling.

Run as ``python -m benchmarks.ceiling ENDPOINT PREFIX CLIENTS AT SECONDS`` it is one
client process, printing ``{"ok", "failed", "errors"}`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from typing import Any

from benchmarks.procs import Child, RunError
from benchmarks.runner import Sample, environment, measure
from benchmarks.systems import System

__all__ = ["etcd_ceiling"]

_CLIENT_PROCESSES = 2
_LEVELS = (8, 64, 256)


def _client_thread(stub: Any, rpc: Any, key: bytes, at: float, end: float, out: list[int]) -> None:
    ok = failed = errors = 0
    revision = 0
    delay = at - time.monotonic()
    if delay > 0:
        time.sleep(delay)  # the common start
    while time.monotonic() < end:
        request = rpc.TxnRequest(
            compare=[
                rpc.Compare(
                    key=key,
                    result=rpc.Compare.EQUAL,
                    target=rpc.Compare.MOD,
                    mod_revision=revision,
                )
            ],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=b"x"))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))],
        )
        try:
            response = stub.Txn(request, timeout=10)
        except Exception:
            errors += 1
            continue
        if response.succeeded:
            ok += 1
            revision = response.header.revision
        else:
            failed += 1
            kvs = response.responses[0].response_range.kvs
            revision = kvs[0].mod_revision if kvs else 0
    out.extend([ok, failed, errors])


def _client_main(argv: list[str]) -> None:
    import grpc
    from etcd3 import etcdrpc

    endpoint, prefix, clients, at, seconds = argv
    channel = grpc.insecure_channel(endpoint)
    stub = etcdrpc.KVStub(channel)
    end = float(at) + float(seconds)
    results: list[list[int]] = [[] for _ in range(int(clients))]
    threads = [
        threading.Thread(
            target=_client_thread,
            args=(stub, etcdrpc, f"{prefix}/{i}".encode(), float(at), end, results[i]),
        )
        for i in range(int(clients))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()
    total = [sum(r[i] for r in results if r) for i in range(3)]
    print(json.dumps({"ok": total[0], "failed": total[1], "errors": total[2]}), flush=True)


def _level(system: System, clients: int, seconds: float, tag: str) -> dict[str, float]:
    replies: queue.Queue[Any] = queue.Queue()
    per_process = max(1, clients // _CLIENT_PROCESSES)
    # Client processes need a moment to import grpc before the common start.
    at = time.monotonic() + 3.0
    children = [
        Child(
            i,
            [
                "-m",
                "benchmarks.ceiling",
                system.endpoint(),
                f"/bench/ceiling/{tag}/{i}",
                str(per_process),
                repr(at),
                repr(seconds),
            ],
            replies,
        )
        for i in range(_CLIENT_PROCESSES)
    ]
    try:
        totals = {"ok": 0.0, "failed": 0.0, "errors": 0.0}
        deadline = at + seconds + 60
        done = 0
        while done < len(children):
            try:
                index, reply = replies.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RunError(f"ceiling clients gave no answer {seconds + 60:.0f} s") from None
            if reply.get("event") == "eof":
                code = children[index].proc.wait()
                if code != 0:
                    tail = children[index].log_tail()
                    raise RunError(f"ceiling client {index} exited with {code}:\n{tail}")
                continue
            for key in totals:
                totals[key] += float(reply[key])
            done += 1
    finally:
        for child in children:
            child.stop()
    return {
        "txn_per_s": totals["ok"] / seconds,
        "failed_cas_per_s": totals["failed"] / seconds,
        "errors": totals["errors"],
    }


def etcd_ceiling(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the ceiling (``--seconds`` per concurrency level; 5 s unless given)."""
    seconds = 1.0 if args.smoke else (args.seconds or 5.0)
    levels = (8,) if args.smoke else _LEVELS

    def run(system: System, index: int) -> Sample:
        figures: dict[str, float] = {}
        best = 0.0
        for clients in levels:
            level = _level(system, clients, seconds, f"r{index}c{clients}")
            figures[f"txn_per_s_at_{clients}_clients"] = level["txn_per_s"]
            figures[f"errors_at_{clients}_clients"] = level["errors"]
            best = max(best, level["txn_per_s"])
        return Sample(best, figures)

    shared = {
        "clients": list(levels),
        "client_processes": _CLIENT_PROCESSES,
        "seconds_per_level": seconds,
    }
    systems = measure(["etcd"], run, args.repeat, shared)
    systems["etcd"]["ratio_vs_torch_c10d"] = None
    method = (
        f"threads in {_CLIENT_PROCESSES} client processes, one key each, back-to-back "
        "compare-and-swap Txn (compare mod_revision, put; read on failure) through etcd's "
        f"gRPC stubs for {seconds:g} s at each of {list(levels)} concurrent clients; the "
        "sample is committed transactions per second at the best level."
    )
    return {
        "scenario": "etcd-ceiling",
        "point": f"clients {list(levels)}",
        "unit": "transactions per second",
        "method": method,
        "environment": environment(),
        "systems": systems,
    }


if __name__ == "__main__":
    _client_main(sys.argv[1:])
