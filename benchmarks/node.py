"""A node process: holds several simulated nodes (one thread and one handler each).

Run as ``python -m benchmarks.node``. The harness writes one JSON object per line on
stdin and reads one JSON object per line from stdout:

- first line, the spec: ``{"system", "endpoint", "run_id", "min_nodes", "max_nodes",
  "config", "nodes": [node index, ...], "env"?, "id"}``; the process builds one handler per
  node and answers ``{"event": "ready", "id"}`` (or ``{"event": "fatal", "error"}``);
- ``{"cmd": "build", "id", "spec"}``: the next run in the same process (the harness reuses
  node processes across the repeats of one system, so torch is imported once): the old
  handlers are let go (ours leave, torch's stop their heartbeats), new ones are built from
  ``spec`` as above, and the process answers ``{"event": "ready", "id"}``;
- ``{"cmd": "rendezvous", "id", "at", "nodes"}``: each listed node (all if absent) waits
  for the common start ``at`` (``time.monotonic()``, which is system-wide on Linux) and
  calls ``next_rendezvous()``; answers ``{"event": "done", "id", "node", "t_end", "rank",
  "world"}`` or ``{"event": "error", "id", "node", "error"}`` per node;
- ``{"cmd": "on_waiting", "id", "poll", "until"}``: each node calls
  ``next_rendezvous()`` as soon as ``num_nodes_waiting()`` is above 0, checking it when
  the handler announces a change (ours: ``subscribe``) or else every ``poll`` seconds, as
  torch's agent does every monitor interval; answers as above;
- ``{"cmd": "counters", "id"}``: answers ``{"event": "counters", "id", "values"}``;
- ``{"cmd": "stamps", "id", "since"}``: answers ``{"event": "stamps", "id", "values"}``,
  this process's critical-path stamps taken at or after ``since`` and the CPU of its
  threads since the last ``rendezvous`` command (``benchmarks.critical_path``);
- ``{"cmd": "exit"}`` or end of input: the process exits at once (the run is over; its
  servers are thrown away, so nobody needs a clean leave).

Run as ``python -m benchmarks.node --store-host PORT``, it hosts the TCPStore of torch's
c10d backend until its stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

__all__ = ["main"]

_out_lock = threading.Lock()


def _emit(message: dict[str, Any]) -> None:
    line = json.dumps(message)
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _wait_until(at: float) -> None:
    # The common start of a measured step: a timestamp, not a condition to poll.
    delay = at - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _rendezvous(handler: Any, node: int, cmd_id: int) -> None:
    try:
        info = handler.next_rendezvous()
        t_end = time.monotonic()
        _emit(
            {
                "event": "done",
                "id": cmd_id,
                "node": node,
                "t_end": t_end,
                "rank": int(info.rank),
                "world": int(info.world_size),
            }
        )
    except Exception as exc:
        _emit({"event": "error", "id": cmd_id, "node": node, "error": _describe(exc)})


def _run_rendezvous(handler: Any, node: int, cmd: dict[str, Any]) -> None:
    _wait_until(float(cmd["at"]))
    _rendezvous(handler, node, int(cmd["id"]))


def _run_on_waiting(handler: Any, node: int, cmd: dict[str, Any]) -> None:
    poll = float(cmd["poll"])
    until = float(cmd["until"])
    cmd_id = int(cmd["id"])
    # Ours announces changes (subscribe), as our agent uses it; torch's handler has no such
    # thing, so torch's agent polls at its monitor interval, and so do we for it.
    changed = threading.Event()
    subscribe = getattr(handler, "subscribe", None)
    unsubscribe = subscribe(changed.set) if callable(subscribe) else None
    try:
        while handler.num_nodes_waiting() == 0:
            left = until - time.monotonic()
            if left <= 0:
                _emit({"event": "error", "id": cmd_id, "node": node, "error": "no node waiting"})
                return
            if unsubscribe is not None:
                changed.wait(left)
                changed.clear()
            else:
                time.sleep(poll)
    except Exception as exc:
        _emit({"event": "error", "id": cmd_id, "node": node, "error": _describe(exc)})
        return
    finally:
        if unsubscribe is not None:
            unsubscribe()
    _rendezvous(handler, node, cmd_id)


def _build(spec: dict[str, Any], counters: Any) -> dict[int, Any] | None:
    from benchmarks.handlers import build_handler

    os.environ.update({str(k): str(v) for k, v in spec.get("env", {}).items()})
    handlers: dict[int, Any] = {}
    try:
        for node in spec["nodes"]:
            handlers[int(node)] = build_handler(spec, counters)
    except Exception as exc:
        _emit({"event": "fatal", "error": _describe(exc)})
        return None
    _emit({"event": "ready", "pid": os.getpid(), "id": spec.get("id")})
    return handlers


def _serve(spec: dict[str, Any]) -> None:
    from benchmarks import critical_path
    from benchmarks.handlers import Counters, handler_counters, release_handlers

    counters = Counters()
    cpu_at_start: dict[int, tuple[str, float]] = {}
    handlers = _build(spec, counters)
    if handlers is None:
        return
    for line in sys.stdin:
        cmd = json.loads(line)
        kind = cmd["cmd"]
        if kind == "exit":
            return
        if kind == "build":
            # Let the previous run's handlers go before the next run's are built, so their
            # threads (heartbeats, watches) do not load the next measurement.
            release_handlers(list(handlers.values()))
            handlers = _build({**cmd["spec"], "id": cmd["id"]}, counters)
            if handlers is None:
                return
            continue
        if kind == "stamps":
            values = critical_path.process_report(float(cmd["since"]), cpu_at_start)
            _emit({"event": "stamps", "id": cmd["id"], "values": values})
            continue
        if kind == "rendezvous":
            cpu_at_start = critical_path.thread_cpu_by_id()
        if kind == "counters":
            values = counters.snapshot()
            values.update(handler_counters(list(handlers.values())))
            _emit({"event": "counters", "id": cmd["id"], "values": values})
            continue
        target = _run_rendezvous if kind == "rendezvous" else _run_on_waiting
        wanted = cmd.get("nodes")
        for node, handler in handlers.items():
            if wanted is None or node in wanted:
                threading.Thread(
                    target=target, args=(handler, node, cmd), name=f"node-{node}", daemon=True
                ).start()


def _host_store(port: int) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60)
    )
    _emit({"event": "ready", "pid": os.getpid(), "port": store.port})
    sys.stdin.read()


def main(argv: list[str]) -> None:
    """Entry point; see the module docstring for the protocol."""
    if len(argv) == 2 and argv[0] == "--store-host":
        _host_store(int(argv[1]))
    else:
        from benchmarks import profiling

        profiling.enable_from_env()
        _serve(json.loads(sys.stdin.readline()))
        profiling.dump()
    sys.stdout.flush()
    # Handler threads (heartbeats, watches) are not ours to join: the run is over.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
