"""The ``rdzvctl`` commands: connect, run one, map its errors to an exit code.

Loaded only once the command line has been checked (:func:`coordinator.rdzvctl.main.run_command`):
this is where grpc and the etcd client come in. Within it, each command imports what
only it needs (gc's writer, the watch loop, the run's history), so ``status`` and
``list`` load none of them.
"""

from __future__ import annotations

import datetime
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from coordinator.core.errors import CorruptValueError, EtcdConnectionError, EtcdElasticError
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import RunKeys
from coordinator.rdzvctl.cli import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, PROG, Options
from coordinator.rdzvctl.format import (
    change_json,
    change_line,
    gc_json,
    gc_lines,
    list_json,
    list_lines,
    status_json,
    status_lines,
)
from coordinator.rdzvctl.model import RunSnapshot, list_runs, phase, read_run

if TYPE_CHECKING:
    from coordinator.core.events import Event
    from coordinator.rdzvctl.ops import GcResult
    from coordinator.rdzvctl.watch import Change

__all__ = ["run"]

# How long close keeps retrying while the coordinator keeps committing.
_CLOSE_TIMEOUT_S = 30.0
# How many compare-and-swap attempts a drain makes while the coordinator commits.
_DRAIN_TRIES = 20


class _Failed(Exception):
    """The command failed for a reason the message explains (exit code 1)."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _operator() -> str:
    return f"rdzvctl@{socket.gethostname()}"


class _Out:
    """Where a command prints: stdout for results, stderr for warnings and errors."""

    def __init__(self, out: TextIO, err: TextIO, as_json: bool) -> None:
        self.out, self.err, self.json = out, err, as_json

    def lines(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.out.write(line + "\n")
        self.out.flush()

    def data(self, value: Any) -> None:
        self.out.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
        self.out.flush()

    def warn(self, text: str) -> None:
        self.err.write(f"{PROG}: warning: {_one_line(text)}\n")
        self.err.flush()

    def error(self, text: str) -> None:
        self.err.write(f"{PROG}: error: {_one_line(text)}\n")
        self.err.flush()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _require_run(client: EtcdClient, keys: RunKeys) -> None:
    count, _ = client.count_prefix(keys.run_prefix)
    if count == 0:
        raise _Failed(
            f"run {keys.run_id!r} not found: no key starts with "
            f"{keys.run_prefix.decode()}; see '{PROG} list' for the runs there are"
        )


def _run_keys(opts: Options) -> RunKeys:
    if opts.run is None:  # the parser requires RUN for these commands
        raise _Failed(f"{opts.command}: give the run id")
    return RunKeys(opts.key_prefix, opts.run)


def _status(client: EtcdClient, opts: Options, out: _Out) -> int:
    keys = _run_keys(opts)
    snapshot = read_run(client, keys, lease_ttls=True)
    if not snapshot.exists:
        _require_run(client, keys)  # raises: nothing under the run
    if snapshot.errors:
        # The error first: it is what the operator must act on, and what the lines
        # below leave out (a state that does not decode shows no state at all).
        out.error("; ".join(snapshot.errors))
    if opts.json:
        out.data(status_json(snapshot))
    else:
        out.lines(status_lines(snapshot, _now_ms()))
    return EXIT_FAILED if snapshot.errors else EXIT_OK


def _list(client: EtcdClient, opts: Options, out: _Out) -> int:
    found = list_runs(client, opts.key_prefix)
    snapshots = [read_run(client, RunKeys(opts.key_prefix, r)) for r in found.run_ids]
    for snapshot in snapshots:
        for error in snapshot.errors:
            out.warn(error)
    for key in found.foreign_keys:
        # Quoted by hand, not with repr(): a byte that is not UTF-8 shows as \xff, once.
        out.warn(f"key '{key}' is not part of any run (not written by etcd-elastic)")
    if opts.json:
        out.data(list_json(snapshots, opts.key_prefix, found.foreign_keys))
    else:
        out.lines(list_lines(snapshots, opts.key_prefix))
    return EXIT_OK


def _close(client: EtcdClient, opts: Options, out: _Out) -> int:
    from coordinator.core.executor import StateExecutor
    from coordinator.core.run_lease import bind_existing_run_lease

    keys = _run_keys(opts)
    _require_run(client, keys)
    bind_existing_run_lease(client, keys)
    reason = opts.reason or f"closed by an operator with rdzvctl on {socket.gethostname()}"
    outcome = StateExecutor(client, keys, written_by=_operator()).close(
        reason,
        mode="drain",  # agents finish their current attempt, then exit 0
        timeout=_CLOSE_TIMEOUT_S,
    )
    stored = outcome.state.closed_reason
    if opts.json:
        out.data(
            {"run_id": keys.run_id, "closed": True, "changed": outcome.changed,
             "closed_reason": stored, "state_mod_revision": outcome.mod_revision}
        )  # fmt: skip
    elif outcome.changed:
        out.lines(
            [f"run {keys.run_id} closed ({stored}): its agents finish their current "
             "attempt and exit 0; no node joins it again (once all have left, the same "
             "run id starts a new incarnation)"]
        )  # fmt: skip
    else:
        out.lines([f"run {keys.run_id} was closed already ({stored or 'no reason given'})"])
    return EXIT_OK


def _drain(client: EtcdClient, opts: Options, out: _Out) -> int:
    from coordinator.core.actions import drain
    from coordinator.core.event_log import record_event
    from coordinator.core.events import Event
    from coordinator.core.executor import StateExecutor
    from coordinator.core.run_lease import bind_existing_run_lease

    keys = _run_keys(opts)
    node = opts.node or ""
    kv, _ = client.get(keys.node(node))
    if kv is None:
        raise _Failed(
            f"node {node} is not alive in run {keys.run_id} (no key {keys.node(node).decode()}); "
            f"see {PROG} status {keys.run_id}"
        )
    bind_existing_run_lease(client, keys)
    executor = StateExecutor(client, keys, written_by=_operator())

    def asked(revision: int, incarnation: int) -> None:
        # The run's timeline: who asked, at the drain's revision (the node may be gone,
        # and its "drained" departure written, before this write lands).
        event = Event("drain_requested", node_id=node, revision=revision, incarnation=incarnation)
        record_event(client, keys, event, written_by=_operator())

    for _ in range(_DRAIN_TRIES):
        known = executor.read()
        if known[0].closed:
            raise _Failed(f"run {keys.run_id} is closed: its nodes are leaving already")
        actions = drain(known[0], node)
        done = executor.commit(known, actions) if actions else None
        if done is not None and not done.succeeded:
            continue
        if done is not None:
            asked(done.revision, done.state.incarnation)
        if opts.json:
            out.data({"run_id": keys.run_id, "node_id": node, "changed": bool(actions)})
        elif not actions:
            out.lines([f"node {node} of run {keys.run_id} was asked to leave already"])
        else:
            out.lines(
                [f"node {node} of run {keys.run_id} asked to leave: its workers get the "
                 "agent's drain signal and grace, the others re-form without it, and its "
                 "agent exits 0"]
            )  # fmt: skip
        return EXIT_OK
    raise _Failed(f"could not drain {node}: the state of run {keys.run_id} kept changing")


def _one_incarnation(keys: RunKeys, opts: Options, out: _Out, events: list[Event]) -> list[Event]:
    """The events of the incarnation asked for (default: the newest); stderr says when
    another incarnation's were left out."""
    from coordinator.rdzvctl.history import pick_incarnation

    try:
        picked, note = pick_incarnation(keys.run_id, events, opts.incarnation)
    except ValueError as exc:
        raise _Failed(str(exc)) from None
    if note is not None:
        out.err.write(f"{PROG}: {note}\n")
    return picked


def _stored_events(client: EtcdClient, keys: RunKeys, opts: Options, out: _Out) -> list[Event]:
    """The run's events (of one incarnation, see above); each unreadable one is a warning."""
    from coordinator.rdzvctl.history import read_history

    history = read_history(client, keys)
    for error in history.errors:
        out.warn(f"skipped: {error}")
    if not history.events:
        raise _Failed(
            f"run {keys.run_id!r} has no events: nothing under {keys.events_prefix.decode()} "
            "(agents older than the run timeline record none)"
        )
    return _one_incarnation(keys, opts, out, history.events)


def _events(client: EtcdClient, opts: Options, out: _Out) -> int:
    import queue

    from coordinator.rdzvctl.history import Stop, event_json, event_line, follow_history

    keys = _run_keys(opts)
    _require_run(client, keys)

    def emit(event: Event) -> None:
        text = json.dumps(event_json(keys.run_id, event), sort_keys=True) if opts.json else None
        out.out.write((text or event_line(event)) + "\n")
        out.out.flush()

    def on_error(exc: CorruptValueError) -> None:
        out.warn(f"skipped: {exc}")

    if not opts.follow:
        for event in _stored_events(client, keys, opts, out):
            emit(event)
        return EXIT_OK
    inbox: queue.Queue[Any] = queue.Queue()
    installed = threading.current_thread() is threading.main_thread()
    previous: Any = signal.SIG_DFL
    if installed:
        # As watch: Ctrl-C only queues a stop; the loop ends at its next wake-up.
        previous = signal.signal(signal.SIGINT, lambda _sig, _frame: inbox.put(Stop()))
    try:
        follow_history(
            client, keys, emit, on_error, inbox, lambda got: _one_incarnation(keys, opts, out, got)
        )
    finally:
        if installed:
            signal.signal(signal.SIGINT, previous)
    return EXIT_OK


def _timeline(client: EtcdClient, opts: Options, out: _Out) -> int:
    from coordinator.rdzvctl.timeline import draw, prepare

    keys = _run_keys(opts)
    _require_run(client, keys)
    events = _stored_events(client, keys, opts, out)
    try:
        data = prepare(keys.run_id, events)
    except ValueError as exc:
        raise _Failed(str(exc)) from None
    path = opts.output or ""
    try:
        draw(data, path)
    except ImportError:
        raise _Failed(
            "timeline needs matplotlib, which is not installed: "
            "pip install 'etcd-elastic[timeline]' (or pip install matplotlib)"
        ) from None
    except OSError as exc:
        raise _Failed(f"could not write {path}: {exc.strerror or exc}") from None
    out.lines(
        [f"wrote {path}: {len(data.nodes)} node(s), {len(data.bands)} round(s), "
         f"{len(data.marks)} mark(s) from {len(events)} event(s)"]
    )  # fmt: skip
    return EXIT_OK


def _gc(client: EtcdClient, opts: Options, out: _Out) -> int:
    from coordinator.rdzvctl.ops import collect_run, gc_verdict

    found = list_runs(client, opts.key_prefix)
    snapshots: dict[str, RunSnapshot] = {
        r: read_run(client, RunKeys(opts.key_prefix, r)) for r in found.run_ids
    }
    now_ms = _now_ms()
    older_ms = int(opts.older_than * 1000)
    verdicts = [gc_verdict(s, now_ms, older_ms) for s in snapshots.values()]
    results: list[GcResult] | None = None
    if not opts.dry_run:
        results = [
            collect_run(client, snapshots[v.run_id], written_by=_operator())
            for v in verdicts
            if v.collect
        ]
    if opts.json:
        out.data(gc_json(verdicts, results, opts.older_than))
    else:
        out.lines(gc_lines(verdicts, results))
    return EXIT_OK


def _watch(client: EtcdClient, opts: Options, out: _Out) -> int:
    from coordinator.rdzvctl.watch import Inbox, follow

    keys = _run_keys(opts)

    def on_start(snapshot: RunSnapshot) -> None:
        state = snapshot.effective_state
        out.err.write(
            f"{PROG}: watching run {keys.run_id} from etcd revision {snapshot.revision}: "
            f"{phase(snapshot)}, round {state.round}, {len(snapshot.nodes)} node(s) alive"
            f"{'' if snapshot.exists else ' (no key yet)'}; Ctrl-C to stop\n"
        )
        out.err.flush()

    def emit(change: Change) -> None:
        when = datetime.datetime.now()
        text = change_json(keys.run_id, change, when) if opts.json else change_line(change, when)
        out.out.write(text + "\n")
        out.out.flush()

    inbox = Inbox()
    installed = threading.current_thread() is threading.main_thread()
    previous: Any = signal.SIG_DFL
    if installed:
        # Ctrl-C is how a watch ends. A KeyboardInterrupt raised at a random point could
        # land inside the etcd client's thread start-up or shutdown; a handler that only
        # queues a stop ends the loop at its next wake-up instead.
        previous = signal.signal(signal.SIGINT, lambda _sig, _frame: inbox.stop())
    try:
        follow(
            client, keys, emit,
            count=opts.count, timeout=opts.timeout, on_start=on_start, inbox=inbox,
        )  # fmt: skip
    finally:
        if installed:
            signal.signal(signal.SIGINT, previous)
    return EXIT_OK


_COMMANDS: dict[str, Callable[[EtcdClient, Options, _Out], int]] = {
    "status": _status,
    "watch": _watch,
    "events": _events,
    "timeline": _timeline,
    "list": _list,
    "close": _close,
    "drain": _drain,
    "gc": _gc,
}


def run(opts: Options, out: TextIO, err: TextIO) -> int:
    """Run a checked command; returns the exit code (errors are printed as one line)."""
    printer = _Out(out, err, opts.json)
    try:
        with EtcdClient(opts.etcd) as client:
            return _COMMANDS[opts.command](client, opts, printer)
    except EtcdConnectionError as exc:
        # Also EtcdAuthError and EtcdTLSError: the message names the endpoints or files.
        printer.error(str(exc))
        return EXIT_UNREACHABLE
    except (_Failed, EtcdElasticError) as exc:
        printer.error(str(exc))
        return EXIT_FAILED
