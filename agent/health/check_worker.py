"""The pre-flight check of one node, as a short-lived program (``python -m
agent.health.check_worker``), started by :mod:`agent.health.preflight`.

It runs apart from the agent so that the agent never initialises CUDA (its warm
interpreters are forked later; ``docs/warm-start.md``) and a hung device or collective
cannot hang the agent: the agent kills this process when its time is up.

Protocol: the program imports torch first (the agent starts it ahead, while the round
forms) and writes the line ``ready``; then it reads ONE line of JSON from stdin with the
round's parameters, runs the check and writes ONE line of JSON to stdout: the
:class:`agent.health.verdict.NodeResult` (:func:`agent.health.verdict.encode_result`).
Anything else it prints goes to stderr.

What it checks, in order, each step timed:

1. devices: with CUDA, every visible device runs a tiny kernel and synchronises; without,
   the CPU (``cpu``);
2. matmul: ``size`` x ``size`` float32 matmuls, ``repeats`` times after one warm-up, on the
   first device (one torch thread on a CPU: the times compare across nodes);
3. pairs: for each ring pair this node is in (:func:`agent.health.verdict.pairs_of`), a two-rank
   gloo group through the round's bootstrap TCPStore (key prefix per round and pair),
   one warm-up all_reduce (it also waits for the peer), then ``repeats`` timed
   all_reduces of ``numel`` floats. A pair that fails is recorded and the next is tried.

Fault injection (tests only): ``ETCD_ELASTIC_HEALTH_CHECK_DELAY=<seconds>`` makes this
node that much slower in the matmul and in each pair's timed all_reduces, as a node
that is slow for real would be.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

DELAY_ENV = "ETCD_ELASTIC_HEALTH_CHECK_DELAY"
READY = "ready"


def _delay() -> float:
    try:
        return max(0.0, float(os.environ.get(DELAY_ENV, "0") or 0))
    except ValueError:
        return 0.0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def _devices(torch: Any) -> tuple[str, Any]:
    if not torch.cuda.is_available():
        return "cpu", torch.device("cpu")
    count = torch.cuda.device_count()
    for index in range(count):
        x = torch.ones(8, device=f"cuda:{index}")
        if float((x + 1).sum().item()) != 16.0:
            raise RuntimeError(f"cuda:{index} computed a wrong sum")
        torch.cuda.synchronize(index)
    return f"cuda x{count}", torch.device("cuda:0")


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _matmul(torch: Any, device: Any, size: int, repeats: int, delay: float) -> float:
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    (a @ b).sum()
    _sync(torch, device)
    start = time.perf_counter()
    for _ in range(repeats):
        c = a @ b
    float(c[0, 0])
    _sync(torch, device)
    time.sleep(delay)
    return time.perf_counter() - start


def _pairs(torch: Any, params: dict[str, Any], delay: float) -> list[dict[str, Any]]:
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

    from agent.health.verdict import pairs_of

    rank, size = int(params["rank"]), int(params["world_size"])
    mine = pairs_of(size, rank)
    if not mine:
        return []
    timeout = timedelta(seconds=float(params["pair_timeout_s"]))
    store = TCPStore(
        str(params["store_addr"]), int(params["store_port"]), is_master=False,
        timeout=timeout, wait_for_workers=False,
    )  # fmt: skip
    out = []
    for a, b in mine:
        peer = b if rank == a else a
        try:
            prefix = f"{params['prefix']}pair/{a}-{b}/"
            pair_store = PrefixStore(prefix, store)
            group: Any = ProcessGroupGloo(pair_store, 0 if rank == a else 1, 2, timeout)
            tensor = torch.ones(int(params["numel"]))
            group.allreduce([tensor]).wait()
            start = time.perf_counter()
            for _ in range(int(params["repeats"])):
                group.allreduce([tensor]).wait()
            time.sleep(delay)
            out.append({"peer": peer, "seconds": time.perf_counter() - start, "error": ""})
        except Exception as exc:
            out.append({"peer": peer, "seconds": None, "error": _one_line(exc)})
    return out


def check(params: dict[str, Any]) -> dict[str, Any]:
    """Run the check with ``params`` (see :mod:`agent.health.preflight`); the result as
    JSON data."""
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    delay = _delay()
    result: dict[str, Any] = {
        "group_rank": int(params["rank"]),
        "node_id": str(params.get("node_id", "")),
        "addr": str(params.get("addr", "")),
        "error": "",
        "devices": "",
        "matmul_s": None,
        "pairs": [],
    }
    step = "devices"
    try:
        result["devices"], device = _devices(torch)
        step = "matmul"
        result["matmul_s"] = _matmul(
            torch, device, int(params["size"]), int(params["repeats"]), delay
        )
    except Exception as exc:
        result["error"] = f"{step}: {_one_line(exc)}"
    if params.get("pairs", True):
        try:
            result["pairs"] = _pairs(torch, params, delay)
        except Exception as exc:  # the store itself is unreachable
            result["error"] = result["error"] or f"pairs: {_one_line(exc)}"
    result["took_s"] = time.perf_counter() - started
    return result


def main() -> int:
    import torch  # noqa: F401  (imported ahead: the agent starts this process early)

    # The agent's timeout counts from here: a slow import is not a slow node.
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the agent did not need us (it stopped, or the round changed)
    result = check(json.loads(line))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
